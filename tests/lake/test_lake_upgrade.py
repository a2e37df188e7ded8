"""Upgrading a lake of an older layout: version 1 (writers stored the file store's seq in
traces rows) and version 2 (segments bucketed by their own ids, 16 buckets) to this one
(4; the step to 4 fills nothing here: this tracedb's writer stored the policy columns);
open refuses them naming the versions and the upgrade, ``init`` upgrades them (every
trace's seq its commit's, segments beside their traces, as a fresh push gives),
crash-safe and idempotent; columns the file store's schema gains are added (read null)."""

from __future__ import annotations

import pyarrow as pa
import pytest
from pyiceberg.transforms import BucketTransform

import tracedb

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb import tables as stored_tables  # noqa: E402
from tracedb.lake import catalog, files, upgrade, write  # noqa: E402
from tracedb.lake.move import file_rows  # noqa: E402

WRITE = 15
"""Traces per push write: the 44 golden traces in three writes (three seqs)."""


@pytest.fixture(scope="module")
def store(golden_store):
    """A file store holding every golden fixture."""
    return golden_store


@pytest.fixture(scope="module")
def fresh(store, tmp_path_factory):
    """What a push by this tracedb gives: the visible tables, sorted."""
    lake = lakes.init(tmp_path_factory.mktemp("fresh") / "L")
    lake.push(store, batch_traces=WRITE)
    return _sorted(lake.tables())


def _sorted(tables):
    out = {}
    for name, table in tables.items():
        keys = [f.name for f in table.schema if not pa.types.is_nested(f.type)]
        out[name] = table.sort_by([(c, "ascending") for c in keys])
    return out


def _seqs(tables):
    traces = tables["traces"]
    return dict(zip(traces.column("trace_id").to_pylist(), traces.column("seq").to_pylist(), strict=True))


def _v1_writer(monkeypatch):
    """Make this process's writer store the file store's seq in traces rows, as version 1 did."""
    real = write.lake_rows

    def kept(name, rows, batch):
        table = real(name, rows, batch)
        if name == "traces":
            table = table.set_column(table.schema.get_field_index("seq"), "seq", rows.column("seq").cast(pa.int64()))
        return table

    monkeypatch.setattr(write, "lake_rows", kept)
    return real


def _v1_lake(path, store, monkeypatch, ids=None):
    """A version-1 lake: pushed by a version-1 writer, its meta row saying 1."""
    lake = lakes.init(path)
    real = _v1_writer(monkeypatch)
    if ids is None:
        lake.push(store, batch_traces=WRITE)
    else:
        with tracedb.connect(store, read_only=True) as db:
            lake.append(file_rows(db, ids))
    monkeypatch.setattr(write, "lake_rows", real)
    catalog.set_meta(lake.table(catalog.META), {catalog.VERSION_KEY: "1"})
    return lake


def _snapshots(lake):
    return {name: lake.table(name).current_snapshot() for name in lake._tables}


def test_open_refuses_a_version_1_lake_and_init_upgrades_it(tmp_path, store, fresh, monkeypatch):
    old = _v1_lake(tmp_path / "L", store, monkeypatch)
    stored = old.table("traces").scan(selected_fields=("trace_id", "seq")).to_arrow()
    with tracedb.connect(store, read_only=True) as db:
        file_seqs = {r["trace_id"]: r["seq"] for r in db.sql("SELECT trace_id, seq FROM traces").to_pylist()}
    assert dict(zip(*stored.to_pydict().values(), strict=True)) == file_seqs  # the file store's numbering
    assert file_seqs != _seqs(fresh)  # which is not the lake's: a version-2 reader would take it
    with pytest.raises(lakes.LakeError, match=r"lake schema version 1, this tracedb reads 4; upgrade it with "):
        lakes.open(tmp_path / "L")
    with pytest.raises(lakes.LakeError, match=rf"`tracedb lake init --warehouse {tmp_path / 'L'}`"):
        lakes.open(tmp_path / "L")
    before = _snapshots(old)

    lake = lakes.init(tmp_path / "L")
    assert catalog.meta_rows(lake.table(catalog.META)) == {"lake_schema_version": "4", "buckets": "64"}
    got = _sorted(lake.tables())
    assert _seqs(got) == _seqs(fresh) and set(_seqs(got).values()) == {1, 2, 3}  # each write's commit
    assert got == fresh
    after = _snapshots(lake)
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {"traces", catalog.META}  # only traces rewritten
    rewrite = after["traces"]
    assert rewrite.summary[upgrade.UPGRADED] == "4" and rewrite.sequence_number == lake.watermark() > 3
    assert lake.table("traces").scan(selected_fields=("seq",)).to_arrow().column("seq").null_count == 0

    again = lakes.init(tmp_path / "L")  # of this version: nothing to do
    assert _snapshots(again) == after and upgrade.upgrade(again.location) is None
    lakes.open(tmp_path / "L")


