"""What ``tracedb.connect`` refuses before writing anything, and how a file is installed:
trace-file paths (swapped arguments), directories, files of another kind, DuckDB
databases that are not tracedb's; a first install in one transaction, a first install cut
short (repaired when empty, refused holding data), macros written only when they changed.

Every refusal leaves the file as it was, byte for byte (:func:`support.hostile.on_disk`)."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import duckdb
import pytest

import tracedb
from tracedb import dbfile
from tracedb.errors import DatabaseError, SchemaVersionError
from tracedb.sqltext import load_sql

from support import FIXTURES
from support.hostile import duckdb_run, on_disk, stored_version

MODES = pytest.mark.parametrize("read_only", [False, True], ids=["read-write", "read-only"])


def unversioned(path: Path, *rows: str) -> Path:
    """tracedb's tables without the schema_version row (a first install killed before it
    committed it, as a tracedb that installed table by table left it), plus ``rows``."""
    duckdb_run(path, load_sql("tables.sql"), *rows)
    return path


# --------------------------------------------------------------------------- refused paths


@MODES
@pytest.mark.parametrize("name", ["runs.jsonl", "runs.json", "runs.jsonl.zst", "runs.zst", "RUNS.JSONL"])
def test_a_trace_file_path_is_refused_before_anything_is_created(tmp_path, name, read_only):
    path = tmp_path / name
    with pytest.raises(DatabaseError, match="were the arguments swapped"):
        tracedb.connect(path, read_only=read_only)
    assert list(tmp_path.iterdir()) == []


@MODES
def test_an_existing_trace_file_given_as_the_database_is_left_alone(tmp_path, read_only):
    path = tmp_path / "traces.jsonl"
    shutil.copy(FIXTURES / "linear.traces.jsonl", path)
    before = on_disk(path)
    with pytest.raises(DatabaseError, match="names a trace file"):
        tracedb.connect(path, read_only=read_only)
    assert on_disk(path) == before


@MODES
def test_a_directory_is_refused(tmp_path, read_only):
    target = tmp_path / "runs.duckdb"
    target.mkdir()
    with pytest.raises(DatabaseError, match="is a directory"):
        tracedb.connect(target, read_only=read_only)
    assert list(target.iterdir()) == [] and list(tmp_path.iterdir()) == [target]


OTHER_KINDS = {
    "empty": b"",
    "jsonl": (FIXTURES / "linear.traces.jsonl").read_bytes(),
    "csv": b"trace_id,reward\nabc,1.0\n",
    "short": b"DUCK",
}


@MODES
@pytest.mark.parametrize("kind", list(OTHER_KINDS))
def test_an_existing_file_of_another_kind_is_refused_and_left_alone(tmp_path, kind, read_only):
    path = tmp_path / "runs.duckdb"
    path.write_bytes(OTHER_KINDS[kind])
    before = on_disk(path)
    with pytest.raises(DatabaseError, match="not a DuckDB database") as info:
        tracedb.connect(path, read_only=read_only)
    assert ("(empty)" in str(info.value)) == (kind == "empty")
    assert on_disk(path) == before


@MODES
def test_a_duckdb_database_that_is_not_tracedbs_is_refused_and_left_alone(tmp_path, read_only):
    path = tmp_path / "other.duckdb"
    duckdb_run(path, "CREATE TABLE results (x INTEGER)", "INSERT INTO results VALUES (42)")
    before = on_disk(path)
    with pytest.raises(DatabaseError) as info:
        tracedb.connect(path, read_only=read_only)
    assert "not a tracedb" in str(info.value) and "tracedb_meta" in str(info.value)
    if not read_only:
        assert "results" in str(info.value)  # names what it found
    assert on_disk(path) == before
    con = duckdb.connect(str(path), read_only=True)
    try:
        assert con.execute("SELECT table_name FROM duckdb_tables()").fetchall() == [("results",)]
    finally:
        con.close()


def test_an_empty_duckdb_database_is_accepted_and_installed(tmp_path):
    path = tmp_path / "made-elsewhere.duckdb"
    duckdb.connect(str(path)).close()
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURES / "linear.traces.jsonl").traces == 1
    assert stored_version(path) == str(tracedb.SCHEMA_VERSION)
    with tracedb.connect(path, read_only=True) as db:
        assert db.stats()["traces"] == 1


def test_the_refused_file_is_not_kept_open(tmp_path):
    path = tmp_path / "other.duckdb"
    duckdb_run(path, "CREATE TABLE t (x INTEGER)")
    with pytest.raises(DatabaseError):
        tracedb.connect(path)
    duckdb_run(path, "INSERT INTO t VALUES (1)")  # another DuckDB instance can take it for writing


# --------------------------------------------------------------------------- first install


def test_a_first_install_is_one_transaction(tmp_path, monkeypatch):
    """A first install that fails before its end leaves no table behind (an install of
    table after table would leave a file tracedb then has to guess about)."""
    path = tmp_path / "runs.duckdb"

    def failing(name: str) -> str:
        if name == "macros.sql":
            raise OSError("macros.sql unreadable (simulated)")
        return load_sql(name)

    monkeypatch.setattr(dbfile, "load_sql", failing)
    with pytest.raises(OSError, match="simulated"):
        tracedb.connect(path)
    con = duckdb.connect(str(path), read_only=True)
    try:
        assert con.execute("SELECT count(*) FROM duckdb_tables()").fetchall() == [(0,)]
    finally:
        con.close()
    monkeypatch.undo()
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURES / "linear.traces.jsonl").ok
    assert stored_version(path) == str(tracedb.SCHEMA_VERSION)


def test_an_empty_install_cut_short_is_refused_read_only_and_repaired_read_write(tmp_path):
    path = unversioned(tmp_path / "half.duckdb")
    before = on_disk(path)
    with pytest.raises(SchemaVersionError, match="open it read-write once to repair it"):
        tracedb.connect(path, read_only=True)
    assert on_disk(path) == before
    with tracedb.connect(path) as db:
        meta = {r["key"]: r["value"] for r in db.sql("SELECT key, value FROM tracedb_meta").to_pylist()}
        assert meta["schema_version"] == str(tracedb.SCHEMA_VERSION)
        assert db.ingest(FIXTURES / "linear.traces.jsonl").traces == 1
        assert db.sql("SELECT count(*) AS n FROM branch_stats()").column("n")[0].as_py() > 0  # the macros
    with tracedb.connect(path, read_only=True) as db:
        assert db.stats()["traces"] == 1


@MODES
def test_an_install_cut_short_holding_rows_is_refused(tmp_path, read_only):
    path = unversioned(tmp_path / "half.duckdb", "INSERT INTO rejects (reason) VALUES ('kept from before')")
    before = on_disk(path)
    with pytest.raises(SchemaVersionError) as info:
        tracedb.connect(path, read_only=read_only)
    assert "1 rows but no schema version" in str(info.value)
    assert "repair" not in str(info.value)  # a read-write open would refuse it too
    assert on_disk(path) == before


# --------------------------------------------------------------------------- macros


def test_macros_are_rewritten_only_when_they_changed(tmp_path):
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        digest = db.sql("SELECT value FROM tracedb_meta WHERE key = 'macros_sha256'").column("value").to_pylist()
        assert digest == [hashlib.sha256((load_sql("encoded.sql") + load_sql("macros.sql")).encode()).hexdigest()]
    before = on_disk(path)
    for _ in range(3):
        with tracedb.connect(path) as db:  # read-write: nothing to install, nothing written
            assert db.sql("SELECT count(*) AS n FROM branch_stats()").column("n")[0].as_py() > 0
        assert on_disk(path) == before

    # macros of another text (an older tracedb's) are rewritten on the next read-write open
    duckdb_run(path, "UPDATE tracedb_meta SET value = 'older' WHERE key = 'macros_sha256'")
    with tracedb.connect(path) as db:
        assert db.sql("SELECT value FROM tracedb_meta WHERE key = 'macros_sha256'").column("value").to_pylist() == (
            digest
        )
        assert db.sql("SELECT count(*) AS n FROM branch_stats()").column("n")[0].as_py() > 0
