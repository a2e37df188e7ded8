"""The tracedb command on damaged input and misused paths: a compressed file cut short,
swapped arguments, an older database file to migrate, writes from ``tracedb sql``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

import tracedb
from tracedb.cli.main import app

from support import FIXTURES
from support.hostile import GOOD_LINES, V1_FIXTURE, on_disk, stored_version, write_lines, zst_frames

runner = CliRunner()


def invoke(*args: object) -> Result:
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def traces_in(path: Path) -> int:
    with tracedb.connect(path, read_only=True) as db:
        return db.stats()["traces"]


@pytest.fixture
def runs_with_a_cut_zst(tmp_path: Path) -> tuple[Path, Path]:
    """A directory: two good lines in a .jsonl, a .jsonl.zst of four lines cut inside its third frame."""
    runs = tmp_path / "runs"
    runs.mkdir()
    write_lines(runs / "a.traces.jsonl", GOOD_LINES[:2])
    data, ends = zst_frames(GOOD_LINES[2:6])
    cut = runs / "b.traces.jsonl.zst"
    cut.write_bytes(data[: ends[1] + (ends[2] - ends[1]) // 2])
    return runs, cut


def test_ingest_of_a_directory_with_a_truncated_zst_says_so_and_exits_nonzero(tmp_path, runs_with_a_cut_zst):
    runs, cut = runs_with_a_cut_zst
    db = tmp_path / "runs.duckdb"
    result = invoke("ingest", runs, "--db", db, "--no-progress")
    assert result.exit_code == 1
    assert "1 file(s) could not be read to their end" in result.stdout and str(cut) in result.stdout
    assert f"{cut}:3" in result.stderr and "truncated" in result.stderr
    assert traces_in(db) == 4  # the good file and the two lines before the cut

    report = json.loads(invoke("ingest", runs, "--db", tmp_path / "again.duckdb", "--json").stdout)
    assert report["unreadable"] == [str(cut)] and report["traces"] == 4
    assert [(r["file"], r["line"]) for r in report["rejected"]] == [(str(cut), 3)]


def test_strict_ingest_of_a_truncated_zst_writes_nothing(tmp_path, runs_with_a_cut_zst):
    runs, cut = runs_with_a_cut_zst
    db = tmp_path / "runs.duckdb"
    result = invoke("ingest", runs, "--db", db, "--no-progress", "--strict")
    assert result.exit_code == 1
    assert "database unchanged" in result.stderr and f"{cut}:3" in result.stderr
    assert traces_in(db) == 0


@pytest.mark.parametrize("name", ["runs.jsonl", "runs.json", "runs.jsonl.zst"])
def test_swapped_arguments_exit_2_in_one_line_and_create_nothing(tmp_path, name):
    source = tmp_path / "x.jsonl"
    shutil.copy(FIXTURES / "linear.traces.jsonl", source)
    before = on_disk(source)
    result = invoke("ingest", source, "--db", tmp_path / name)
    assert result.exit_code == 2
    assert result.stdout == ""
    assert len(result.stderr.strip().splitlines()) == 1
    assert "were the arguments swapped" in result.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.jsonl"]
    assert on_disk(source) == before


def test_migrate_upgrades_an_older_file_and_prints_both_versions(tmp_path):
    old = tmp_path / "old.duckdb"
    shutil.copy(V1_FIXTURE, old)
    refused = invoke("stats", "--db", old)  # a read-only command refuses it, with the advice
    assert refused.exit_code == 2 and "tracedb migrate" in refused.stderr

    result = invoke("migrate", "--db", old, "--json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout) == {
        "path": str(old),
        "from_version": 1,
        "to_version": tracedb.SCHEMA_VERSION,
        "current": tracedb.SCHEMA_VERSION,
        "from_storage": "v2.0.0+",  # and rewritten into the format DuckDB 1.5 reads
        "to_storage": "v1.5.0+",
    }
    assert stored_version(old) == str(tracedb.SCHEMA_VERSION)
    assert traces_in(old) == 1

    again = invoke("migrate", "--db", old)  # the table for people; nothing left to do
    assert again.exit_code == 0
    assert "from_version" in again.stdout and "to_version" in again.stdout


def test_migrate_of_a_missing_file_creates_nothing(tmp_path):
    result = invoke("migrate", "--db", tmp_path / "missing.duckdb")
    assert result.exit_code == 2 and "no database" in result.stderr
    assert list(tmp_path.iterdir()) == []


def test_sql_changes_the_file_only_with_write(tmp_path):
    db = tmp_path / "runs.duckdb"
    assert invoke("ingest", FIXTURES / "linear.traces.jsonl", "--db", db, "--no-progress").exit_code == 0
    refused = invoke("sql", "DELETE FROM traces", "--db", db)
    assert refused.exit_code == 2 and "does not only read" in refused.stderr and "--write" in refused.stderr
    assert traces_in(db) == 1
    done = invoke("sql", "DELETE FROM traces", "--db", db, "--write")
    assert done.exit_code == 0, done.stderr
    assert traces_in(db) == 0