def test_a_rerun_after_a_crash_between_the_rewrite_and_the_meta_row(tmp_path, store, fresh, monkeypatch):
    with tracedb.connect(store, read_only=True) as db:
        ids = db.sql("SELECT trace_id FROM traces ORDER BY seq, trace_id").column("trace_id").to_pylist()
    _v1_lake(tmp_path / "L", store, monkeypatch, ids[:-4])
    real = catalog.set_meta

    def crash(*args):
        raise RuntimeError("killed before the meta row")

    monkeypatch.setattr(catalog, "set_meta", crash)
    with pytest.raises(RuntimeError, match="killed"):
        lakes.init(tmp_path / "L")
    monkeypatch.setattr(catalog, "set_meta", real)
    location = catalog.locate(tmp_path / "L")
    with pytest.raises(lakes.LakeError, match="version 1"):
        lakes.open(tmp_path / "L")  # still version 1: a version-1 writer may still append
    tables = {n: location.catalog().load_table(f"tracedb.{n}") for n in (catalog.META, *catalog.lake_tables())}
    assert tables["traces"].current_snapshot().summary[upgrade.UPGRADED] == "4"  # the rewrite committed
    writer = _v1_writer(monkeypatch)  # a version-1 writer appends meanwhile
    with tracedb.connect(store, read_only=True) as db:
        late = write.append(catalog.Opened(location, tables), file_rows(db, ids[-4:]))
    monkeypatch.setattr(write, "lake_rows", writer)

    lake = lakes.init(tmp_path / "L")  # the rerun: the rewritten rows keep their seq, the late ones get theirs
    seqs = _seqs(lake.tables())
    assert {t: seqs[t] for t in ids[:-4]} == {t: 1 for t in ids[:-4]}  # the first write's commit, not the rewrite's
    assert {seqs[t] for t in ids[-4:]} == {late.sequence_number} and late.sequence_number > 1
    assert lake.watermark() > 3 and catalog.meta_rows(lake.table(catalog.META))["lake_schema_version"] == "4"


def _v2_lake(path, store):
    """A version-2 lake as tracedb 2 wrote it: 16 buckets, ``segments`` bucketed by
    ``segment_id`` without the lake's columns, each table appended by pyiceberg (one
    write per WRITE traces, traces last), the meta row saying 2 and no bucket count."""
    lake = lakes.init(path, buckets=catalog.OLD_BUCKETS)
    where = lake.location.catalog()
    where.drop_table("tracedb.segments")
    old = pa.schema([f.with_nullable(True).remove_metadata() for f in stored_tables.STORED["segments"]])
    segments = where.create_table("tracedb.segments", schema=old)
    with segments.update_spec() as update:
        update.add_field("segment_id", BucketTransform(catalog.OLD_BUCKETS), "segment_id_bucket")
    meta = lake.table(catalog.META)
    meta.overwrite(pa.table({"key": ["lake_schema_version"], "value": ["2"]}, schema=meta.schema().as_arrow()))
    lake = catalog.Opened(lake.location, {n: where.load_table(f"tracedb.{n}") for n in lake._tables})
    with tracedb.connect(store, read_only=True) as db:
        ids = db.sql("SELECT trace_id FROM traces ORDER BY seq, trace_id").column("trace_id").to_pylist()
        for start in range(0, len(ids), WRITE):
            rows = file_rows(db, ids[start : start + WRITE], rejects=start == 0)
            batch = f"v2-write-{start}"
            for name in [n for n in catalog.lake_tables() if n not in ("traces", "rejects")] + ["traces", "rejects"]:
                table = rows.get(name)
                if table is None or table.num_rows == 0:
                    continue
                if name == "segments":
                    lake.table(name).append(table.cast(old))
                else:
                    lake.table(name).append(write.lake_rows(name, table, batch))
    return ids


