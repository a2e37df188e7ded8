"""``python -m benchmarks live``: a run watched while it is written (issue "Live runs", item 8).

Two server runs, each ``tracedb serve --db X --follow RUN_DIR`` in a subprocess on
127.0.0.1, owning its database and ingesting the run as a writer process appends it:

- **The live run**: the writer appends the core workload's episodes, first at a fixed
  rate, then as fast as it can; 8 reader threads poll ``GET /traces?after=W&wait=S`` and
  fetch every branch of each new trace over REST; a watcher only lists (its first sight of
  a trace is when the trace became visible); a sampler reads the server's RSS and
  ``/health``. Reported: visibility latency (append -> listed over REST) p50/p99, what the
  readers got when (append -> every branch in hand), the ingest rate the follower sustains
  and whether it fell behind in the fast phase, reader request latency, errors, RSS.
- **The soak**: a larger run of the same workload (its first episodes at the same rate,
  the rest as fast as the writer can), watched by the watcher and the sampler only (the
  readers' requests bound the live run's size): visibility with no reader loading the
  server, and the server's RSS against the bytes ingested over gigabytes, with a fitted
  slope (MB per GB).

Correctness, both runs: every appended trace was listed exactly once to every client, in
sequence order with watermarks that never go back; every reader's branches equal what
the database holds; the database holds exactly the appended traces and rejected nothing
(exit 2 otherwise). The moving parts are in ``benchmarks/live_parts.py``, the figures of a run
in ``benchmarks/live_figures.py``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

import tracedb
from benchmarks import tables
from benchmarks.harness import CorrectnessError, Run, remove_db
from benchmarks.live_figures import WARMUP_SHARE, FollowedRun, figures
from benchmarks.live_parts import COLUMNS, Reader, Sampler, Watcher, WriterSpec, cpu_seconds, read_writer, table_digests
from benchmarks.servers import free_port, healthy
from benchmarks.workload import WorkloadFiles, build, kind_of, make
from tracedb.runtime import DEFAULT_MEMORY_LIMIT

RESULTS = Path(__file__).resolve().parent / "results-live.json"
QUICK = {"traces": 24, "tokens": 3_000, "repeat": 1, "rate": 8.0, "rate_traces": 12, "readers": 8, "soak_traces": 32}
FULL = {
    "traces": 512,
    "tokens": 30_000,
    "repeat": 1,
    "rate": 2.0,
    "rate_traces": 96,
    "readers": 8,
    "soak_traces": 12288,
}
SOAK_RATE_TRACES = 32
"""The soak starts with this many episodes at the live run's rate (at most its
``rate_traces``): visibility with no reader loading the server."""
FOLLOW_INTERVAL_S = 0.25
"""The server's ``--interval`` (its default)."""
VISIBLE_TARGET_MS = 1000.0
"""Readers of the REST API see a committed trace within ~1 s (at the fixed rate)."""
SLOPE_TARGET = 50.0
"""MB of server RSS per GB ingested that counts as flat: the soak's slope over its last
third (``live_figures.TAIL_SHARE``)."""


def index_lines(jsonl: Path) -> tuple[list[list[str]], list[int]]:
    """Each line's trace ids and byte length, in file order."""
    ids, sizes = [], []
    with jsonl.open("rb") as f:
        for line in f:
            ids.append([t["id"] for t in orjson.loads(line)["traces"]])
            sizes.append(len(line))
    return ids, sizes


def _tail(path: Path) -> str:
    return path.read_text(errors="replace")[-2000:] if path.exists() else ""


def start_server(
    db: Path, run_dir: Path, memory_limit: str | None, log_path: Path
) -> tuple[subprocess.Popen[bytes], str]:
    """``tracedb serve --db DB --follow RUN_DIR`` on a free loopback port, once ``/health``
    answers; ``memory_limit`` is its ``TRACEDB_MEMORY_LIMIT`` (None: tracedb's default)."""
    port = free_port()
    env = dict(os.environ)
    env.pop("TRACEDB_MEMORY_LIMIT", None)
    if memory_limit is not None:
        env["TRACEDB_MEMORY_LIMIT"] = memory_limit
    command = [sys.executable, "-m", "tracedb", "serve", "--db", str(db), "--follow", str(run_dir)]
    command += ["--port", str(port), "--interval", str(FOLLOW_INTERVAL_S)]
    with log_path.open("wb") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    if not healthy(proc, base, seconds=90, timeout=2, pause=0.2):
        proc.kill()
        proc.wait()
        raise RuntimeError(f"the server did not start: {_tail(log_path)}")
    return proc, base


