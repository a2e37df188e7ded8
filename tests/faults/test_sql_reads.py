"""SQL that cannot write: ``tracedb sql`` without ``--write`` (and ``db.sql(read_only=True)``).

Opening the file read-only was the whole guarantee, and a string undid it:
``USE memory; DETACH <alias>; ATTACH '<file>' AS w; DELETE FROM w.traces`` deleted every
trace and exited 0. Now every statement is judged by DuckDB's parser before any runs
(:mod:`tracedb.sqlcheck`): reads run, anything else is one line and exit 2, and the file's
bytes are what they were. ``POST /sql`` (``tests/api/test_sql.py``) and ``tracedb lake sql``
(``tests/lake/test_lake_sql.py``) take the same check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tracedb
from tracedb.cli.main import app
from tracedb.errors import SqlRefused

from support import FIXTURES
from support.hostile import on_disk

ENV = {k: v for k, v in os.environ.items() if k not in ("TRACEDB_TOKEN", "TRACEDB_DB")}


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("sqlreads") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest([FIXTURES / "linear.traces.jsonl", FIXTURES / "groups.traces.jsonl"])
    return path


def writes(path: Path, alias: str, scratch: Path) -> dict[str, str]:
    """Statements that would change a database (or the instance), by name. ``alias`` is
    the catalog the file is attached as, ``scratch`` a directory of the test's own."""
    other = scratch / "other.duckdb"
    csv = scratch / "rows.csv"
    csv.write_text("x\n1\n")
    return {
        "detach-attach-delete": f"USE memory; DETACH {alias}; ATTACH '{path}' AS w; DELETE FROM w.traces",
        "attach-writable-then-delete": f"ATTACH '{path}' AS w; DELETE FROM w.traces",
        "attach-another-file": f"ATTACH '{other}' AS w; CREATE TABLE w.t AS SELECT 1 AS x",
        "detach": f"DETACH {alias}",
        "use": "USE memory",
        "write-after-a-read": "SELECT count(*) FROM traces; DELETE FROM traces",
        "write-after-two-reads": "SELECT 1; SELECT 2; UPDATE traces SET reward = 0",
        "delete": "DELETE FROM traces",
        "insert": "INSERT INTO credit_sets (name, algorithm) VALUES ('x', 'y')",
        "create-as": "CREATE TABLE memory.copy AS SELECT * FROM traces",
        "create-temp-as": "CREATE TEMP TABLE t AS SELECT 1 AS x",
        "create-macro": "CREATE MACRO m() AS 1",
        "drop": "DROP TABLE rejects",
        "alter": "ALTER TABLE traces ADD COLUMN x INTEGER",
        "merge": "MERGE INTO rejects USING rejects r ON false WHEN MATCHED THEN DELETE",
        "copy-from": f"COPY rejects FROM '{csv}'",
        "copy-from-database": f"COPY FROM DATABASE {alias} TO memory",
        "copy-over-the-database": f"COPY (SELECT 1 AS x) TO '{path}' (FORMAT csv)",
        "copy-over-its-wal": f"COPY (SELECT 1 AS x) TO '{path}.wal' (FORMAT csv)",
        "copy-partitions-over-its-directory": (
            f"COPY (SELECT 1 AS x, 2 AS y) TO '{path.parent}' (FORMAT csv, PARTITION_BY (x), OVERWRITE)"
        ),
        "export-database": f"EXPORT DATABASE '{scratch / 'exported'}'",
        "import-database": f"IMPORT DATABASE '{scratch / 'exported'}'",
        "pragma-writes": "PRAGMA enable_checkpoint_on_shutdown",
        "pragma-force-checkpoint": "PRAGMA force_checkpoint",
        "pragma-reads-too": "PRAGMA database_size",
        "set-external-access": "SET enable_external_access = true",
        "set-threads": "SET threads = 1",
        "reset": "RESET threads",
        "set-variable": "SET VARIABLE x = 1",
        "install": "INSTALL json",
        "load": "LOAD json",
        "load-a-file": f"LOAD '{scratch / 'evil.duckdb_extension'}'",
        "update-extensions": "UPDATE EXTENSIONS",
        "checkpoint": "CHECKPOINT",
        "force-checkpoint": "FORCE CHECKPOINT",
        "call-checkpoint": "CALL checkpoint()",
        "call-force-checkpoint": "CALL force_checkpoint()",
        "call-enable-logging": f"CALL enable_logging(storage := 'file', storage_path := '{scratch / 'logs'}')",
        "transaction": "BEGIN; DELETE FROM traces; COMMIT",
        "commit": "COMMIT",
        "prepare-execute": "PREPARE p AS DELETE FROM traces; EXECUTE p",
        "vacuum": "VACUUM",
        "analyze": "ANALYZE",
        "pivot": "PIVOT (SELECT 'a' AS k, 1 AS v) ON k USING sum(v)",
        "explain-analyze-delete": "EXPLAIN ANALYZE DELETE FROM traces",
        "explain-options-analyze-insert": "EXPLAIN (ANALYZE, FORMAT json) INSERT INTO rejects SELECT * FROM rejects",
        "explain-analyze-create-temp": "/* hidden */ EXPLAIN ANALYZE CREATE TEMP TABLE t AS SELECT 1",
        "explain-analyze-set": "EXPLAIN ANALYZE SET threads = 1",
        "explain-analyze-load": "EXPLAIN ANALYZE LOAD json",
    }


