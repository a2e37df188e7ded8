"""Several processes on one database file: readers share it, a writer holds it alone.

DuckDB locks a file per process: any number of read-only processes at once, or one
process that writes. tracedb turns the conflict into :class:`tracedb.errors.DatabaseLocked`
(one line: the file and the holder's PID) and the CLI into that line and exit code 2.
Every child here is ``sys.executable`` on 127.0.0.1, waited for with timeouts, and
stopped by the test.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

import tracedb
from tracedb.cli.main import app
from tracedb.errors import DatabaseLocked

from support import FIXTURES
from support.faults import TESTS, Child, branch_digest, contents
from support.ingested import FIXTURE_FILES
from support.servers import free_port, in_process

READER = """
import json, sys
sys.path.insert(0, sys.argv[1])
import tracedb
from support.faults import branch_digest
db = tracedb.connect(sys.argv[2], read_only=True)
print("OPEN", flush=True)
sys.stdin.readline()  # until every reader of the test has the file open
result = {"traces": db.sql("SELECT count(*) AS n FROM traces").column("n")[0].as_py(), "digest": branch_digest(db)}
db.close()
print("RESULT " + json.dumps(result), flush=True)
"""
HOLDER = """
import os, sys
import tracedb
db = tracedb.connect(sys.argv[1])
print("HOLDING", os.getpid(), flush=True)
sys.stdin.readline()
db.close()
print("CLOSED", flush=True)
"""
ENV = {k: v for k, v in os.environ.items() if k not in ("TRACEDB_TOKEN", "TRACEDB_DB")}
"""A child's environment: no token (a server without one is read-only), no default file."""


@pytest.fixture(scope="module")
def db_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Any]]:
    """A database holding every fixture (closed), and what a reader must find in it."""
    path = tmp_path_factory.mktemp("procs") / "shared.duckdb"
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURE_FILES).ok
        expected = {"traces": db.sql("SELECT count(*) AS n FROM traces").column("n")[0].as_py()}
        expected["digest"] = branch_digest(db)
    return path, expected


def reader(path: Path, workdir: Path) -> Child:
    return Child({"reader": str(path)}, workdir, [sys.executable, "-c", READER, str(TESTS), str(path)])


def result_of(child: Child) -> dict[str, Any]:
    _, line = child.expect("RESULT")
    assert child.proc.wait(timeout=60) == 0, child.describe()
    return json.loads(line.removeprefix("RESULT "))


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """``tracedb ARGS`` as a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "tracedb", *args], capture_output=True, text=True, timeout=120, cwd=cwd, env=ENV
    )


def test_two_read_only_readers_at_once(db_file: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, expected = db_file
    with reader(path, tmp_path) as a, reader(path, tmp_path) as b:
        a.expect("OPEN")
        b.expect("OPEN")  # both hold the file open read-only now
        a.send("go")
        b.send("go")
        assert result_of(a) == expected, a.describe()
        assert result_of(b) == expected, b.describe()


def test_reader_beside_a_read_only_server(db_file: tuple[Path, dict[str, Any]], tmp_path: Path) -> None:
    path, expected = db_file
    port = free_port()
    command = [sys.executable, "-m", "tracedb", "serve", "--db", str(path), "--port", str(port)]
    with in_process(command, port, env=ENV, cwd=tmp_path) as base:
        health = httpx.get(f"{base}/health", timeout=30).json()
        assert health["writes_enabled"] is False and health["traces"] == expected["traces"]
        page = httpx.get(f"{base}/traces", params={"limit": 5}, timeout=30)
        assert page.status_code == 200, page.text
        trace_id = page.json()["traces"][0]["trace_id"]
        branches = httpx.get(f"{base}/traces/{trace_id}/branches", timeout=30)
        assert branches.status_code == 200, branches.text
        with reader(path, tmp_path) as child:
            child.expect("OPEN")  # the reader has the file open beside the server
            again = httpx.get(f"{base}/traces/{trace_id}/branches", timeout=30)
            assert again.status_code == 200 and again.json() == branches.json()
            child.send("go")
            assert result_of(child) == expected, child.describe()
        stats = cli("stats", "--db", str(path), "--json", cwd=tmp_path)
        assert stats.returncode == 0, stats.stderr
        assert json.loads(stats.stdout)["traces"] == expected["traces"]
        after = httpx.get(f"{base}/traces/{trace_id}/branches", timeout=30)
        assert after.status_code == 200 and after.json() == branches.json()
        assert httpx.get(f"{base}/health", timeout=30).json()["traces"] == expected["traces"]


def assert_one_line_naming(text: str, path: Path, pid: int, command: str | None = None) -> None:
    """One line naming the file and the PID; an option it advises exists (for ``command``)."""
    line = text.strip()
    assert line and "\n" not in line, f"not one line: {text!r}"
    assert "Traceback" not in line, text
    assert str(path) in line and f"PID {pid}" in line, line
    advised = re.findall(r"--[a-z][a-z-]*", line.replace(str(path), ""))
    for name in advised:
        for cmd in [command] if command else ["stats", "sql", "ingest"]:
            shown = CliRunner().invoke(app, [cmd, "--help"], terminal_width=200).output
            assert name in shown, f"the message advises {name}, which `tracedb {cmd}` does not have: {line}"


@pytest.mark.parametrize("name", ["held.duckdb", "runs[v2].duckdb", "runs[bold].duckdb"])  # [..]: not markup
def test_writer_holds_the_file_alone(db_file: tuple[Path, dict[str, Any]], tmp_path: Path, name: str) -> None:
    path = tmp_path / name
    shutil.copy(db_file[0], path)
    with tracedb.connect(path, read_only=True) as db:
        before = contents(db)
    with Child({"holder": str(path)}, tmp_path, [sys.executable, "-c", HOLDER, str(path)]) as holder:
        _, line = holder.expect("HOLDING")
        pid = int(line.split()[1])
        assert pid == holder.proc.pid
        for read_only in (False, True):
            with pytest.raises(DatabaseLocked) as caught:
                tracedb.connect(path, read_only=read_only)
            assert caught.value.pid == pid
            assert_one_line_naming(str(caught.value), path, pid)
        for args in (("stats",), ("ingest", str(FIXTURES / "linear.traces.jsonl")), ("sql", "SELECT 1")):
            done = cli(*args, "--db", str(path), cwd=tmp_path)
            assert done.returncode == 2, (args, done.returncode, done.stdout, done.stderr)
            assert_one_line_naming(done.stderr, path, pid, args[0])
            assert not done.stdout.strip(), done.stdout
        holder.send("release")
        holder.expect("CLOSED")
        assert holder.proc.wait(timeout=60) == 0, holder.describe()
    with tracedb.connect(path) as db:  # the lock went with the holder; nothing was written
        assert contents(db) == before