def follow_run(
    files: WorkloadFiles,
    base_dir: Path,
    *,
    rate: float,
    rate_lines: int,
    readers: int,
    fmt: str,
    memory_limit: str | None,
    drain_seconds: float,
    log: Callable[[str], None],
) -> FollowedRun:
    """One server following ``base_dir/run`` while the writer appends ``files`` into it
    and ``readers`` readers, the watcher and the sampler go through REST; checked."""
    line_ids, line_bytes = index_lines(files.jsonl)
    expected = [t for ids in line_ids for t in ids]
    rate_lines = min(rate_lines, len(line_ids))
    run_dir, db_path = base_dir / "run", base_dir / "live.duckdb"
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    remove_db(db_path)
    spec = WriterSpec(
        source=str(files.jsonl),
        first=str(run_dir / "traces.jsonl"),
        second=str(run_dir / "fast" / "traces.jsonl"),  # a file that appears in a subdirectory
        rate=rate,
        rate_lines=rate_lines,
    )
    log(f"server: tracedb serve --follow {run_dir} (memory limit {memory_limit or 'default'})")
    server, base = start_server(db_path, run_dir, memory_limit, base_dir / "server.log")
    stop = threading.Event()
    writer: subprocess.Popen[str] | None = None
    try:
        sampler = Sampler(base, server.pid, stop, period=0.25 if sum(line_bytes) < 50e6 else 0.5)
        watcher = Watcher("watcher", base, len(expected), stop)
        clients = [Reader(f"reader-{k}", base, len(expected), stop, fmt) for k in range(readers)]
        sampler.start()
        for client in [watcher, *clients]:
            client.start()
        writer = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.live_parts", "--write", orjson.dumps(asdict(spec)).decode()],
            cwd=Path(__file__).resolve().parent.parent,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert writer.stdin is not None and writer.stdout is not None
        records = read_writer(writer.stdout)
        ready = next(records)
        if ready.get("lines") != len(line_ids):
            raise RuntimeError(f"the writer sees {ready.get('lines')} lines, the index {len(line_ids)}")
        time.sleep(1.0)  # samples of the idle server
        log(
            f"writer: {rate_lines} episodes at {rate:g}/s, then {len(line_ids) - rate_lines} as fast as it can "
            f"({sum(line_bytes) / 1e6:.0f} MB in all); {readers} readers"
        )
        writer.stdin.write("go\n")
        writer.stdin.flush()
        appended: dict[int, float] = {}
        appended_wall: dict[int, float] = {}
        phases: dict[str, float] = {}
        written: dict[str, Any] = {}
        for record in records:
            if "lines" in record:
                appended.update(dict.fromkeys(record["lines"], record["t"]))
                appended_wall.update(dict.fromkeys(record["lines"], record["wall"]))
            elif "phase" in record:
                phases[record["phase"]] = record["t"]
            elif record.get("done"):
                written = record
        if writer.wait(timeout=60) != 0 or not written or len(appended) != len(line_ids):
            raise RuntimeError(f"the writer failed (exit {writer.returncode}, {len(appended)} lines appended)")
        log(f"writer: done; waiting for the clients (at most {drain_seconds:.0f} s)")
        deadline = time.monotonic() + drain_seconds
        while any(c.is_alive() for c in [watcher, *clients]) and time.monotonic() < deadline:
            if server.poll() is not None:
                raise RuntimeError(f"the server exited ({server.returncode}): {_tail(base_dir / 'server.log')}")
            time.sleep(0.1)
        drained = time.monotonic() - written["t"]
        stop.set()
        sampler.join(30)
        for client in [watcher, *clients]:
            client.join(10)
        server_cpu = cpu_seconds(server.pid)
    finally:
        stop.set()
        if writer is not None and writer.poll() is None:
            writer.kill()
            writer.wait()
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    correctness = check(expected, {"watcher": watcher, **{c.name: c for c in clients}}, db_path, log)
    return FollowedRun(
        files, line_ids, line_bytes, rate_lines, appended, appended_wall, phases, written, watcher, clients, sampler,
        server_cpu, drained, correctness,
    )  # fmt: skip


