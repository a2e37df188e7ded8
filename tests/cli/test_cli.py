"""The tracedb command end to end: each command on real files, exit codes, JSON output."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.ipc as ipc
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import tracedb
from tracedb.cli.main import app

from support import FIXTURES

runner = CliRunner()


def invoke(*args: str):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    path = tmp_path / "runs.duckdb"
    result = invoke("ingest", FIXTURES, "--db", path, "--no-progress", "--json")
    assert result.exit_code == 0, result.output
    return path


def test_ingest_json_report_and_idempotency(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    first = json.loads(invoke("ingest", FIXTURES, "--db", path, "--json").stdout)
    assert first["traces"] == 44 and first["episodes"] == 44 and first["rejected"] == []
    again = invoke("ingest", FIXTURES, "--db", path)
    assert again.exit_code == 0
    assert "44 traces already present" in again.stdout
    second = json.loads(invoke("ingest", FIXTURES, "--db", path, "--json").stdout)
    assert second["traces"] == 0 and second["skipped"] == 44


def test_ingest_rejects_exit_nonzero_and_keep_good_records(tmp_path: Path) -> None:
    lines = (FIXTURES / "linear.traces.jsonl").read_text().splitlines()
    good = json.loads(lines[0])
    bad = json.loads(lines[0])
    bad["id"], bad["traces"][0]["id"] = "bad-episode", "bad-trace"
    bad["traces"][0]["nodes"][2]["logprobs"].pop()
    src = tmp_path / "traces.jsonl"
    src.write_text(json.dumps(bad) + "\n" + json.dumps(good) + "\n")
    path = tmp_path / "runs.duckdb"
    result = invoke("ingest", src, "--db", path, "--no-progress")
    assert result.exit_code == 1
    assert "1 records rejected" in result.stdout
    assert f"{src}:1" in result.stderr and "trace bad-trace" in result.stderr and "node 2" in result.stderr
    assert "logprobs has 24 values but mask has 25 sampled tokens" in result.stderr
    rows = json.loads(invoke("rejects", "--db", path, "--json").stdout)
    assert [(r["line"], r["trace_id"], r["node"], r["field"]) for r in rows] == [(1, "bad-trace", 2, "logprobs")]
    stats = json.loads(invoke("stats", "--db", path, "--json").stdout)
    assert stats["traces"] == 1 and stats["rejects"] == 1


def test_strict_ingest_leaves_database_unchanged(tmp_path: Path, db_path: Path) -> None:
    before = json.loads(invoke("stats", "--db", db_path, "--json").stdout)
    src = tmp_path / "mixed.jsonl"
    record = json.loads((FIXTURES / "linear.traces.jsonl").read_text().splitlines()[0])
    record["id"], record["traces"][0]["id"] = "new-episode", "new-trace"
    broken = json.loads(json.dumps(record))
    broken["id"], broken["traces"][0]["id"] = "broken-episode", "broken-trace"
    broken["traces"][0]["nodes"][1]["mask"].append(True)
    src.write_text(json.dumps(record) + "\n" + json.dumps(broken) + "\n")
    result = invoke("ingest", src, "--db", db_path, "--strict", "--no-progress")
    assert result.exit_code == 1
    assert "database unchanged" in result.stderr
    after = json.loads(invoke("stats", "--db", db_path, "--json").stdout)
    assert {k: v for k, v in after.items() if k != "bytes"} == {k: v for k, v in before.items() if k != "bytes"}


def test_sql_uses_installed_macros(db_path: Path) -> None:
    result = invoke(
        "sql", "SELECT count(*) AS n FROM branch_tokens() WHERE advantages IS NULL", "--db", db_path, "--json"
    )
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    with tracedb.connect(db_path, read_only=True) as db:
        expected = sum(1 for a in db.branches().column("advantages").to_pylist() if a is None)
    assert rows == [{"n": expected}]
    bad = invoke("sql", "SELECT * FROM no_such_table", "--db", db_path)
    assert bad.exit_code == 1 and "no_such_table" in bad.stderr


def test_sql_reads_stdin(db_path: Path) -> None:
    result = runner.invoke(app, ["sql", "-", "--db", str(db_path), "--json"], input="SELECT count(*) AS n FROM traces")
    assert json.loads(result.stdout) == [{"n": 44}]


def test_branches_command(db_path: Path) -> None:
    golden = json.loads((FIXTURES / "rejected_compaction.branches.json").read_text())
    trace_id = golden[0]["trace_id"]
    summary = json.loads(invoke("branches", trace_id, "--db", db_path, "--json").stdout)
    assert [(b["branch_index"], b["trainable"], b["tokens"]) for b in summary] == [
        (g["index"], g["trainable"], len(g["token_ids"])) for g in golden
    ]
    full = json.loads(invoke("branches", trace_id, "--db", db_path, "--json", "--tokens").stdout)
    assert [b["token_ids"] for b in full] == [g["token_ids"] for g in golden]
    table = invoke("branches", trace_id, "--db", db_path)
    assert table.exit_code == 0 and "trainable" in table.stdout
    missing = invoke("branches", "no-such-trace", "--db", db_path)
    assert missing.exit_code == 1 and "no-such-trace" in missing.stderr
    last = golden[-1]["index"]
    one = json.loads(invoke("branches", trace_id, "--db", db_path, "--json", "--tokens", "--branch", last).stdout)
    assert [b["token_ids"] for b in one] == [golden[-1]["token_ids"]]
    two = json.loads(invoke("branches", trace_id, "--db", db_path, "--json", "-b", 0, "-b", last).stdout)
    assert [b["branch_index"] for b in two] == sorted({0, last})
    none = invoke("branches", trace_id, "--db", db_path, "--branch", 99)
    assert none.exit_code == 1 and "no branch 99" in none.stderr


def test_trace_command_round_trips(db_path: Path) -> None:
    original = json.loads((FIXTURES / "loss_weights.traces.jsonl").read_text().splitlines()[0])["traces"][0]
    result = invoke("trace", original["id"], "--db", db_path)
    assert json.loads(result.stdout) == original
    assert invoke("trace", "nope", "--db", db_path).exit_code == 1


def test_export_parquet_and_arrow(tmp_path: Path, db_path: Path) -> None:
    out = tmp_path / "train.parquet"
    result = json.loads(
        invoke("export", out, "--db", db_path, "--trainable-only", "--columns", "token_ids,advantages", "--json").stdout
    )
    table = pq.read_table(out)
    golden = [b for f in FIXTURES.glob("*.branches.json") for b in json.loads(f.read_text())]
    trainable = sum(b["trainable"] for b in golden)
    assert trainable < len(golden)  # the fixtures hold untrainable compaction attempts
    assert result["rows"] == table.num_rows == trainable
    assert table.column_names == ["trace_id", "branch_index", "trainable", "token_ids", "advantages"]
    assert all(table.column("trainable").to_pylist())
    arrow = tmp_path / "group.arrow"
    invoke("export", arrow, "--db", db_path, "--group", "group-0")
    with ipc.open_file(arrow) as reader:
        got = reader.read_all()
    with tracedb.connect(db_path, read_only=True) as db:
        assert got.equals(db.branches(group="group-0"))
    bad = invoke("export", tmp_path / "x.csv", "--db", db_path)
    assert bad.exit_code == 2 and "format" in bad.stderr


def test_missing_database_is_an_error(tmp_path: Path) -> None:
    result = invoke("stats", "--db", tmp_path / "none.duckdb")
    assert result.exit_code == 2 and "no database" in result.stderr


def test_every_command_has_help() -> None:
    for command in ("ingest", "sql", "branches", "trace", "export", "stats", "rejects", "demo"):
        result = invoke(command, "--help")
        assert result.exit_code == 0 and "Usage" in result.stdout


def test_demo_and_entry_point(tmp_path: Path) -> None:
    """The installed console script runs the main job on generated data."""
    exe = shutil.which("tracedb", path=str(Path(sys.executable).parent))
    assert exe, "the tracedb console script is installed beside the interpreter"
    proc = subprocess.run(
        [exe, "demo", "--db", "demo.duckdb", "--groups", "2", "--group-size", "4", "--tokens", "4000"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert "ingested 8 traces" in proc.stdout and "exported" in proc.stdout
    assert (tmp_path / "demo.parquet").exists()
    with tracedb.connect(tmp_path / "demo.duckdb", read_only=True) as db:
        assert db.stats()["traces"] == 8


def test_credit_commands(db_path: Path) -> None:
    listing = json.loads(invoke("credit", "--list", "--db", db_path, "--json").stdout)
    assert (
        {a["algorithm"] for a in listing}
        == set(tracedb.credit.ALGORITHMS)
        >= {
            "grpo",
            "rloo",
            "returns",
            "gae",
            "tree",
            "reweight",
            "anchor",
            "potential",
            "branch",
            "redistribute",
            "channels",
        }
    )
    grpo = next(a for a in listing if a["algorithm"] == "grpo")
    assert grpo["params"]["scale_std"] is False
    result = invoke(
        "credit", "grpo", "--name", "g", "-p", "scale_std=true", "-p", "eps=0.001", "--db", db_path, "--json"
    )
    assert result.exit_code == 0, result.output
    stamped = json.loads(result.stdout)
    assert stamped["name"] == "g" and stamped["params"]["scale_std"] is True and stamped["params"]["eps"] == 0.001
    assert stamped["nodes"] > 0
    again = invoke("credit", "grpo", "--name", "g", "--db", db_path)
    assert again.exit_code == 1 and "replace" in again.stderr
    assert invoke("credit", "grpo", "--name", "g", "--replace", "--db", db_path).exit_code == 0
    sets = json.loads(invoke("credit-sets", "--db", db_path, "--json").stdout)
    assert [s["name"] for s in sets] == ["default", "g"]
    assert json.loads(sets[1]["params"])["scale_std"] is False  # the replacement's parameters
    unknown = invoke("credit", "nope", "--db", db_path)
    assert unknown.exit_code == 1 and "unknown credit algorithm" in unknown.stderr
    bad_param = invoke("credit", "grpo", "--name", "h", "-p", "no_such=1", "--db", db_path)
    assert bad_param.exit_code == 1 and "no_such" in bad_param.stderr
    malformed = invoke("credit", "grpo", "-p", "novalue", "--db", db_path)
    assert malformed.exit_code == 2


@pytest.mark.parametrize("name", ["", "   ", " g"], ids=["empty", "blank", "leading-space"])
def test_credit_refuses_a_bad_set_name_in_one_line(db_path: Path, tmp_path: Path, name: str) -> None:
    """``--name ""`` used to write a set named after the algorithm: now it is exit 2, one
    line saying why, and nothing written (the lake's credit command checks it first too)."""
    result = invoke("credit", "grpo", "--name", name, "--db", db_path)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("--name: ") and "cannot name a credit set" in lines[0], lines
    assert [s["name"] for s in json.loads(invoke("credit-sets", "--db", db_path, "--json").stdout)] == ["default"]
    lake = invoke("lake", "credit", "grpo", "--name", name, "--lake", tmp_path / "no-lake-here")
    assert lake.exit_code == 2 and "cannot name a credit set" in lake.stderr, lake.output
    assert not (tmp_path / "no-lake-here").exists()


def test_export_and_branches_with_a_credit_set(tmp_path: Path, db_path: Path) -> None:
    invoke("credit", "rloo", "--name", "r", "--db", db_path)
    out = tmp_path / "r.parquet"
    invoke("export", out, "--db", db_path, "--credit", "r", "--columns", "advantages")
    with tracedb.connect(db_path, read_only=True) as db:
        expected = db.branches(credit="r", columns=["advantages"])
    assert pq.read_table(out).column("advantages").to_pylist() == expected.column("advantages").to_pylist()
    missing = invoke("export", out, "--db", db_path, "--credit", "no-such-set")
    assert missing.exit_code == 1 and "no-such-set" in missing.stderr
