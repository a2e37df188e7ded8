"""Files tracedb writes open in the DuckDB CLI of the last stable 1.x line (the
``duckdb-cli`` package, 1.5): new files are made in storage format v1.5.0, and
``tracedb migrate`` rewrites a file in DuckDB 2.0's format into it, atomically."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import duckdb
import duckdb_cli
import pytest
from typer.testing import CliRunner

import tracedb
from tracedb import dbfile, publish, runtime
from tracedb.cli.main import app

from support import FIXTURES

CLI = Path(duckdb_cli.__file__).parent / "duckdb"


def storage_of(path: Path) -> str:
    con = duckdb.connect()
    try:
        con.execute(f"ATTACH '{path}' AS f (READ_ONLY)")
        return dbfile.storage_version(con, "f")
    finally:
        con.close()


def duckdb_1x(path: Path, query: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(CLI), "-readonly", "-csv", str(path), "-c", query], capture_output=True, text=True)


def v2_file(path: Path) -> Path:
    """A tracedb file in DuckDB 2.0's own storage format (as tracedb made them before)."""
    duckdb.connect(str(path)).close()
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURES).ok
    assert storage_of(path) == "v2.0.0+"
    return path


def test_the_cli_is_the_1x_line() -> None:
    version = subprocess.run([str(CLI), "--version"], capture_output=True, text=True, check=True).stdout
    assert version.startswith("v1."), version


def test_a_new_file_opens_in_duckdb_1x_with_its_macros(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURES).ok
        traces, branches = db.stats()["traces"], db.stats()["branches"]
    assert storage_of(path) == runtime.STORAGE_VERSION + "+"
    got = duckdb_1x(path, "SELECT count(*) AS n FROM traces; SELECT count(*) AS n FROM branch_tokens()")
    assert got.returncode == 0, got.stderr
    assert got.stdout.split() == ["n", str(traces), "n", str(branches)]


def test_migrate_rewrites_a_2_0_file_into_the_1x_format(tmp_path: Path) -> None:
    path = v2_file(tmp_path / "old.duckdb")
    os.chmod(path, 0o640)
    refused = duckdb_1x(path, "SELECT 1")
    assert refused.returncode != 0 and "version number" in refused.stderr
    with tracedb.connect(path, read_only=True) as db:
        before = (db.stats(), db.branches(), db.credit_sets())
    result = CliRunner().invoke(app, ["migrate", "--db", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert '"from_storage": "v2.0.0+"' in result.stdout and '"to_storage": "v1.5.0+"' in result.stdout
    assert storage_of(path) == "v1.5.0+" and (path.stat().st_mode & 0o777) == 0o640
    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.duckdb"]  # no temporary file left
    with tracedb.connect(path, read_only=True) as db:
        stats, view, sets = db.stats(), db.branches(), db.credit_sets()
    assert {k: v for k, v in stats.items() if k != "bytes"} == {k: v for k, v in before[0].items() if k != "bytes"}
    assert view.equals(before[1]) and sets.equals(before[2])
    assert duckdb_1x(path, "SELECT count(*) FROM traces").returncode == 0
    again = dbfile.rewrite_storage(path)
    assert again["rewritten"] is False


def test_a_failed_rewrite_leaves_the_file_as_it_was(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = v2_file(tmp_path / "old.duckdb")
    data = path.read_bytes()

    def crash(p: Path) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(publish, "sync_file", crash)
    with pytest.raises(OSError, match="No space"):
        dbfile.rewrite_storage(path)
    assert path.read_bytes() == data and sorted(p.name for p in tmp_path.iterdir()) == ["old.duckdb"]
