"""``tracedb credit`` on a selection: each step's new complete groups into one set, the
watermark handed from step to step, a trace stamped twice refused in one line naming
--replace, bad selection options one line."""

from __future__ import annotations

import json
from pathlib import Path

from typer.testing import CliRunner

import tracedb
from tracedb.cli.main import app
from tracedb.synthetic import generate_episodes, versioned

runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def _steps(tmp_path: Path) -> list[Path]:
    eps = generate_episodes(
        groups=6, group_size=3, tokens_per_trace=500, system_tokens=30, task_tokens=10, turn_tokens=(10, 40), seed=2
    )
    episodes = list(versioned(eps, step=3, groups_per_step=2, seed=2))
    paths = []
    for step in (1, 2, 3):
        path = tmp_path / f"step{step}.jsonl"
        path.write_text("".join(json.dumps(e) + "\n" for e in episodes if e["run"]["work"]["step"] == step))
        paths.append(path)
    return paths


def test_credit_each_step_into_one_set(tmp_path: Path) -> None:
    db = tmp_path / "run.duckdb"
    after = 0
    for path in _steps(tmp_path):
        assert invoke("ingest", path, "--db", db, "--no-progress", "--json").exit_code == 0
        result = invoke(
            "credit", "rloo", "--name", "live", "--after", after, "--complete-groups", 3, "--db", db, "--json"
        )
        assert result.exit_code == 0, result.output
        stamped = json.loads(result.stdout)
        assert stamped["traces"] == stamped["rows"] == 6
        after = stamped["watermark"]
    assert invoke("credit", "rloo", "--name", "once", "--db", db).exit_code == 0
    with tracedb.connect(db, read_only=True) as database:
        rows = {
            name: database.sql(
                "SELECT trace_id, value FROM trace_credit WHERE credit_set = ? ORDER BY 1", [name]
            ).to_pylist()
            for name in ("live", "once")
        }
        some = database.sql("SELECT trace_id FROM traces ORDER BY seq LIMIT 2").column(0).to_pylist()
    assert rows["live"] == rows["once"] and len(rows["live"]) == 18

    again = invoke("credit", "rloo", "--name", "live", "--trace-ids", some[0], "--trace-id", some[1], "--db", db)
    assert again.exit_code == 1
    lines = again.stderr.strip().splitlines()
    assert len(lines) == 1 and "already holds 2 of the selected traces" in lines[0] and "--replace" in lines[0]
    assert some[0] in lines[0] and some[1] in lines[0]
    replaced = invoke("credit", "rloo", "--name", "live", "--trace-id", some[0], "--replace", "--db", db, "--json")
    assert replaced.exit_code == 0 and json.loads(replaced.stdout)["rows"] == 1

    stale = invoke("credit", "rloo", "--name", "fresh", "--policy", 3, "--max-staleness", 0, "--db", db, "--json")
    assert stale.exit_code == 0, stale.output
    report = json.loads(stale.stdout)["selection"]
    assert report["stale_groups"] > 0 and report["bound"] == 3

    # A bad selection is a usage error (exit 2, one line), refused before the file is opened.
    before = db.stat().st_mtime_ns
    bad = invoke("credit", "rloo", "--name", "x", "--max-staleness", 1, "--db", db)
    assert bad.exit_code == 2 and bad.stderr.strip().count("\n") == 0 and "max_staleness needs policy" in bad.stderr
    unknown = invoke("credit", "rloo", "--name", "x", "--unknown", "keep", "--db", db)
    assert unknown.exit_code == 2 and "give policy and max_staleness too" in unknown.stderr
    assert db.stat().st_mtime_ns == before
    sets = json.loads(invoke("credit-sets", "--db", db, "--json").stdout)
    assert "x" not in {row["name"] for row in sets}
    listed = invoke("credit", "--help")
    assert "--complete-groups" in listed.stdout and "--max-groups" in listed.stdout
