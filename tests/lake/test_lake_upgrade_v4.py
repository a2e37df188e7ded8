"""Upgrading a version-2 lake to version 4 (3: segments beside their traces; 4: the file
store's schema-6 columns): a lake laid out as version 2 (segments bucketed by their own
ids, 16 buckets, no bucket count recorded) holding the rows schema 5 really wrote (``tests/fixtures/schema/
v5.duckdb``: verifiers 0.4.1 spans among the nodes' unknown fields, dropped traces and
``run.work`` in the records), in two writes. Open refuses it; ``init`` adds the columns
and fills them with the values ``tracedb migrate`` gives the same file (records and
seqs unchanged), also when rerun after a crash before its traces rewrite, and a rerun
after it is done changes nothing."""

from __future__ import annotations

import shutil

import duckdb
import pyarrow as pa
import pytest
from pyiceberg.transforms import BucketTransform

import tracedb

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb.lake import catalog, compact, policy_columns, upgrade  # noqa: E402

from support import REPO  # noqa: E402

V5 = REPO / "tests" / "fixtures" / "schema" / "v5.duckdb"
COLUMNS = (
    "SELECT t.trace_id, t.dropped, t.work_type, t.policy_min, t.policy_max, t.policy_unknown, "
    "e.work_type, e.work_step, e.policy_start, e.policy_end FROM traces t LEFT JOIN episodes e USING (episode_id) "
    "ORDER BY t.trace_id"
)
SPANS = "SELECT trace_id, node_index, weight_versions FROM nodes WHERE weight_versions IS NOT NULL ORDER BY ALL"


def _v2_schemas():
    """The lake's tables as layout 2 had them: schema 5's columns, no ``policy_labels``
    (``segments``' lake columns are layout 3's: see :func:`_v2_lake`)."""
    out = {}
    for name, schema in catalog.lake_tables().items():
        if name == "policy_labels":
            continue
        added = policy_columns.ADDED.get(name, ())
        out[name] = pa.schema([f for f in schema if f.name not in added], metadata=schema.metadata)
    return out


def _v2_lake(path, monkeypatch):
    """A version-2 lake holding v5.duckdb's rows, its traces in two writes."""
    schemas = _v2_schemas()
    with monkeypatch.context() as patched:
        patched.setattr(catalog, "lake_tables", lambda: schemas)
        patched.setattr(catalog, "LAKE_SCHEMA_VERSION", 2)
        path.mkdir()
        made = catalog.create(catalog.locate(path), buckets=catalog.OLD_BUCKETS)
    where = catalog.locate(path).catalog()
    where.drop_table("tracedb.segments")  # layout 2: bucketed by its own ids, without the lake's columns
    segments = where.create_table("tracedb.segments", schema=schemas["segments"])
    with segments.update_spec() as update:
        update.add_field("segment_id", BucketTransform(catalog.OLD_BUCKETS), "segment_id_bucket")
    made["segments"] = where.load_table("tracedb.segments")
    meta = made[catalog.META]
    meta.overwrite(pa.table({"key": ["lake_schema_version"], "value": ["2"]}, schema=meta.schema().as_arrow()))
    con = duckdb.connect(str(V5), read_only=True)
    try:
        ids = [r[0] for r in con.execute("SELECT trace_id FROM traces ORDER BY seq, trace_id").fetchall()]
        halves = [ids[: len(ids) // 2], ids[len(ids) // 2 :]]
        for k, chosen in enumerate(halves):
            batch = f"write-{k}"
            con.execute("CREATE OR REPLACE TEMP TABLE chosen AS SELECT unnest(?::VARCHAR[]) AS trace_id", [chosen])
            for name in [*(n for n in schemas if n != "traces"), "traces"]:
                schema = schemas[name]
                if catalog.per_trace(name, schema):
                    where = "WHERE trace_id IN (SELECT trace_id FROM chosen)"
                elif name == "episodes":
                    where = "WHERE episode_id IN (SELECT episode_id FROM traces SEMI JOIN chosen USING (trace_id))"
                elif k:
                    continue  # segments, rejects, credit sets: with the first write
                else:
                    where = ""
                rows = con.sql(f"SELECT * FROM {name} {where}").to_arrow_table()
                if name == "traces":
                    empty = pa.nulls(rows.num_rows, pa.int64())
                    rows = rows.set_column(rows.schema.get_field_index("seq"), "seq", empty)
                table = made[name]
                table.refresh()
                if catalog.batched(name, schema) and catalog.BATCH in table.schema().column_names:
                    rows = rows.append_column(catalog.BATCH, pa.array([batch] * rows.num_rows, pa.string()))
                table.append(rows.cast(table.schema().as_arrow()))
    finally:
        con.close()
    return path


@pytest.fixture(scope="module")
def migrated(tmp_path_factory):
    """v5.duckdb upgraded by the file store's migration (what the lake must equal)."""
    path = tmp_path_factory.mktemp("migrated") / "v5.duckdb"
    shutil.copy(V5, path)
    with tracedb.connect(path):
        pass
    return path


def _query(path, sql):
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def _snapshots(lake):
    return {name: lake.table(name).current_snapshot() for name in lake._tables}


def test_a_version_2_lake_is_upgraded_to_the_migrated_files_columns(tmp_path, migrated, monkeypatch):
    path = _v2_lake(tmp_path / "L", monkeypatch)
    with pytest.raises(lakes.LakeError, match=r"lake schema version 2, this tracedb reads 4; upgrade it with "):
        lakes.open(path)
    real = compact.rewrite_traces

    def crash(*args, **kwargs):
        raise RuntimeError("killed before the traces rewrite")

    monkeypatch.setattr(compact, "rewrite_traces", crash)  # segments rehomed, nodes and episodes filled, traces not yet
    with pytest.raises(RuntimeError, match="killed"):
        lakes.init(path)
    monkeypatch.setattr(compact, "rewrite_traces", real)
    with pytest.raises(lakes.LakeError, match="lake schema version 2"):
        lakes.open(path)  # still version 2 until the meta row
    lake = lakes.init(path)  # the rerun
    assert catalog.meta_rows(lake.table(catalog.META)) == {"lake_schema_version": "4", "buckets": "16"}
    tables = lake.tables()
    seqs = dict(zip(*tables["traces"].select(["trace_id", "seq"]).to_pydict().values(), strict=True))
    assert sorted(set(seqs.values())) == [1, 2]  # each write's commit, kept by the rewrite
    pulled = tmp_path / "pulled.duckdb"
    assert lake.pull(pulled) == 50
    assert _query(pulled, COLUMNS) == _query(migrated, COLUMNS)
    assert _query(pulled, SPANS) == _query(migrated, SPANS)
    with tracedb.connect(pulled, read_only=True) as got, tracedb.connect(migrated, read_only=True) as want:
        for trace_id in seqs:
            assert got.trace(trace_id) == want.trace(trace_id), trace_id
        assert got.branches().equals(want.branches())
    rewrite = lake.table("traces").current_snapshot()
    assert rewrite.summary[upgrade.UPGRADED] == "4"
    after = _snapshots(lake)
    assert upgrade.upgrade(lake.location) is None  # of this version: nothing to do
    catalog.set_meta(lake.table(catalog.META), {catalog.VERSION_KEY: "2"})  # a rerun, as after a crash
    assert upgrade.upgrade(lake.location) == 2
    again = _snapshots(lake)
    assert {n for n in after if after[n] != again[n]} == {catalog.META}  # filled already: nothing rewritten