READS = {
    "select": ("SELECT count(*) AS n FROM traces", None),
    "macro": ("SELECT count(*) AS n FROM branch_stats()", None),
    "describe": ("DESCRIBE traces", None),
    "show": ("SHOW TABLES", None),
    "summarize": ("SUMMARIZE SELECT reward FROM traces", None),
    "explain": ("EXPLAIN SELECT * FROM traces", None),
    "explain-analyze": ("EXPLAIN ANALYZE SELECT count(*) FROM traces", None),
    "explain-options": ("EXPLAIN (ANALYZE, FORMAT json) SELECT 1", None),
    "two-reads": ("SELECT 1 AS a; SELECT 2 AS b", [{"b": 2}]),
    "pragma-as-a-table-function": ("SELECT name FROM pragma_table_info('traces') LIMIT 1", [{"name": "trace_id"}]),
    "checkpoint-of-a-read-only-file": ("SELECT * FROM checkpoint()", []),  # nothing to do
    "with": ("WITH t AS (SELECT 1 AS x) SELECT x FROM t", [{"x": 1}]),
}


def attempt(db: tracedb.Database, sql: str) -> str:
    """What came of ``sql`` as ``tracedb sql`` runs it: the refusal's words, else ``ran``."""
    try:
        db.sql(sql, read_only=True)
    except SqlRefused as e:
        return str(e)
    return "ran"


def test_no_statement_that_writes_runs_and_the_file_is_unchanged(db_path, tmp_path):
    before = on_disk(db_path)
    attached = "SELECT database_name, path, readonly FROM duckdb_databases() ORDER BY 1"
    with tracedb.connect(db_path, read_only=True) as db:
        databases = db.sql(attached).to_pylist()
        cases = writes(db_path, db.handle.catalog, tmp_path)
        got = {name: attempt(db, sql) for name, sql in cases.items()}
        still = db.sql("SELECT count(*) AS n FROM traces").column("n")[0].as_py()
        assert db.sql(attached).to_pylist() == databases  # nothing attached, detached or reopened
    ran = [name for name, outcome in got.items() if outcome == "ran"]
    assert ran == [], ran
    for name, outcome in got.items():
        assert "\n" not in outcome and ("does not only read" in outcome or "COPY" in outcome or "kind" in outcome), (
            name,
            outcome,
        )
    assert "statement 2 of 2 is DELETE" in got["write-after-a-read"]
    assert "statement 1 of 4 is SET (or USE, RESET)" in got["detach-attach-delete"]
    assert "under EXPLAIN is DELETE" in got["explain-analyze-delete"]
    assert still == 33
    assert on_disk(db_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rows.csv"]  # nothing attached, exported or logged


def test_reads_run_and_a_copy_to_a_file_is_an_export(db_path, tmp_path):
    before = on_disk(db_path)
    with tracedb.connect(db_path, read_only=True) as db:
        for name, (sql, rows) in READS.items():
            table = db.sql(sql, read_only=True)
            assert table.num_rows > 0 or rows == [], name
            if rows is not None:
                assert table.to_pylist() == rows, name
        out = tmp_path / "ids.csv"
        db.sql(f"COPY (SELECT trace_id FROM traces ORDER BY 1) TO '{out}' (HEADER false)", read_only=True)
        assert len(out.read_text().splitlines()) == 33
        db.sql(f"COPY traces TO '{tmp_path / 'traces.parquet'}'", read_only=True)
    assert on_disk(db_path) == before


def test_write_opens_the_file_for_statements_that_change_it(db_path, tmp_path):
    copy = tmp_path / "w.duckdb"
    copy.write_bytes(db_path.read_bytes())
    runner = CliRunner()
    done = runner.invoke(app, ["sql", "CREATE TABLE notes AS SELECT 1 AS x; DELETE FROM rejects", "--db", str(copy)])
    refused = runner.invoke(app, ["sql", "CREATE TABLE notes AS SELECT 1 AS x", "--db", str(copy)])
    assert refused.exit_code == 2 and "--write" in refused.stderr
    done = runner.invoke(
        app, ["sql", "CREATE TABLE notes AS SELECT 1 AS x; DELETE FROM rejects", "--db", str(copy), "--write"]
    )
    assert done.exit_code == 0, done.output
    with tracedb.connect(copy, read_only=True) as db:
        assert db.sql("SELECT x FROM notes").to_pylist() == [{"x": 1}]


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tracedb", *args], capture_output=True, text=True, timeout=120, env=ENV, cwd=cwd
    )


def test_the_command_refuses_in_one_line_and_deletes_nothing(db_path, tmp_path):
    """The issue's case as a user runs it: a fresh process attaches the file as
    ``runs_0``; the string detaches it, attaches it writable and deletes. Exit 2, one
    line, no traceback, every trace still there (and ``--json`` reads them)."""
    before = on_disk(db_path)
    alias = run_cli("sql", "SELECT current_database() AS d", "--db", str(db_path), "--json", cwd=tmp_path)
    assert alias.returncode == 0, alias.stderr
    name = alias.stdout.split('"d": "')[1].split('"')[0]
    attack = f"USE memory; DETACH {name}; ATTACH '{db_path}' AS w; DELETE FROM w.traces"
    done = run_cli("sql", attack, "--db", str(db_path), cwd=tmp_path)
    assert done.returncode == 2, (done.stdout, done.stderr)
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "USE" in lines[0] and "--write" in lines[0], done.stderr
    assert "Traceback" not in done.stderr
    assert on_disk(db_path) == before
    count = run_cli("sql", "SELECT count(*) AS n FROM traces", "--db", str(db_path), "--json", cwd=tmp_path)
    assert '"n": 33' in count.stdout, count.stdout
