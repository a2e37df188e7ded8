"""Schema 5 -> 6 (``tracedb/migrations.py`` ``_v5_to_v6``) on the file schema 5 really wrote
(``tests/fixtures/schema/v5.duckdb``, see its README: verifiers 0.4.1 records among its
rows, their spans kept with the nodes' unknown fields): the spans get their column, the
dropped traces and episodes' work their columns, every trace its policy-version bounds
(equal to what a fresh ingest of the same files stores), records read back as before,
and the layout is exactly a fresh database's."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb

import tracedb

from support import FIXTURES, FIXTURES_041, REPO

SCHEMA_DIR = REPO / "tests" / "fixtures" / "schema"
COLUMNS = (
    "SELECT t.trace_id, t.dropped, t.policy_min, t.policy_max, t.policy_unknown, "
    "e.work_type, e.work_step, e.policy_start, e.policy_end FROM traces t LEFT JOIN episodes e USING (episode_id) "
    "ORDER BY t.trace_id"
)
SPANS = "SELECT trace_id, node_index, weight_versions FROM nodes WHERE weight_versions IS NOT NULL ORDER BY ALL"


def copy_of(tmp_path: Path) -> Path:
    path = tmp_path / "v5.duckdb"
    shutil.copy(SCHEMA_DIR / "v5.duckdb", path)
    return path


def query(path: Path, sql: str) -> list[tuple]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def test_the_fixture_is_a_version_5_file_holding_041_records():
    path = SCHEMA_DIR / "v5.duckdb"
    assert query(path, "SELECT value FROM tracedb_meta WHERE key = 'schema_version'") == [("5",)]
    columns = {r[0] for r in query(path, "SELECT column_name FROM duckdb_columns() WHERE table_name = 'traces'")}
    assert "dropped" not in columns and "policy_min" not in columns
    assert query(path, "SELECT count(*) FROM nodes WHERE extra LIKE '%\"weight_versions\"%'")[0][0] == 51


def test_the_migration_equals_a_fresh_ingest(tmp_path):
    """The migrated file holds the columns a fresh ingest of the same files stores."""
    path = copy_of(tmp_path)
    with tracedb.connect(path):  # a read-write open upgrades
        pass
    fresh = tmp_path / "fresh.duckdb"
    with tracedb.connect(fresh) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        db.ingest(FIXTURES / "groups.traces.jsonl")
        db.ingest(sorted(FIXTURES_041.glob("*.traces.jsonl")))
        db.ingest(FIXTURES / "compaction.traces.jsonl")  # what the fixture's follower read
    migrated = query(path, COLUMNS)
    assert migrated == query(fresh, COLUMNS)
    assert query(path, SPANS) == query(fresh, SPANS)
    dropped = [r for r in migrated if r[1] is not None]
    assert len(dropped) == 2 and all(isinstance(r[1], str) for r in dropped)
    assert {r[5] for r in migrated} >= {"train", "eval", None}
    assert any(r[2] is not None for r in migrated) and any(r[4] for r in migrated)


def test_records_read_back_as_before(tmp_path):
    """The spans stay among the unknown fields of a migrated node (and are in the column
    too): ``db.trace`` gives the record as schema 5 gave it."""
    path = copy_of(tmp_path)
    with tracedb.connect(fresh := tmp_path / "plain.duckdb") as ref:
        ref.ingest(sorted(FIXTURES_041.glob("*.traces.jsonl")))
        ids = ref.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist()
        want = {t: ref.trace(t) for t in ids}
    assert fresh.exists()
    with tracedb.connect(path) as db:
        for trace_id, record in want.items():
            assert db.trace(trace_id) == record, trace_id


def test_the_migrated_layout_is_a_fresh_databases(tmp_path):
    path = copy_of(tmp_path)
    fresh = tmp_path / "fresh.duckdb"
    with tracedb.connect(path), tracedb.connect(fresh):
        pass
    here = "database_name = current_database() AND schema_name = 'main'"
    sql = (
        "SELECT table_name, column_index, column_name, data_type, is_nullable, column_default "
        f"FROM duckdb_columns() WHERE {here} ORDER BY ALL"
    )
    assert query(path, sql) == query(fresh, sql)
