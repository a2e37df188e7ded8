"""Schema 6 -> 7 (``tracedb/migrations.py`` ``_v6_to_v7``) on the file schema 6 really wrote
(``tests/fixtures/schema/v6.duckdb``, see its README): token ids and streams move into
``segment_store`` / ``node_store`` as text (:mod:`tracedb.codec`), ``nodes`` and
``segments`` become views that read exactly the rows schema 6 held (every column,
schema 6's own included: ``weight_versions``, widened loss weights, a written stream that
is not decimal), records and views read as a fresh ingest's, the layout is a fresh
database's, and a migration that fails leaves the file as it was."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb
import numpy as np
import pytest

import tracedb
from tracedb import codec, dbfile, runtime

from support import FIXTURES_041, REPO

SCHEMA_DIR = REPO / "tests" / "fixtures" / "schema"
NODES = "SELECT * FROM nodes ORDER BY trace_id, node_index"
SEGMENTS = "SELECT * FROM segments ORDER BY segment_id"


def copy_of(tmp_path: Path) -> Path:
    path = tmp_path / "v6.duckdb"
    shutil.copy(SCHEMA_DIR / "v6.duckdb", path)
    return path


def query(path: Path, sql: str) -> list[tuple]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_the_fixture_is_a_version_6_file():
    path = SCHEMA_DIR / "v6.duckdb"
    assert query(path, "SELECT value FROM tracedb_meta WHERE key = 'schema_version'") == [("6",)]
    tables = {r[0] for r in query(path, "SELECT table_name FROM duckdb_tables()")}
    assert {"nodes", "segments"} <= tables and "node_store" not in tables
    assert query(path, "SELECT count(*) FROM nodes WHERE weight_versions IS NOT NULL")[0][0] > 0


def test_the_views_read_exactly_the_rows_schema_6_held(tmp_path):
    """Every node and segment column, value for value (the float32 streams bit for bit)."""
    path = copy_of(tmp_path)
    before_nodes, before_segments = query(path, NODES), query(path, SEGMENTS)
    with tracedb.connect(path) as db:  # a read-write open upgrades
        assert db.sql("SELECT value FROM tracedb_meta WHERE key = 'schema_version'").column(0).to_pylist() == ["7"]
    assert query(path, NODES) == before_nodes
    assert query(path, SEGMENTS) == before_segments
    kinds = query(path, "SELECT left(logprobs, 1) AS form, count(*) FROM node_store GROUP BY ALL ORDER BY ALL")
    assert {k for k, _ in kinds} - {None} <= {"+", "-", "~", "="}
    for stream in ("logprobs", "advantages", "reference_logprobs", "trainer_logprobs", "entropies"):
        both = f"SELECT count(*) FROM node_store WHERE {stream} IS NOT NULL AND {stream}_list IS NOT NULL"
        assert query(path, both) == [(0,)], stream  # a row's stream is text or a list, never both
    # the batch holding computed values (not fixed point) keeps its streams as lists; the
    # advantages (fixed point, constant over a node's tokens) as text
    assert query(path, "SELECT count(*) FROM node_store WHERE reference_logprobs IS NOT NULL") == [(0,)]
    assert query(path, "SELECT count(*) FROM node_store WHERE reference_logprobs_list IS NOT NULL")[0][0] > 2
    assert query(path, "SELECT count(*) FROM node_store WHERE left(advantages, 1) IN ('+', '-', '~')")[0][0] > 100


def test_a_schema_6_file_in_the_storage_format_tracedb_writes_upgrades(tmp_path):
    """Schema 6 files tracedb wrote since 0.x's DuckDB 1.5 storage (``STORAGE_VERSION``;
    the fixture predates it) upgrade in place, keeping their format."""
    path = copy_of(tmp_path)
    before_nodes, before_segments = query(path, NODES), query(path, SEGMENTS)
    assert dbfile.rewrite_storage(path)["to_storage"] == runtime.STORAGE_VERSION + "+"
    with tracedb.connect(path) as db:
        assert db.sql("SELECT value FROM tracedb_meta WHERE key = 'schema_version'").column(0).to_pylist() == ["7"]
    assert query(path, NODES) == before_nodes
    assert query(path, SEGMENTS) == before_segments
    con = duckdb.connect()
    try:
        con.execute(f"ATTACH '{path}' AS f (READ_ONLY)")
        assert dbfile.storage_version(con, "f") == runtime.STORAGE_VERSION + "+"
    finally:
        con.close()


def test_records_and_views_read_as_a_fresh_ingest(tmp_path):
    path = copy_of(tmp_path)
    with tracedb.connect(tmp_path / "fresh.duckdb") as ref:
        ref.ingest(sorted(FIXTURES_041.glob("*.traces.jsonl")))
        ref.set_policy_versions({"ckpt-abc": 12})  # as the fixture's writer did
        ids = ref.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist()
        want = {t: ref.trace(t) for t in ids}
        want_branches = ref.branches(trace_ids=ids).sort_by([("trace_id", "ascending"), ("branch_index", "ascending")])
    written = 0
    with tracedb.connect(path) as db:
        for trace_id, record in want.items():
            got = db.trace(trace_id)
            for node, theirs in zip(got["nodes"], record["nodes"], strict=True):
                if "reference_logprobs" in node and "reference_logprobs" not in theirs:
                    # the fixture's write_nodes (computed values: kept as decimals), exactly
                    values = node.pop("reference_logprobs")
                    assert values == [float(str(np.float32(0.1 * (k + 1) + 1e-3 / 3))) for k in range(len(values))]
                    written += 1
            assert got == record, trace_id
        got = db.branches(trace_ids=ids).sort_by([("trace_id", "ascending"), ("branch_index", "ascending")])
        other = [c for c in ("seq", "reference_logprobs") if c in got.column_names]  # written: compared above
        assert got.drop_columns(other).equals(want_branches.drop_columns(other))
        assert written == 2
        assert db.trace(ids[0], credit="gae")["nodes"]  # a named set's advantages still join


def test_the_migrated_layout_is_a_fresh_databases(tmp_path):
    path = copy_of(tmp_path)
    fresh = tmp_path / "fresh.duckdb"
    with tracedb.connect(path), tracedb.connect(fresh):
        pass
    here = "database_name = current_database() AND schema_name = 'main'"
    columns = (
        "SELECT table_name, column_index, column_name, data_type, is_nullable, column_default "
        f"FROM duckdb_columns() WHERE {here} ORDER BY ALL"
    )
    assert query(path, columns) == query(fresh, columns)
    keys = (
        "SELECT table_name, constraint_type, constraint_column_names FROM duckdb_constraints() "
        f"WHERE {here} ORDER BY ALL"
    )
    assert query(path, keys) == query(fresh, keys)


def test_a_failed_migration_leaves_the_file_as_it_was(tmp_path, monkeypatch):
    path = copy_of(tmp_path)
    before = query(path, NODES)

    def boom(*args, **kwargs):
        raise RuntimeError("disk full, say")

    monkeypatch.setattr(codec, "stream_lists", boom)
    with pytest.raises(RuntimeError, match="disk full"):
        tracedb.connect(path)
    assert query(path, "SELECT value FROM tracedb_meta WHERE key = 'schema_version'") == [("6",)]
    assert query(path, NODES) == before
    tables = {r[0] for r in query(path, "SELECT table_name FROM duckdb_tables()")}
    assert "node_store" not in tables and not any(t.startswith("_v6_") for t in tables)
    monkeypatch.undo()
    with tracedb.connect(path):  # and the next open upgrades it
        pass
    assert query(path, NODES) == before
