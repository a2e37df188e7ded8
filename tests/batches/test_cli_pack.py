"""``tracedb pack``: a step directory from a database file, a summary line, ``--json``
for the manifest, exit 2 on bad usage."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from click.testing import Result
from typer.testing import CliRunner

import tracedb
from tracedb.cli.main import app

from support import FIXTURES

runner = CliRunner()


def invoke(*args: object) -> Result:
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False, env={"COLUMNS": "200"})


@pytest.fixture(scope="module")
def db_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("pack") / "runs.duckdb"
    with tracedb.connect(path) as db:
        for name in ("groups", "subagent_fork", "compaction", "loss_weights", "linear_assigned"):
            assert db.ingest(FIXTURES / f"{name}.traces.jsonl").ok
    return path


def test_pack_writes_the_plan(db_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "step"
    result = invoke("pack", "--db", db_path, "--out", out, "--seq-len", 300, "--ranks", 3)
    assert result.exit_code == 0, result.output
    manifest = json.loads((out / "manifest.json").read_text())
    report = manifest["report"]
    first = result.stdout.splitlines()[0]
    assert first == (
        f"packed {report['samples']} samples into {report['micro_batches']} micro-batches over 3 ranks "
        f"({report['physical_tokens']} tokens stored for {report['logical_tokens']}, "
        f"{report['padding_tokens']} padding) in {out}"
    )
    with tracedb.connect(db_path, read_only=True) as db:
        plan = db.micro_batches(300, ranks=3)
    assert report == json.loads(json.dumps(plan.report.to_dict()))
    assert manifest["arguments"] == json.loads(json.dumps(plan.arguments))
    for r in range(3):
        got = tracedb.read_micro_batches(out, r)
        assert len(got) == len(plan[r])
        for g, w in zip(got, plan[r]):
            assert g.tokens.equals(w.tokens) and g.samples.equals(w.samples)


def test_pack_json_prints_the_manifest(db_path: Path, tmp_path: Path) -> None:
    out = tmp_path / "step"
    result = invoke(
        "pack",
        "--db",
        db_path,
        "--out",
        out,
        "--seq-len",
        200,
        "--ranks",
        2,
        "--share-prefixes",
        "--all-branches",
        "--pad-to-multiple-of",
        16,
        "--overflow",
        "drop",
        "--json",
    )
    assert result.exit_code == 0, result.output
    printed = json.loads(result.stdout)
    assert printed == json.loads((out / "manifest.json").read_text())
    args = printed["arguments"]
    assert (args["seq_len"], args["ranks"], args["share_prefixes"], args["trainable"]) == (200, 2, True, None)
    assert (args["pad_to_multiple_of"], args["overflow"]) == (16, "drop")
    assert printed["report"]["dropped_overflow"] > 0
    assert printed["report"]["physical_tokens"] < printed["report"]["logical_tokens"]
    for r in range(2):
        assert all(len(mb) % 16 == 0 for mb in tracedb.read_micro_batches(out, r))


def test_pack_selection_options(db_path: Path, tmp_path: Path) -> None:
    (row,) = json.loads((FIXTURES / "linear_assigned.branches.json").read_text())
    tid = row["trace_id"]
    result = invoke("pack", "--db", db_path, "--out", tmp_path, "--seq-len", 100, "--trace-id", tid, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)["report"]
    assert (report["samples"], report["truncated"], report["logical_tokens"]) == (1, 1, 100)
    (mb,) = tracedb.read_micro_batches(tmp_path, 0)
    assert mb.tokens.column("input_ids").to_pylist() == row["token_ids"][:100]


def test_pack_bad_overflow_exits_2(db_path: Path, tmp_path: Path) -> None:
    result = invoke("pack", "--db", db_path, "--out", tmp_path / "x", "--seq-len", 100, "--overflow", "wrap")
    assert result.exit_code == 2
    assert "overflow" in result.stderr and "wrap" in result.stderr
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_pack_overflow_error_names_the_branch(db_path: Path, tmp_path: Path) -> None:
    result = invoke("pack", "--db", db_path, "--out", tmp_path / "x", "--seq-len", 100, "--overflow", "error")
    assert result.exit_code != 0
    assert re.search(r"trace [0-9a-f]{32}, branch \d+: \d+ tokens, over seq_len 100", result.stderr)
    assert not (tmp_path / "x" / "manifest.json").exists()


def test_pack_missing_seq_len_is_usage_error(db_path: Path, tmp_path: Path) -> None:
    result = invoke("pack", "--db", db_path, "--out", tmp_path)
    assert result.exit_code == 2
