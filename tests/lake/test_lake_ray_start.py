"""Ray as a lake user meets it: nothing to start, nothing printed, loopback only.

Each test runs the lake in a child process of its own, as a user would, so that the Ray
it starts (or fails to reach) is that process's: the Python API starting a local Ray by
itself when none runs (every socket of it listening on loopback, read from ``/proc``),
an unreachable cluster address failing within 15 s in one line naming it, and the lake
commands printing nothing but their own output. No network namespace: the Ray the lake
starts binds loopback only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import tracedb

from support import FIXTURES, REPO
from support.servers import free_port

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")
pytest.importorskip("ray", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402

ENV = {"RAY_DISABLE_DOCKER_CPU_WARNING": "1", "PYTHONPATH": str(REPO / "tests")}
"""The children's environment on top of the tests' (``support`` importable); usage stats
are left to the lake to switch off."""


def _child(args: list[str], *, env: dict[str, str] | None = None, timeout: float = 300) -> tuple:
    started = time.monotonic()
    run = subprocess.run(
        [sys.executable, *args],
        capture_output=True,
        text=True,
        env={**{k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}, **ENV, **(env or {})},
        timeout=timeout,
        cwd=REPO,
    )
    return run, time.monotonic() - started


@pytest.fixture(scope="module")
def lake_dir(golden_store, tmp_path_factory):
    where = tmp_path_factory.mktemp("lake") / "L"
    lakes.init(where).push(golden_store)
    return where


API = """
import json, os, sys
import tracedb.lake
from support.sockets import descendants, listening

lake = tracedb.lake.open(sys.argv[1])
rows = lake.branches(traces_per_task=16).count()
import ray
print(json.dumps({"rows": rows, "ray": ray.is_initialized(), "listening": listening(descendants(os.getpid()))}))
"""


def test_the_python_api_starts_a_quiet_loopback_ray_by_itself(lake_dir, golden_store):
    run, _ = _child(["-c", API, str(lake_dir)])
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout)
    with tracedb.connect(golden_store, read_only=True) as db:
        assert got["rows"] == db.branches().num_rows and got["ray"]
    names = {name for _, name, _, _ in got["listening"]}
    assert {"gcs_server", "raylet"} <= names, got["listening"]  # Ray's servers were seen
    from support.sockets import is_loopback

    wide = [entry for entry in got["listening"] if not is_loopback(entry[2])]
    assert not wide, f"Ray listening beyond loopback: {wide}"
    for noise in ("Token authentication", "Started a local Ray", "Usage stats", "UserWarning", "DeprecationWarning"):
        assert noise not in run.stderr, run.stderr[-3000:]


API_UNREACHABLE = """
import sys
import tracedb.lake

try:
    tracedb.lake.open(sys.argv[1]).branches()
except tracedb.lake.LakeError as e:
    print(e)
"""


@pytest.mark.parametrize("where", ["refused", "unroutable"])
def test_an_unreachable_ray_address_fails_within_15_s_naming_it(lake_dir, where):
    address = f"127.0.0.1:{free_port()}" if where == "refused" else "203.0.113.1:6379"  # TEST-NET-3: no host
    run, took = _child(
        ["-m", "tracedb", "lake", "ingest", str(FIXTURES / "linear.traces.jsonl"), "--lake", str(lake_dir)]
        + ["--ray-address", address],
        timeout=60,
    )
    assert took < 15, f"took {took:.1f} s"
    assert run.returncode == 2 and run.stdout == "", run.stderr[-2000:]
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and f"Ray cluster {address}: unreachable" in lines[0], run.stderr[-2000:]
    run, took = _child(["-c", API_UNREACHABLE, str(lake_dir)], env={"RAY_ADDRESS": address}, timeout=60)
    assert took < 15 and run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().startswith(f"Ray cluster {address}: unreachable"), run.stdout + run.stderr[-2000:]


def test_lake_commands_print_nothing_but_their_own_output(golden_store, tmp_path):
    """init, ingest (a local Ray started and stopped by the command), sql, pack, credit
    (Ray Data's groupby), push, compact: stderr is empty, stdout is tracedb's."""
    lake = str(tmp_path / "L")
    commands = [
        ["lake", "init", "--warehouse", lake],
        ["lake", "ingest", str(FIXTURES), "--lake", lake, "--workers", "2"],
        ["lake", "sql", "SELECT count(*) AS n FROM branch_stats()", "--lake", lake, "--json"],
        ["lake", "pack", "--out", str(tmp_path / "step"), "--seq-len", "4096", "--lake", lake],
        ["lake", "credit", "grpo", "--name", "g", "--lake", lake, "--workers", "2"],
        ["lake", "push", "--db", str(golden_store), "--lake", lake],
        ["lake", "compact", "--lake", lake, "--grace", "0"],
    ]
    for command in commands:
        run, _ = _child(["-m", "tracedb", *command])
        assert run.returncode == 0, (command, run.stderr[-3000:])
        noise = [line for line in run.stderr.splitlines() if not line.startswith("warning: ")]  # tracedb's own
        assert noise == [], (command[:2], run.stderr[-3000:])
        assert run.stdout.strip(), command
    with tracedb.connect(golden_store, read_only=True) as db:
        n = db.sql("SELECT count(*) FROM branch_stats()").column(0)[0].as_py()
    assert json.loads(_child(["-m", "tracedb", *commands[2]])[0].stdout) == [{"n": n}]
    assert (Path(tmp_path) / "step" / "manifest.json").is_file()
