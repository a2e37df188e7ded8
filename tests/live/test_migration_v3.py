"""Schema 2 -> 3 (``tracedb/migrations.py`` ``_v2_to_v3``) on the file schema 2 really
wrote (``tests/fixtures/schema/v2.duckdb``: linear, then groups, ingested): the stored
traces are numbered in ingest order, the watermark is theirs, the new tables are there
and empty, and the file's layout is exactly a fresh database's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import duckdb
import pytest

import tracedb

from support import FIXTURES, REPO

SCHEMA_DIR = REPO / "tests" / "fixtures" / "schema"
LINEAR = FIXTURES / "linear.traces.jsonl"
GROUPS = FIXTURES / "groups.traces.jsonl"
FOREST = FIXTURES / "forest.traces.jsonl"


def trace_ids_of(path: Path) -> list[str]:
    return [t["id"] for line in path.read_text().splitlines() if line.strip() for t in json.loads(line)["traces"]]


def copy_of(tmp_path: Path, version: int) -> Path:
    path = tmp_path / f"v{version}.duckdb"
    shutil.copy(SCHEMA_DIR / f"v{version}.duckdb", path)
    return path


def query(path: Path, sql: str) -> list[tuple]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql).fetchall()
    finally:
        con.close()


def layout(path: Path) -> dict[str, list[tuple[str, str]]]:
    """table -> its (column name, type) in column order, as DuckDB reads the file."""
    rows = query(
        path,
        "SELECT table_name, column_name, data_type FROM duckdb_columns() "
        "WHERE database_name = current_database() AND schema_name = 'main' "
        "ORDER BY table_name, column_index",
    )
    out: dict[str, list[tuple[str, str]]] = {}
    for table, name, dtype in rows:
        out.setdefault(table, []).append((name, dtype))
    return out


def details(path: Path) -> tuple[list[tuple], list[tuple]]:
    """Every column's nullability and default, and every constraint."""
    here = "database_name = current_database() AND schema_name = 'main'"
    columns = query(
        path,
        f"SELECT table_name, column_name, is_nullable, column_default FROM duckdb_columns() WHERE {here} ORDER BY ALL",
    )
    constraints = query(
        path,
        f"SELECT table_name, constraint_type, constraint_text FROM duckdb_constraints() WHERE {here} ORDER BY ALL",
    )
    return columns, constraints


def stored_version(path: Path) -> str:
    return query(path, "SELECT value FROM tracedb_meta WHERE key = 'schema_version'")[0][0]


@pytest.fixture
def fresh_file(tmp_path: Path) -> Path:
    path = tmp_path / "fresh.duckdb"
    with tracedb.connect(path):
        pass
    return path


@pytest.mark.parametrize(
    ("version", "sources"),
    [(2, [LINEAR, GROUPS]), (1, [LINEAR])],
    ids=["v2", "v1"],
)
def test_stored_traces_are_numbered_in_ingest_order(tmp_path, version, sources):
    path = copy_of(tmp_path, version)
    assert stored_version(path) == str(version)
    expected = [tid for source in sources for tid in trace_ids_of(source)]
    with tracedb.connect(path) as db:
        rows = db.sql("SELECT trace_id, seq FROM traces ORDER BY seq").to_pylist()
        assert [r["trace_id"] for r in rows] == expected  # linear's first: it was ingested first
        assert [r["seq"] for r in rows] == list(range(1, len(expected) + 1))
        n = len(expected)
        assert db.watermark() == n == db.stats()["watermark"]
        assert db.sql("SELECT count(*) AS n FROM traces WHERE seq IS NULL").column("n")[0].as_py() == 0
        for table in ("trace_tags", "follow_positions"):
            assert db.sql(f"SELECT count(*) AS n FROM {table}").column("n")[0].as_py() == 0
        assert db.traces(after=1).column("trace_id").to_pylist() == expected[1:]
    assert stored_version(path) == str(tracedb.SCHEMA_VERSION)


def test_the_v2_file_reads_live_after_migration(tmp_path):
    path = copy_of(tmp_path, 2)
    with tracedb.connect(path) as db:
        table = db.traces(complete_groups=8)
        assert sorted(set(table.column("group_id").to_pylist())) == [f"group-{g}" for g in range(4)]
        assert table.num_rows == 32 and tracedb.watermark_of(table) == 33
        assert db.traces(complete_groups=8, after=33).num_rows == 0
        assert tracedb.watermark_of(db.branches(after=0)) == 33


@pytest.mark.parametrize("version", [2, 1])
def test_the_migrated_layout_is_a_fresh_databases(tmp_path, fresh_file, version):
    path = copy_of(tmp_path, version)
    with tracedb.connect(path):
        pass
    migrated, fresh = layout(path), layout(fresh_file)
    assert {"trace_tags", "follow_positions"} <= set(fresh)
    assert sorted(migrated) == sorted(fresh)
    for table in fresh:
        assert migrated[table] == fresh[table], table
    assert ("seq", "BIGINT") in fresh["traces"]
    assert details(path) == details(fresh_file)  # NOT NULL, defaults, keys too


def test_a_new_ingest_into_the_migrated_file_continues_the_numbers(tmp_path):
    path = copy_of(tmp_path, 2)
    with tracedb.connect(path) as db:
        assert db.ingest(GROUPS).watermark is None  # all stored already: no number
        assert db.watermark() == 33
        report = db.ingest(FOREST, tags=["step=1"])
        assert report.watermark == 34
        (forest_id,) = trace_ids_of(FOREST)
        assert db.traces(after=33).column("trace_id").to_pylist() == [forest_id]
        assert db.traces(tags={"step": 1}).column("seq").to_pylist() == [34]
    with tracedb.connect(path, read_only=True) as db:  # and it stays so on disk
        assert db.watermark() == 34
        assert db.sql("SELECT max(seq) AS m FROM traces").column("m")[0].as_py() == 34
