"""Upgrading a version-1 lake (writers stored the file store's seq in traces rows) to
version 2, then on to 3 (which fills nothing here: this tracedb's writer stored the new
columns): open refuses it naming the versions and the upgrade, ``init`` upgrades it
(every trace's seq its commit's, as a fresh push gives), crash-safe and idempotent."""

from __future__ import annotations

import pyarrow as pa
import pytest

import tracedb

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb.lake import catalog, upgrade, write  # noqa: E402
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
    catalog.set_meta(lake.table(catalog.META), catalog.VERSION_KEY, "1")
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
    with pytest.raises(lakes.LakeError, match=r"lake schema version 1, this tracedb reads 3; upgrade it with "):
        lakes.open(tmp_path / "L")
    with pytest.raises(lakes.LakeError, match=rf"`tracedb lake init --warehouse {tmp_path / 'L'}`"):
        lakes.open(tmp_path / "L")
    before = _snapshots(old)

    lake = lakes.init(tmp_path / "L")
    assert catalog.meta_rows(lake.table(catalog.META)) == {"lake_schema_version": "3"}
    got = _sorted(lake.tables())
    assert _seqs(got) == _seqs(fresh) and set(_seqs(got).values()) == {1, 2, 3}  # each write's commit
    assert got == fresh
    after = _snapshots(lake)
    changed = {n for n in before if before[n] != after[n]}
    assert changed == {"traces", catalog.META}  # only traces rewritten
    rewrite = after["traces"]
    assert rewrite.summary[upgrade.UPGRADED] == "2" and rewrite.sequence_number == lake.watermark() > 3
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
    assert tables["traces"].current_snapshot().summary[upgrade.UPGRADED] == "2"  # the rewrite committed
    writer = _v1_writer(monkeypatch)  # a version-1 writer appends meanwhile
    with tracedb.connect(store, read_only=True) as db:
        late = write.append(catalog.Opened(location, tables), file_rows(db, ids[-4:]))
    monkeypatch.setattr(write, "lake_rows", writer)

    lake = lakes.init(tmp_path / "L")  # the rerun: the rewritten rows keep their seq, the late ones get theirs
    seqs = _seqs(lake.tables())
    assert {t: seqs[t] for t in ids[:-4]} == {t: 1 for t in ids[:-4]}  # the first write's commit, not the rewrite's
    assert {seqs[t] for t in ids[-4:]} == {late.sequence_number} and late.sequence_number > 1
    assert lake.watermark() > 3 and catalog.meta_rows(lake.table(catalog.META))["lake_schema_version"] == "3"
