"""The CLI's output conventions: --format table|csv|json|jsonl on every command that prints
rows (--json its alias), tables printed whole when piped, JSON arrays of tokens on one
line, export --columns with trace fields and tags, --version."""

from __future__ import annotations

import csv
import io
import json
from importlib.metadata import version
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import typer
from typer.testing import CliRunner

import tracedb
from tracedb.cli.main import app

from support import FIXTURES

runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("output") / "runs.duckdb"
    result = invoke("ingest", FIXTURES, "--db", path, "--no-progress", "--tag", "step=3", "--tag", "kind=k")
    assert result.exit_code == 0, result.output
    for algorithm in ("grpo", "rloo"):
        assert invoke("credit", algorithm, "--db", path).exit_code == 0
    return path


def commands(group: typer.core.TyperGroup, prefix: str = "") -> dict[str, object]:
    found = {}
    for name, command in group.commands.items():
        if isinstance(command, typer.core.TyperGroup):
            found.update(commands(command, f"{prefix}{name} "))
        else:
            found[prefix + name] = command
    return found


def test_every_command_with_json_takes_format() -> None:
    every = commands(typer.main.get_command(app))
    with_json = {n: c for n, c in every.items() if any("--json" in p.opts for p in c.params)}
    assert {"stats", "sql", "branches", "rejects", "credit-sets", "credit-compare", "cec report", "lake sql"} <= set(
        with_json
    )
    for name, command in with_json.items():
        formats = [p for p in command.params if "--format" in p.opts]
        assert len(formats) == 1, name
        if name not in ("export", "lake export"):  # their --format is the file's: parquet, arrow, arrows
            shown = invoke(*name.split(), "--help").stdout
            assert "--format" in shown and "jsonl" in shown, name


def test_formats_of_rows_and_of_a_dict(db_path: Path) -> None:
    as_json = json.loads(invoke("stats", "--db", db_path, "--json").stdout)
    assert json.loads(invoke("stats", "--db", db_path, "--format", "json").stdout) == as_json
    (line,) = invoke("stats", "--db", db_path, "--format", "jsonl").stdout.splitlines()
    assert json.loads(line) == as_json
    (row,) = csv.DictReader(io.StringIO(invoke("stats", "--db", db_path, "--format", "csv").stdout))
    assert int(row["traces"]) == as_json["traces"] and list(row) == list(as_json)

    query = "SELECT trace_id, reward, [1, 2] AS pair, NULL AS nothing FROM traces ORDER BY trace_id LIMIT 3"
    rows = json.loads(invoke("sql", query, "--db", db_path, "--json").stdout)
    lines = invoke("sql", query, "--db", db_path, "--format", "jsonl").stdout.splitlines()
    assert [json.loads(x) for x in lines] == rows and len(rows) == 3
    got = list(csv.DictReader(io.StringIO(invoke("sql", query, "--db", db_path, "--format", "csv").stdout)))
    assert [r["trace_id"] for r in got] == [r["trace_id"] for r in rows]
    assert {r["pair"] for r in got} == {"[1, 2]"} and {r["nothing"] for r in got} == {""}

    table = invoke("credit-sets", "--db", db_path, "--format", "table").stdout
    assert "grpo" in table and "rloo" in table and not table.lstrip().startswith("[")
    both = invoke("stats", "--db", db_path, "--json", "--format", "csv")
    assert both.exit_code == 2 and "--json is --format json" in both.stderr
    bad = invoke("stats", "--db", db_path, "--format", "xml")
    assert bad.exit_code == 2


def test_tables_of_several_sets_print_whole_and_csv_rows_name_their_table(db_path: Path) -> None:
    shown = invoke("credit-compare", "default", "grpo", "rloo", "--db", db_path)
    assert shown.exit_code == 0, shown.output
    header = next(line for line in shown.stdout.splitlines() if "default" in line)
    assert "grpo" in header and "rloo" in header and "…" not in shown.stdout  # never cut to 80 columns
    rows = list(
        csv.DictReader(io.StringIO(invoke("credit-compare", "grpo", "rloo", "--db", db_path, "--format", "csv").stdout))
    )
    assert {r["table"] for r in rows} == {"dose", "agreement"}
    assert {r["credit_set"] for r in rows if r["table"] == "dose"} == {"grpo", "rloo"}
    by_name = json.loads(invoke("credit-compare", "grpo", "rloo", "--db", db_path, "--json").stdout)
    assert set(by_name) == {"dose", "agreement"}


def test_branches_json_tokens_keeps_each_array_on_one_line(db_path: Path) -> None:
    with tracedb.connect(db_path, read_only=True) as db:
        view = db.branches(columns=["token_ids"])
        trace_id = max(view.to_pylist(), key=lambda r: len(r["token_ids"]))["trace_id"]
        tokens = sum(len(r["token_ids"]) for r in view.to_pylist() if r["trace_id"] == trace_id)
    text = invoke("branches", trace_id, "--db", db_path, "--json", "--tokens").stdout
    rows = json.loads(text)
    assert sum(len(r["token_ids"]) for r in rows) == tokens > 100
    assert len(text.splitlines()) < 20 * len(rows)  # a line per field, not per token


def test_export_columns_take_trace_fields_and_tags(tmp_path: Path, db_path: Path) -> None:
    out = tmp_path / "fields.parquet"
    result = invoke("export", out, "--db", db_path, "--columns", "advantages,group_id,reward,seq,step,tag:kind")
    assert result.exit_code == 0, result.output
    table = pq.read_table(out)
    assert table.column_names == [
        "trace_id",
        "branch_index",
        "trainable",
        "advantages",
        "group_id",
        "reward",
        "seq",
        "step",
        "kind",
    ]
    with tracedb.connect(db_path, read_only=True) as db:
        truth = {r["trace_id"]: r for r in db.sql("SELECT trace_id, group_id, reward, seq FROM traces").to_pylist()}
    for row in table.drop(["advantages"]).to_pylist():
        expected = truth[row["trace_id"]]
        assert (row["group_id"], row["reward"], row["seq"]) == (
            expected["group_id"],
            expected["reward"],
            expected["seq"],
        )
        assert row["step"] == 3 and row["kind"] == "k"
    assert str(table.schema.field("step").type) == "int64"

    unknown = invoke("export", tmp_path / "x.parquet", "--db", db_path, "--columns", "token_ids,nope")
    assert unknown.exit_code == 2
    assert "unknown column 'nope'" in unknown.stderr and "group_id" in unknown.stderr and "step" in unknown.stderr
    assert not (tmp_path / "x.parquet").exists()


def test_version() -> None:
    result = invoke("--version")
    assert result.exit_code == 0 and result.stdout == f"tracedb {version('tracedb')}\n"
