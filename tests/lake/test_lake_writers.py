"""Many writers at once on one lake: eight ``tracedb lake ingest`` processes, drivers of
one local Ray (8 CPUs, so that their writes run at the same time), appending overlapping
inputs into a lake on PostgreSQL; one of them is SIGKILLed
in the middle of a commit (its nodes committed, its traces not) and run again at once. A reader
polling the lake meanwhile sees whole traces only; at the end every trace is there once,
equal to the file store's ingest of the inputs.

The Ray is started by :func:`tracedb.lake.workers.start` (loopback only), so no network
namespace is needed. SQLite's catalog passes the same test (``catalog="sqlite"``); it is
not run here, for the lake tests' time: ``test_lake_ray.py`` runs four ingest processes
on it, and ``python -m benchmarks lake`` compares the two catalogs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter

import pytest

import tracedb

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")
pytest.importorskip("ray", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb.lake import workers  # noqa: E402

WRITERS = 8
FILES = 8
"""Input files of 8 traces (about 3k tokens each, with compactions: several branches);
writer k ingests files k and k+1, so every trace is written by two writers."""
ENV = {"RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_DOCKER_CPU_WARNING": "1"}
POLL_SECONDS = 0.2
"""The reader's pause between looks (it shares the CPUs with the writers)."""
DEADLINE = 240.0
"""Seconds the whole run (writers, the kill, the rerun) may take before the test fails."""

STALLER = r"""
import os, sys, time

import tracedb.lake.write as write
from tracedb.cli.main import app

marker = sys.argv[1]


def stall(lake, traces, report):
    # The driver commits its tasks' staged writes: the first commit stops just before its
    # traces commit (every other table committed), says where (its pid, a batch of its
    # traces) and waits to be killed.
    with open(marker + ".part", "w") as f:
        f.write(f"{os.getpid()} {traces.column('lake_batch')[0].as_py()}")
    os.replace(marker + ".part", marker)
    time.sleep(120)
    os._exit(3)


write._commit_traces = stall
sys.argv = ["tracedb", *sys.argv[2:]]
app()
"""


@pytest.fixture(scope="module")
def local_ray():
    import ray

    os.environ.update(ENV)
    assert workers.start(num_cpus=WRITERS)
    yield ray
    ray.shutdown()


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    """The input files, and what the file store's ingest of all of them holds per trace:
    its nodes, branches and segment ids, and its record."""
    from tracedb.synthetic import write_sample

    root = tmp_path_factory.mktemp("inputs")
    files = [
        write_sample(
            root / f"run{k}" / "traces.jsonl",
            groups=2,
            group_size=4,
            tokens_per_trace=3_000,
            compaction_every=1_200,
            seed=100 + k,
        ).resolve()
        for k in range(FILES)
    ]
    with tracedb.connect(":memory:") as db:
        db.ingest(files)
        nodes = db.sql("SELECT trace_id, count(*) AS n FROM nodes GROUP BY ALL").to_pylist()
        branches = db.sql("SELECT trace_id, count(*) AS n FROM branches GROUP BY ALL").to_pylist()
        used = db.sql("SELECT trace_id, list(DISTINCT segment_id) AS s FROM nodes GROUP BY ALL").to_pylist()
        ids = sorted(db.sql("SELECT trace_id FROM traces").column(0).to_pylist())
        expected = {
            "ids": ids,
            "nodes": {r["trace_id"]: r["n"] for r in nodes},
            "branches": {r["trace_id"]: r["n"] for r in branches},
            "segments": {r["trace_id"]: set(r["s"]) for r in used},
            "records": {t: db.trace(t) for t in ids},
        }
    assert len(ids) == FILES * 8 and max(expected["branches"].values()) > 1
    return files, expected


def _whole(lake, expected: dict, polls: Counter) -> None:
    """One look at the lake (``lake.tables()`` or ``lake.sql``, by turns): every visible
    trace with all its nodes, branches and segments, no rows of a trace not visible."""
    if polls["tables"] <= polls["sql"]:
        polls["tables"] += 1
        visible = lake.tables()
        ids = visible["traces"].column("trace_id").to_pylist()
        assert len(ids) == len(set(ids)), "a trace shown twice"
        nodes = Counter(visible["nodes"].column("trace_id").to_pylist())
        branches = Counter(visible["branches"].column("trace_id").to_pylist())
        segments = set(visible["segments"].column("segment_id").to_pylist())
        assert set(nodes) <= set(ids) and set(branches) <= set(ids), "rows of a trace that is not visible"
        for t in ids:
            assert nodes[t] == expected["nodes"][t], f"trace {t}: {nodes[t]} of {expected['nodes'][t]} nodes"
            assert branches[t] == expected["branches"][t], f"trace {t}: {branches[t]} branches"
            assert expected["segments"][t] <= segments, f"trace {t}: segments missing"
        polls["seen"] = max(polls["seen"], len(ids))
        polls["partial"] += 0 < len(ids) < len(expected["ids"])
    else:
        polls["sql"] += 1
        rows = lake.sql(
            "SELECT t.trace_id, count(n.node_index) AS n FROM traces t LEFT JOIN nodes n USING (trace_id) "
            "GROUP BY t.trace_id"
        ).to_pylist()
        for r in rows:
            assert r["n"] == expected["nodes"][r["trace_id"]], f"sql: trace {r['trace_id']}: {r['n']} nodes"


