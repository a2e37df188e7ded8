"""CLI habits of the tools people know: quoted globs expanded, nothing created when an
input or the database is missing, help that is true per command, a lock conflict that
names its holder and what to do."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import typer
from typer.testing import CliRunner

from tracedb.cli.main import app

from support import FIXTURES

runner = CliRunner()


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


def test_a_quoted_glob_is_expanded(tmp_path: Path) -> None:
    for step, name in ((1, "linear"), (2, "forest")):
        (tmp_path / "runs" / f"step_{step}").mkdir(parents=True)
        shutil.copy(FIXTURES / f"{name}.traces.jsonl", tmp_path / "runs" / f"step_{step}" / "traces.jsonl")
    db = tmp_path / "runs.duckdb"
    result = invoke("ingest", str(tmp_path / "runs" / "step_*" / "traces.jsonl"), "--db", db, "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["files"] == 2 and report["traces"] > 1
    deep = invoke("ingest", str(tmp_path / "runs" / "**" / "*.jsonl"), "--db", db, "--json")
    assert json.loads(deep.stdout)["skipped"] == report["traces"]


def test_a_missing_input_or_database_creates_nothing(tmp_path: Path) -> None:
    db = tmp_path / "new.duckdb"
    missing = invoke("ingest", tmp_path / "no-such.jsonl", "--db", db)
    assert missing.exit_code == 2 and "no such file or directory" in missing.stderr
    unmatched = invoke("ingest", str(tmp_path / "step_*" / "traces.jsonl"), "--db", db)
    assert unmatched.exit_code == 2 and "no file matches" in unmatched.stderr
    for command in (["credit", "grpo"], ["sql", "SELECT 1", "--write"], ["cec", "stamp"], ["stats"], ["rejects"]):
        refused = invoke(*command, "--db", db)
        assert refused.exit_code == 2, command
        assert f"no database at {db}" in refused.stderr and "tracedb ingest" in refused.stderr, command
    assert list(tmp_path.iterdir()) == []  # no empty database file, no WAL


def commands(group: typer.core.TyperGroup, prefix: str = "") -> dict[str, object]:
    found = {}
    for name, command in group.commands.items():
        if isinstance(command, typer.core.TyperGroup):
            found.update(commands(command, f"{prefix}{name} "))
        else:
            found[prefix + name] = command
    return found


def test_help_says_created_if_missing_only_where_it_is() -> None:
    creating = {"ingest", "demo", "cec ingest", "lake pull"}
    for name, command in commands(typer.main.get_command(app)).items():
        db = next((p for p in command.params if "--db" in p.opts), None)
        if db is None or name == "serve":
            continue
        assert ("created if missing" in (db.help or "")) == (name in creating), name
    top = invoke("--help").stdout
    assert "pip install 'tracedb[lake]'" in top  # the markup did not eat [lake]


def test_a_reader_of_a_followed_file_is_told_who_holds_it(tmp_path: Path) -> None:
    # A long directory: the holder's command line runs past any display limit, and the
    # advice is still decided from the whole of it (CI's paths cut '--follow' once).
    where = tmp_path / ("a-long-run-directory-" * 6)
    where.mkdir()
    run = where / "traces.jsonl"
    shutil.copy(FIXTURES / "linear.traces.jsonl", run)
    db = where / "live.duckdb"
    command = [sys.executable, "-m", "tracedb", "ingest", str(run), "--db", str(db), "--follow", "--json"]
    follower = subprocess.Popen(
        [*command, "--interval", "0.1"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert follower.stdout is not None
        deadline = time.monotonic() + 60
        while '"watermark": 1' not in follower.stdout.readline():  # its first commit
            assert follower.poll() is None and time.monotonic() < deadline, "the follower did not commit"
        served = invoke("serve", "--db", db, "--port", "1")
        stats = invoke("stats", "--db", db)
    finally:
        follower.send_signal(signal.SIGTERM)
        assert follower.wait(30) == 0
    for refused in (served, stats):
        assert refused.exit_code == 2
        line = " ".join(refused.stderr.split())
        assert f"PID {follower.pid}, tracedb ingest {run} --db {db} --follow" in line, line
        assert "tracedb serve --follow" in line and "server that holds it" not in line


def test_errors_name_what_to_do_next(tmp_path: Path) -> None:
    db = tmp_path / "runs.duckdb"
    assert invoke("ingest", FIXTURES / "linear.traces.jsonl", "--db", db, "--no-progress").exit_code == 0
    no_set = invoke("pack", "--out", tmp_path / "step", "--seq-len", "512", "--credit", "grpo", "--db", db)
    assert no_set.exit_code == 1 and "make it with `tracedb credit ALGORITHM --name grpo`" in no_set.stderr
    no_trace = invoke("branches", "nope", "--db", db)
    assert no_trace.exit_code == 1 and "SELECT trace_id FROM traces" in " ".join(no_trace.stderr.split())
