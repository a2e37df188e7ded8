"""The CLI's live-run selections: ``export`` and ``pack`` take --after, --complete-groups,
--through and --tag filters, and say the watermark to pass next time."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import tracedb
from tracedb.cli.main import app

from support import FIXTURES

runner = CliRunner()
GROUPS = FIXTURES / "groups.traces.jsonl"


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def two_steps(tmp_path: Path) -> tuple[Path, list[str], list[str]]:
    """The groups fixture ingested in two halves, tagged step=1 and step=2."""
    lines = GROUPS.read_text().splitlines(keepends=True)
    half = len(lines) // 2
    db = tmp_path / "runs.duckdb"
    ids: list[list[str]] = []
    for step, part in ((1, lines[:half]), (2, lines[half:])):
        path = tmp_path / f"step{step}.jsonl"
        path.write_text("".join(part))
        result = invoke("ingest", path, "--db", db, "--tag", f"step={step}", "--no-progress", "--json")
        assert result.exit_code == 0, result.output
        ids.append([t["id"] for line in part for t in json.loads(line)["traces"]])
    return db, ids[0], ids[1]


def exported(path: Path) -> tuple[set[str], int]:
    table = pq.read_table(path)
    return set(table.column("trace_id").to_pylist()), tracedb.watermark_of(table.schema)


def test_export_after_a_watermark_gives_what_arrived_since(tmp_path, two_steps):
    db, first, second = two_steps
    result = invoke("export", tmp_path / "all.parquet", "--db", db, "--json")
    assert result.exit_code == 0, result.output
    everything, mark = exported(tmp_path / "all.parquet")
    assert everything == set(first) | set(second) and json.loads(result.output)["watermark"] == mark
    result = invoke("export", tmp_path / "new.parquet", "--db", db, "--after", len(first), "--json")
    assert result.exit_code == 0, result.output
    assert exported(tmp_path / "new.parquet") == (set(second), mark)
    result = invoke("export", tmp_path / "old.parquet", "--db", db, "--through", len(first), "--json")
    assert exported(tmp_path / "old.parquet")[0] == set(first)
    result = invoke("export", tmp_path / "s2.parquet", "--db", db, "--tag", "step=2", "--json")
    assert exported(tmp_path / "s2.parquet")[0] == set(second)
    result = invoke("export", tmp_path / "r.parquet", "--db", db, "--tag", "step=2..", "--json")
    assert exported(tmp_path / "r.parquet")[0] == set(second)


def test_pack_complete_groups_after_a_watermark_matches_the_library(tmp_path, two_steps):
    db, first, second = two_steps
    out = tmp_path / "step"
    result = invoke("pack", "--out", out, "--seq-len", 65536, "--db", db, "--complete-groups", 2, "--json")
    assert result.exit_code == 0, result.output
    with tracedb.connect(db, read_only=True) as database:
        plan = database.micro_batches(65536, complete_groups=2)
        later = database.micro_batches(65536, complete_groups=2, after=len(first))
    manifest = json.loads(result.stdout)  # stdout: the manifest; stderr: the pack's warnings
    assert manifest["report"]["samples"] == plan.report.samples > 0
    assert manifest["report"]["watermark"] == plan.report.watermark == len(first) + len(second)
    result = invoke(
        "pack", "--out", tmp_path / "s2", "--seq-len", 65536, "--db", db, "--complete-groups", 2, "--after", len(first)
    )
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "s2" / "manifest.json").read_text())
    assert manifest["report"]["samples"] == later.report.samples < plan.report.samples


@pytest.mark.parametrize("bad", ["nameonly", "step=1..x", "=3"])
def test_a_bad_tag_filter_is_a_usage_error_naming_it(tmp_path, two_steps, bad):
    db, _, _ = two_steps
    result = invoke("export", tmp_path / "x.parquet", "--db", db, "--tag", bad)
    assert result.exit_code == 2
    assert "--tag" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "x.parquet").exists()


def test_memory_limit_option_caps_duckdb_and_a_bad_one_is_a_usage_error(tmp_path):
    from tracedb import runtime

    before = runtime.settings().memory_limit
    try:
        result = invoke("ingest", GROUPS, "--db", tmp_path / "m.duckdb", "--memory-limit", "300MB", "--json")
        assert result.exit_code == 0, result.output
        assert runtime.memory_limit() == "286.1 MiB"
        result = invoke("ingest", GROUPS, "--db", tmp_path / "n.duckdb", "--memory-limit", "lots")
        assert result.exit_code == 2 and "--memory-limit" in result.output and "Traceback" not in result.output
        assert not (tmp_path / "n.duckdb").exists()
    finally:
        runtime.set_memory_limit(before)
    assert runtime.settings().memory_limit == before