def _reader(where, expected: dict, stop: threading.Event, polls: Counter, errors: list) -> None:
    lake = lakes.open(where)
    while not stop.is_set():
        try:
            _whole(lake, expected, polls)
        except AssertionError as e:
            errors.append(str(e))
            return
        except Exception as e:  # noqa: BLE001 - reported by the test
            errors.append(f"{type(e).__name__}: {e}")
            return
        stop.wait(POLL_SECONDS)


@pytest.mark.parametrize("catalog", ["postgres"])
def test_eight_writers_one_killed_mid_write(local_ray, inputs, catalog, request, tmp_path):
    files, expected = inputs
    if catalog == "postgres":
        where = request.getfixturevalue("postgres").lake_properties(tmp_path / "lake.yaml", tmp_path / "warehouse")
    else:
        where = tmp_path / "L"
    lake = lakes.init(where)
    address = local_ray.get_runtime_context().gcs_address
    env = {**os.environ, **ENV}
    marker = tmp_path / "stalled"

    def command(k: int) -> list[str]:
        chosen = [str(files[k % FILES]), str(files[(k + 1) % FILES])]
        options = ["--lake", str(where), "--ray-address", address, "--workers", "1", "--files-per-task", "1"]
        return ["lake", "ingest", *options, "--json", *chosen]

    def start(k: int, argv: list[str]) -> subprocess.Popen:
        return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    stop, polls, errors = threading.Event(), Counter(), []
    reader = threading.Thread(target=_reader, args=(where, expected, stop, polls, errors), daemon=True)
    started = time.monotonic()
    procs = {0: start(0, [sys.executable, "-c", STALLER, str(marker), *command(0)])}
    procs.update({k: start(k, [sys.executable, "-m", "tracedb", *command(k)]) for k in range(1, WRITERS)})
    reader.start()
    deadline = started + DEADLINE
    try:
        while not marker.exists():  # writer 0's first commit has committed all but its traces
            assert procs[0].poll() is None, f"the stalling writer exited: {procs[0].communicate()[1][-2000:]}"
            assert time.monotonic() < deadline, "writer 0 never reached its traces commit"
            time.sleep(0.05)
        worker, batch = marker.read_text().split()
        assert int(worker) == procs[0].pid  # the driver commits its tasks' writes
        procs[0].send_signal(signal.SIGKILL)
        procs[0].wait(timeout=30)
        assert procs[0].returncode == -signal.SIGKILL
        procs[0] = start(0, [sys.executable, "-m", "tracedb", *command(0)])  # writer 0 run again, at once
        reports = {}
        for k in range(WRITERS):
            out, err = procs[k].communicate(timeout=max(1.0, deadline - time.monotonic()))
            assert procs[k].returncode == 0, err[-3000:]
            reports[k] = json.loads(out)
    finally:
        stop.set()
        reader.join(timeout=60)
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
    elapsed = time.monotonic() - started
    assert not errors, errors[0]
    assert polls["partial"] >= 1 and polls["sql"] >= 1, polls  # the reader looked while traces arrived
    visible = lake.tables()
    assert sorted(visible["traces"].column("trace_id").to_pylist()) == expected["ids"]  # each trace once
    assert sum(r["traces"] for r in reports.values()) == len(expected["ids"])  # committed by one writer each
    assert sum(r["traces"] + r["skipped"] for r in reports.values()) == 2 * len(expected["ids"])
    _whole(lake, expected, Counter())
    raw_nodes = lake.table("nodes").scan(selected_fields=("lake_batch",)).to_arrow().column("lake_batch").to_pylist()
    raw_traces = lake.table("traces").scan(selected_fields=("lake_batch",)).to_arrow().column("lake_batch").to_pylist()
    assert batch in raw_nodes and batch not in raw_traces  # the kill landed between the nodes and traces commits
    lake.pull(tmp_path / "pulled.duckdb")
    with tracedb.connect(tmp_path / "pulled.duckdb", read_only=True) as pulled:
        assert {t: pulled.trace(t) for t in expected["ids"]} == expected["records"]
    commits = sum(r["commits"] for r in reports.values())
    retries = sum(r["retries"] for r in reports.values())
    assert commits > 0
    print(
        f"{catalog}: {WRITERS} writers, {commits} commits, {retries} retries, {polls['tables']}+{polls['sql']} reads"
        f" ({polls['partial']} of them while traces arrived), {elapsed:.1f} s"
    )