def check(expected: list[str], clients: dict[str, Any], db_path: Path, log: Callable[[str], None]) -> dict[str, Any]:
    """Every client listed every trace once, in order; every reader's branches equal the
    database's; the database holds exactly the appended traces and rejected none."""
    problems: list[str] = []
    want = set(expected)
    truth: dict[tuple[str, int], str] = {}
    readers = [c for c in clients.values() if isinstance(c, Reader)]
    with tracedb.connect(db_path, read_only=True) as db:
        stored = {row[0] for row in db.handle.con.execute("SELECT trace_id FROM traces").fetchall()}
        rejects = db.handle.scalar("SELECT count(*) FROM rejects")
        if stored != want:
            problems.append(
                f"the database holds {len(stored)} traces, {len(want)} were appended: "
                f"{len(want - stored)} missing, {len(stored - want)} unexpected"
            )
        if rejects:
            problems.append(f"the follower rejected {rejects} lines")
        if readers:
            log("comparing every reader's branches with the database's")
            for i in range(0, len(expected), 32):
                truth.update(table_digests(db.branches(trace_ids=expected[i : i + 32], columns=COLUMNS)))
    branches = 0
    for name, client in clients.items():
        seen = client.log.seen
        if set(seen) != want:
            problems.append(f"{name}: listed {len(set(seen) & want)} of {len(want)} traces (+{len(set(seen) - want)})")
        if client.log.repeats:
            problems.append(f"{name}: {len(client.log.repeats)} traces listed more than once")
        problems += [f"{name}: {p}" for p in client.log.order_problems[:3]]
        if isinstance(client, Reader):
            got = {(t, i): d for t, s in seen.items() for i, d in s.digests.items()}
            wrong = sum(truth.get(k) != d for k, d in got.items())
            missing = len(set(truth) - set(got))
            branches += len(got)
            if wrong or missing:
                problems.append(f"{name}: {wrong} branches differ from the database's, {missing} not fetched")
    if problems:
        raise CorrectnessError(f"the followed run {db_path} is not exact:\n  " + "\n  ".join(problems[:20]))
    return {
        "passed": True,
        "traces": len(want),
        "clients": len(clients),
        "branches": len(truth),
        "reader_branches_checked": branches,
    }


def run(
    files: WorkloadFiles,
    workdir: Path,
    repeat: int,
    *,
    log: Callable[[str], None],
    rate: float,
    rate_traces: int,
    readers: int,
    soak_traces: int,
    fmt: str = "arrow",
    memory_limit: str | None = None,
    drain_seconds: float = 600.0,
) -> dict[str, Any]:
    """The live run and the soak (``repeat`` is not used: each run is long and its figures
    are distributions); returns the results (see :func:`render`)."""
    frame = Run(children=True)  # the servers and writers, reaped, count as the benchmark's CPU
    params = files.manifest["params"]
    soak_workload = make(kind_of(files), traces=soak_traces, tokens=params["tokens"], seed=params["seed"])
    soak_files = build(soak_workload, workdir, log=log)
    common = {"fmt": fmt, "memory_limit": memory_limit, "drain_seconds": drain_seconds, "log": log}
    log("the live run")
    live = follow_run(files, workdir / "live", rate=rate, rate_lines=rate_traces, readers=readers, **common)
    log("the soak")
    soak_rate = min(SOAK_RATE_TRACES, rate_traces)
    soak = follow_run(soak_files, workdir / "live-soak", rate=rate, rate_lines=soak_rate, readers=0, **common)
    runs = {"live": figures(live, memory_limit), "soak": figures(soak, memory_limit)}
    return frame.results(
        setup={
            "readers": readers,
            "format": fmt,
            "columns": COLUMNS,
            "rate": rate,
            "rate_traces": live.rate_lines,
            "follow_interval_s": FOLLOW_INTERVAL_S,
            "memory_limit": memory_limit or f"default ({DEFAULT_MEMORY_LIMIT})",
            "workload_params": params,
        },
        **runs,
        targets=targets(runs),
    )


def targets(results: dict[str, Any]) -> dict[str, Any]:
    """Visibility p99 at the fixed rate, errors in both runs, the soak's RSS slope."""
    visibility = results["live"]["visibility"].get("rate", {}).get("p99_ms")
    errors = results["live"]["errors"]["total"] + results["soak"]["errors"]["total"]
    slope = results["soak"]["memory"]["slope_tail_MB_per_GB"]
    return {
        "visibility_p99_at_rate": {
            "value": visibility,
            "unit": "ms",
            "target": f"<= {VISIBLE_TARGET_MS:g} ms",
            "passed": None if visibility is None else visibility <= VISIBLE_TARGET_MS,
        },
        "errors": {"value": errors, "unit": "", "target": "0", "passed": errors == 0},
        "soak_rss_tail_slope": {
            "value": slope,
            "unit": "MB/GB",
            "target": f"<= {SLOPE_TARGET:g} MB/GB",
            "passed": None if slope is None else slope <= SLOPE_TARGET,
        },
    }


# ------------------------------------------------------------------ output


