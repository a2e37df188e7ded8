"""A file whose stored macros are another release's, opened read-only: the reader runs this
tracedb's macros (temporary ones, on every connection of the handle) and writes nothing."""

from __future__ import annotations

import hashlib
from pathlib import Path

import duckdb
import pytest

import tracedb

from support import FIXTURES


@pytest.fixture
def old_file(tmp_path: Path) -> Path:
    """A file as an older tracedb left it: one macro missing, another different, and the
    stored digest of its macros not this tracedb's."""
    path = tmp_path / "old.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
    con = duckdb.connect(str(path))
    con.execute("DROP MACRO TABLE policy_mismatch")
    con.execute("CREATE OR REPLACE MACRO branch_stats() AS TABLE SELECT 'stale' AS trace_id")
    con.execute("UPDATE tracedb_meta SET value = 'an older release' WHERE key = 'macros_sha256'")
    con.close()
    return path


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_a_read_only_reader_gets_this_tracedbs_macros_and_writes_nothing(old_file: Path) -> None:
    before = _digest(old_file)
    with tracedb.connect(old_file, read_only=True) as db:
        stats = db.sql("SELECT trace_id FROM branch_stats()").column(0).to_pylist()
        assert stats and "stale" not in stats
        assert db.sql("SELECT count(*) FROM policy_mismatch()").num_rows == 1  # the macro exists here
        views = db.branches()  # read on cursors of the handle (threads): the same macros
        assert views.num_rows == len(stats)
    assert _digest(old_file) == before


def test_a_read_write_open_installs_them_for_good(old_file: Path) -> None:
    with tracedb.connect(old_file):
        pass
    con = duckdb.connect(str(old_file), read_only=True)
    assert con.sql("SELECT trace_id FROM branch_stats()").fetchall() != [("stale",)]
    con.close()


def test_the_command_line_reads_an_old_file_with_this_tracedbs_macros(old_file: Path) -> None:
    from typer.testing import CliRunner

    from tracedb.cli.main import app

    shown = CliRunner().invoke(app, ["sql", "SELECT * FROM policy_mismatch()", "--db", str(old_file), "--json"])
    assert shown.exit_code == 0, shown.output
