"""``tracedb stats --bytes``: the file's bytes by table and column, as a table or JSON."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

import tracedb
from tracedb.cli.main import app

from support import FIXTURES

runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("bytes") / "runs.duckdb"
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURES).ok
    return path


def test_json_is_the_library_breakdown(db_path: Path) -> None:
    result = invoke("stats", "--bytes", "--json", "--db", db_path)
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    with tracedb.connect(db_path, read_only=True) as db:
        assert data == json.loads(json.dumps(db.storage()))
    assert data["file_bytes"] == db_path.stat().st_size
    names = {t["table"] for t in data["tables"]}
    assert {
        "episodes",
        "traces",
        "node_store",
        "segment_store",
        "branches",
        "rejects",
    } <= names  # schema 7: the tables holding the bytes


def test_table_lists_every_column_holding_bytes_and_the_rest(db_path: Path) -> None:
    result = runner.invoke(app, ["stats", "--bytes", "--db", str(db_path)], env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    text = result.stdout
    with tracedb.connect(db_path, read_only=True) as db:
        breakdown = db.storage()
    assert f"{breakdown['file_bytes']:,} bytes" in text
    from tracedb.storage import flat_rows

    listed = flat_rows(breakdown)
    assert {"(metadata)", "(file header)", "token_ids", "logprobs"} <= {r["column"] or r["table"] for r in listed}
    for row in listed:  # every row the library counts is printed, whole (a pipe gets every column)
        assert (row["column"] or row["table"]) in text and f"{row['bytes']:,}" in text, row
    assert "BitPacking" in text
    assert f"{breakdown['blocks']['total']} blocks of {breakdown['block_size']:,} bytes" in text


def test_plain_stats_are_unchanged(db_path: Path) -> None:
    result = invoke("stats", "--json", "--db", db_path)
    assert result.exit_code == 0
    assert json.loads(result.stdout)["traces"] == 44


def test_refusals_exit_2(tmp_path: Path) -> None:
    missing = invoke("stats", "--bytes", "--db", tmp_path / "none.duckdb")
    assert missing.exit_code == 2 and "no database at" in missing.stderr
    remote = invoke("stats", "--bytes", "--url", "http://127.0.0.1:9")
    assert remote.exit_code == 2 and "does not go with --url" in remote.stderr