def _lat(d: dict[str, Any]) -> str:
    return f"p50 {d['p50_ms']} ms, p99 {d['p99_ms']} ms, max {d['max_ms']} ms"


def _pm(mem: dict[str, Any], name: str) -> str:
    slope, error = mem[f"{name}_MB_per_GB"], mem[f"{name}_stderr"]
    return "-" if slope is None else f"{slope} +- {error}"


def _run_lines(name: str, f: dict[str, Any]) -> list[str]:
    w, ing, mem = f["workload"], f["ingest"], f["memory"]
    lines = [f"{name}: {w['traces']} traces, {w['bytes'] / 1e6:.0f} MB of traces.jsonl"]
    if "rate_phase" in ing:
        r = ing["rate_phase"]
        lines += [
            f"  rate phase: {r['traces']} episodes at {r['episodes_per_s']}/s ({r['MB_per_s_offered']} MB/s) "
            f"over {r['seconds']} s",
            f"    visibility (append -> listed over REST): {_lat(f['visibility']['rate'])}",
        ]
        if f["until_ingest_began"]:
            lines.append(f"      of which append -> ingest began: {_lat(f['until_ingest_began']['rate'])}")
        if "delivered" in f:
            lines.append(f"    delivered (append -> a reader holds every branch): {_lat(f['delivered']['rate'])}")
    if "fast_phase" in ing:
        x = ing["fast_phase"]
        lines += [
            f"  fast phase: {x['traces']} episodes, {x['MB']} MB written in {x['writer_seconds']} s "
            f"({x['writer_MB_per_s']} MB/s); all visible {x['seconds_until_all_visible']} s after its start: "
            f"{x['traces_per_s']} traces/s, {x['MB_per_s']} MB/s sustained",
            f"    follower behind in {x['samples_behind']} of {x['health_samples']} /health samples, "
            f"largest backlog {x['max_backlog_MB']} MB; visibility {_lat(f['visibility']['fast'])}",
        ]
        if "delivered" in f:
            lines.append(f"    delivered: {_lat(f['delivered']['fast'])}")
    q = f["requests"]
    if q["branch_fetch"]["n"]:
        lines.append(
            f"  requests: {q['total']} ({q['MB_received']} MB); branch fetch {_lat(q['branch_fetch'])}; "
            f"listing answered at once p50 {q['listing_answered_at_once']['p50_ms']} ms, "
            f"p99 {q['listing_answered_at_once']['p99_ms']} ms"
        )
    c = f["correctness"]
    lines += [
        f"  errors: {f['errors']['total']} (rejected lines {f['errors']['follower_rejected']})",
        f"  server RSS ({mem['memory_limit']}): {mem['rss_idle_MB']} MB idle, {mem['rss_at_warmup_MB']} MB at "
        f"{WARMUP_SHARE:.0%} of the bytes, {mem['rss_when_ingested_MB']} MB when all {mem['ingested_GB']} GB were "
        f"in, {mem['rss_end_MB']} MB at the end, peak {mem['peak_MB']} MB",
        f"    slope past {WARMUP_SHARE:.0%} of the bytes {_pm(mem, 'slope')} MB/GB, over the second half "
        f"{_pm(mem, 'slope_second_half')}, over the last third {_pm(mem, 'slope_tail')} (from "
        f"{mem['rss_at_tail_start_MB']} MB)",
        f"  correctness: {c['traces']} traces listed once to each of {c['clients']} clients"
        + (f", {c['reader_branches_checked']} branches fetched equal the database's" if c["branches"] else "")
        + ": PASSED",
        f"  server cpu {f['server_cpu_seconds']} s; clients done {f['clients_done_after_writer_s']} s after the writer",
    ]
    return lines


def render(results: dict[str, Any]) -> str:
    """The figures as text."""
    s, m = results["setup"], results["machine"]
    lines = [
        f"{s['readers']} REST readers ({s['format']}, {len(s['columns'])} columns) + a watcher; the server follows "
        f"every {s['follow_interval_s']} s; memory limit {s['memory_limit']}",
        *_run_lines("live run", results["live"]),
        *_run_lines("soak (watcher and sampler only)", results["soak"]),
    ]
    for name, t in results["targets"].items():
        lines.append(
            f"target {name}: {t['value']} {t['unit']} ({t['target']}) {tables.verdict(t['passed'])}".replace("  ", " ")
        )
    lines.append(
        f"machine: {m['cpu_count']} cpus, python {m['python']}, duckdb {m['packages']['duckdb']}; "
        f"{results['seconds']:.0f} s"
    )
    lines += tables.busy_note(results["other_load"], m["cpu_count"])
    return "\n".join(lines)