def test_a_version_2_lake_is_upgraded_segments_beside_their_traces(tmp_path, store, fresh, monkeypatch):
    ids = _v2_lake(tmp_path / "L", store)
    with pytest.raises(
        lakes.LakeError, match=r"lake schema version 2, this tracedb reads 4; upgrade it with .*segments"
    ):
        lakes.open(tmp_path / "L")
    real = catalog.set_meta

    def crash(*args):
        raise RuntimeError("killed before the meta row")

    monkeypatch.setattr(catalog, "set_meta", crash)
    with pytest.raises(RuntimeError, match="killed"):
        lakes.init(tmp_path / "L")
    monkeypatch.setattr(catalog, "set_meta", real)
    with pytest.raises(lakes.LakeError, match="version 2"):
        lakes.open(tmp_path / "L")
    location = catalog.locate(tmp_path / "L")
    rewritten = location.catalog().load_table("tracedb.segments").current_snapshot()
    assert rewritten.summary[upgrade.UPGRADED] == "4"

    lake = lakes.init(tmp_path / "L")  # the rerun: segments are rewritten already, only the meta row is set
    assert lake.table("segments").current_snapshot() == rewritten
    assert catalog.meta_rows(lake.table(catalog.META)) == {"lake_schema_version": "4", "buckets": "16"}
    assert lake.buckets == catalog.OLD_BUCKETS
    segments = lake.table("segments")
    assert [(f.name, str(f.transform)) for f in segments.spec().fields] == [("lake_trace_bucket", "bucket[16]")]
    got = _sorted(lake.tables())
    assert got == fresh  # what a push by this tracedb gives (seqs included)
    live = files.live_files(segments)
    rows = files.read(segments, live, ["segment_id", "lake_trace", "lake_batch"])
    assert rows.column("lake_batch").null_count == 0 and rows.column("lake_trace").null_count == 0
    nodes = got["nodes"]
    want = set(
        zip(
            files.buckets(segments, "lake_trace", nodes.column("trace_id").combine_chunks()).to_pylist(),
            nodes.column("segment_id").to_pylist(),
        )
    )
    stored = files.buckets(segments, "lake_trace", rows.column("lake_trace").combine_chunks()).to_pylist()
    assert (
        set(zip(stored, rows.column("segment_id").to_pylist()))
        == want
        == set(zip(stored, rows.column("segment_id").to_pylist(), strict=True))
    )
    assert len(stored) == len(want)  # each segment once per bucket using it
    plan = lake.micro_batches(512, ranks=2)
    with tracedb.connect(store, read_only=True) as db:
        local = db.micro_batches(512, ranks=2)
        assert [[(m.tokens, m.samples) for m in r] for r in plan] == [[(m.tokens, m.samples) for m in r] for r in local]
    assert lake.push(store).traces == 0 and lake.tables()["traces"].num_rows == len(ids)


def test_columns_the_stored_schema_gains_are_added_and_read_null(tmp_path, store, monkeypatch):
    """The upgrade is generic: a column the file store's schema has and a lake table lacks
    (a new stored schema's) is added, nullable; rows written before read null there,
    rows written after keep their values; open refuses the lake until then. (The columns
    are ones no stored schema has: schema 6's are in the lake's tables already.)"""
    lake = lakes.init(tmp_path / "L")
    lake.push(store, batch_traces=WRITE)
    before = _sorted(lake.tables())
    grown = dict(stored_tables.STORED)
    grown["traces"] = grown["traces"].append(pa.field("review_note", pa.string()))
    weights = pa.list_(pa.struct([("version", pa.string()), ("start", pa.int32()), ("end", pa.int32())]))
    grown["nodes"] = grown["nodes"].append(pa.field("tool_spans", weights))
    monkeypatch.setattr(stored_tables, "STORED", grown)
    with pytest.raises(lakes.LakeError, match=r"lack columns .*traces: review_note; nodes: tool_spans.*lake init"):
        lakes.open(tmp_path / "L")
    lake = lakes.init(tmp_path / "L")
    assert "review_note" in lake.table("traces").schema().column_names
    assert catalog.meta_rows(lake.table(catalog.META))["lake_schema_version"] == str(lakes.LAKE_SCHEMA_VERSION)
    assert upgrade.add_columns(lambda n: lake.table(n)) == {}  # added once
    read_back = lake.tables()
    assert read_back["traces"].column("review_note").null_count == read_back["traces"].num_rows
    assert read_back["nodes"].column("tool_spans").null_count == read_back["nodes"].num_rows
    assert {
        n: t.drop_columns([c for c in ("review_note", "tool_spans") if c in t.column_names])
        for n, t in _sorted(read_back).items()
    } == before
    with tracedb.connect(store, read_only=True) as db:
        ids = db.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist()
    other = lakes.init(tmp_path / "M")  # a write after: the new columns carry values
    with tracedb.connect(store, read_only=True) as db:
        rows = file_rows(db, ids[:2])
    rows["traces"] = rows["traces"].append_column("review_note", pa.array(["stale policy", None]))
    other.append(rows)
    dropped = other.tables()["traces"].sort_by("trace_id")
    assert sorted(dropped.column("review_note").to_pylist(), key=str) == [None, "stale policy"]
