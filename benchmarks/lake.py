"""``python -m benchmarks lake``: the lake on this machine beside the file store, and a projection.

Measured (this machine, one local Ray of 2 CPUs, the driver on the same cores), each
figure of the file store and of the lake in one run, warm (every step run twice, the
second timed; the lake's views cold too): the workload cut into shard files; the file
store's ingest of them, ``db.branches()`` and ``db.micro_batches``; on each catalog
(``--catalog sqlite|postgres|both``, default both) the lake's ``lake.ingest`` with 1 and 2
workers (fresh lakes), its commits per 256 traces, ``lake.branches`` (Ray workers) and
``lake.micro_batches`` before and after ``lake.compact``; bytes on disk. The lake's views
are checked against the file store's (exit 2 when they differ). Then, on a lake of
2,048 traces of 3k tokens (``SQL``), ``lake.sql("SELECT * FROM branch_stats() WHERE
trace_id = ?")`` in this process beside ``db.sql`` of the same on the file store; and
incremental compaction's proportionality: the same new traces compacted on a lake and on
one 4x larger (``GROWTH``).

Many writers: 256 of the SQL lake's 3k-token traces cut into 16 shard files, each
written and committed by a Ray task of its own into a fresh lake on each catalog, N = 1,
2, 4, 8 writes at once (one local Ray of 8 CPUs): commits per second and retries per
commit, as the writes' reports count them (small writes, bounded in time:
:data:`WRITER_SECONDS`). The PostgreSQL catalog is a throwaway server
(``benchmarks/postgres.py``) started and stopped by the benchmark; with ``both`` and no
server to be had it is left out, saying why.

Projected (arithmetic on the measured per-trace figures, see ``docs/scale.md``): a run
of 1M rollouts x 30k tokens over 64 writers. Ray binds every interface, so the
measurements run in a child process inside a network namespace holding only loopback
(``unshare --net``, root; PostgreSQL is reached over a Unix socket); without one the
suite stops saying why. Writes ``benchmarks/results-lake.json``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from benchmarks.harness import CorrectnessError
from benchmarks.workload import WorkloadFiles

RESULTS = Path(__file__).resolve().parent / "results-lake.json"
QUICK = {"traces": 16, "tokens": 3_000, "repeat": 1}
FULL = {"traces": 256, "tokens": 30_000, "repeat": 1}
SQL = {"traces": 2_048, "tokens": 3_000}
SQL_QUICK = {"traces": 64, "tokens": 1_000}
"""The lake of the one-trace SQL figure (and of the compaction growth figure)."""
GROWTH = {"base": 256, "new": 256, "factor": 4}
GROWTH_QUICK = {"base": 8, "new": 16, "factor": 4}
"""Compaction's proportionality: ``new`` traces compacted on a lake of ``base`` traces
(compacted) and on one of ``factor`` x ``base``."""
SQL_QUERY = "SELECT * FROM branch_stats() WHERE trace_id = ?"
SQL_RUNS = 7
"""One-trace queries timed per store (each of another trace; the median is reported)."""

CATALOGS = ("sqlite", "postgres")
WRITERS = (1, 2, 4, 8)
WRITER_SHARDS = 16
WRITER_TRACES = 256
"""Traces the many-writers figure writes (of the SQL lake's 3k-token traces, 16 a write):
small writes, so that eight at once hold little memory (Ray's memory monitor killed
writers of 16 shards of the core workload when another job held most of the machine's)."""
WRITER_SECONDS = 600.0
"""The many-writers phase of one catalog stops starting new N past this (reported)."""

TARGET = {
    "rollouts": 1_000_000,
    "tokens": 30_000,
    "writers": 64,
    "traces_per_commit": 256,
    "traces_per_writer_minute": 64,
}
"""The run the projection is for: 1M rollouts x 30k tokens, 64 writers (``lake ingest``
drivers) each producing ``traces_per_writer_minute`` traces a minute (their rollouts'
time, not tracedb's) and committing every ``traces_per_commit`` (``--commit-traces``)."""
TARGETS = {
    "ingest": 4.0,
    "views": 6.0,
    "views_compacted": 3.0,
    "micro_batches": 3.0,
    "commits_per_256": 6.0,
    "sql": 10.0,
    "compaction_growth": 1.3,
}
"""Issue 25's targets: the lake's figure over the file store's at most this (commits per
256 traces and compaction's growth ratio: absolute)."""


def _shards(jsonl: Path, out: Path, shards: int) -> list[Path]:
    """``jsonl`` cut at line ends into ``shards`` run directories (``traces.jsonl`` each)."""
    lines = jsonl.read_bytes().splitlines(keepends=True)
    per = max(1, -(-len(lines) // shards))
    dirs = []
    for k in range(0, len(lines), per):
        d = out / f"run{k // per:03d}"
        d.mkdir(parents=True, exist_ok=True)
        (d / "traces.jsonl").write_bytes(b"".join(lines[k : k + per]))
        dirs.append(d)
    return dirs


def _bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _commits(lake: Any) -> int:
    return sum(len(lake.table(name).snapshots()) for name in lake._tables)


def _warm(step: Callable[[], Any], runs: int = 2) -> tuple[float, Any]:
    """Run ``step`` ``runs`` times; the last run's seconds and result (the first warms up)."""
    for _ in range(runs):
        started = time.perf_counter()
        got = step()
        seconds = time.perf_counter() - started
    return seconds, got


class Lakes:
    """Fresh lakes on one catalog: a directory (SQLite) or a database of a PostgreSQL server."""

    def __init__(self, catalog: str, scratch: Path, server: Any = None) -> None:
        self.catalog, self.scratch, self.server = catalog, scratch, server
        self.warehouses: dict[str, Path] = {}

    def make(self, name: str) -> Any:
        """A new lake (the default bucket count)."""
        import tracedb.lake as lakes

        where: Path = self.scratch / f"{self.catalog}-{name}"
        self.warehouses[name] = where / "warehouse"
        if self.server is not None:
            self.warehouses[name] = where
            where = self.server.lake_properties(self.scratch / f"{self.catalog}-{name}.yaml", where)
        return lakes.init(where)


@contextlib.contextmanager
def _catalogs(names: list[str], scratch: Path, log: Any) -> Iterator[dict[str, Lakes | str]]:
    """Each catalog's :class:`Lakes`, or why it is left out."""
    from benchmarks import postgres

    with contextlib.ExitStack() as stack:
        out: dict[str, Lakes | str] = {}
        for name in names:
            if name == "postgres":
                problem = postgres.problem()
                if problem:
                    out[name] = problem
                    log(f"lake: postgres left out: {problem}")
                    continue
                out[name] = Lakes(name, scratch, stack.enter_context(postgres.cluster()))
            else:
                out[name] = Lakes(name, scratch)
        yield out


def measure_lake(lakes: Lakes, runs: list[Path], views: Any, plan: Any, n_traces: int) -> dict[str, Any]:
    """The lake's figures on one catalog (Ray running): see the module's docstring."""
    import pyarrow as pa
    import ray

    out: dict[str, Any] = {}
    for workers in (1, 2):
        lake = lakes.make(f"ingest{workers}")
        started = time.perf_counter()
        got = lake.ingest(runs, workers=workers)
        out[f"lake_ingest_{workers}w_s"] = time.perf_counter() - started
        if got.traces != n_traces:
            raise CorrectnessError(f"lake ingest ({workers} workers) added {got.traces} of {n_traces} traces")
        out[f"lake_ingest_{workers}w_commits"] = got.commits
    out["lake_writes"] = got.tasks
    out["lake_commits"] = _commits(lake)
    out["commits_per_256_traces"] = out["lake_ingest_1w_commits"] / -(-n_traces // 256)  # per commit of <= 256
    out["lake_data_files"] = sum(len(list(lake.table(n).scan().plan_files())) for n in lake._tables)
    out["lake_bytes"] = _bytes(lakes.warehouses["ingest2"])
    key = [("trace_id", "ascending"), ("branch_index", "ascending")]
    per_task = max(1, n_traces // 4)

    def lake_views() -> Any:
        return pa.concat_tables(ray.get(lake.branches(train_once=True, traces_per_task=per_task).to_arrow_refs()))

    started = time.perf_counter()
    lake_views()  # cold: Ray starts the view workers (imports, JIT cache loads)
    out["lake_views_cold_s"] = time.perf_counter() - started
    out["lake_views_s"], got_views = _warm(lake_views)
    if not got_views.sort_by(key).equals(views.sort_by(key)):
        raise CorrectnessError("lake.branches differs from db.branches on the same traces")
    out["lake_visible_s"], local = _warm(lake.tables, 1)  # the driver reading every visible row
    out["lake_visible_rows"] = sum(t.num_rows for t in local.values())
    out["lake_micro_batches_s"], lake_plan = _warm(lambda: lake.micro_batches(32_768, ranks=8))
    if lake_plan.report.samples != plan.report.samples:
        raise CorrectnessError("lake.micro_batches packed another number of samples than db.micro_batches")
    started = time.perf_counter()
    compacted = lake.compact(grace=0)
    out["lake_compact_s"] = time.perf_counter() - started
    out["lake_files_before_compact"] = sum(e["files_before"] for e in compacted.tables.values())
    out["lake_files_after_compact"] = sum(e["files_after"] for e in compacted.tables.values())
    out["lake_views_compacted_s"], got_views = _warm(lake_views)
    if not got_views.sort_by(key).equals(views.sort_by(key)):
        raise CorrectnessError("lake.branches after compaction differs from db.branches")
    out["lake_micro_batches_compacted_s"], _ = _warm(lambda: lake.micro_batches(32_768, ranks=8))
    return out


def measure_sql(lakes: Lakes, db: Any, ids: list[str]) -> dict[str, Any]:
    """``lake.sql`` of one trace's ``branch_stats()`` beside ``db.sql`` (in this process),
    before and after a compaction of the lake (pushed 256 traces a write)."""
    lake = lakes.make("sql")
    started = time.perf_counter()
    lake.push(db, batch_traces=256)
    out: dict[str, Any] = {"sql_push_s": time.perf_counter() - started, "sql_traces": len(ids)}
    picks = ids[:: max(1, len(ids) // SQL_RUNS)][:SQL_RUNS]

    def timed(run: Callable[[str], Any]) -> float:
        run(picks[-1])  # warm: the macros, the connection, the tables' metadata
        seconds = []
        for trace_id in picks:
            started = time.perf_counter()
            run(trace_id)
            seconds.append(time.perf_counter() - started)
        return statistics.median(seconds)

    order = [("trace_id", "ascending"), ("branch_index", "ascending")]  # the query has no ORDER BY
    for trace_id in picks[:2]:
        if not lake.sql(SQL_QUERY, [trace_id]).sort_by(order).equals(db.sql(SQL_QUERY, [trace_id]).sort_by(order)):
            raise CorrectnessError(f"lake.sql differs from db.sql for trace {trace_id}")
    out["sql_file_s"] = timed(lambda t: db.sql(SQL_QUERY, [t]))
    out["sql_lake_s"] = timed(lambda t: lake.sql(SQL_QUERY, [t]))
    lake.compact(grace=0)
    out["sql_lake_compacted_s"] = timed(lambda t: lake.sql(SQL_QUERY, [t]))
    return out


def measure_growth(lakes: Lakes, db: Any, ids: list[str], growth: dict[str, int]) -> dict[str, Any]:
    """Seconds to compact the same ``new`` traces on a compacted lake of ``base`` traces and
    on one ``factor`` times larger (both pushed 256 traces a write)."""
    from tracedb.lake.move import file_rows

    base, new, factor = growth["base"], growth["new"], growth["factor"]
    fresh = ids[base * factor : base * factor + new]
    out: dict[str, Any] = {}
    for size in (base, base * factor):
        lake = lakes.make(f"growth{size}")
        for start in range(0, size, 256):  # writes of 256 traces, compacted
            lake.append(file_rows(db, ids[start : min(start + 256, size)], rejects=False))
        lake.compact(grace=0)
        for start in range(0, len(fresh), 256):
            lake.append(file_rows(db, fresh[start : start + 256], rejects=False))
        seconds = []
        for attempt in range(2):  # the same new data compacted twice (a second copy, made alike): the faster
            if attempt:
                lake = lakes.make(f"growth{size}-again")
                for start in range(0, size, 256):
                    lake.append(file_rows(db, ids[start : min(start + 256, size)], rejects=False))
                lake.compact(grace=0)
                for start in range(0, len(fresh), 256):
                    lake.append(file_rows(db, fresh[start : start + 256], rejects=False))
            started = time.perf_counter()
            report = lake.compact(grace=0)
            seconds.append(time.perf_counter() - started)
        out[f"compact_new_on_{size}_s"] = min(seconds)
        out[f"compact_new_on_{size}_rows"] = report.tables["nodes"]["rows_before"]
    out["compact_new_s"] = out[f"compact_new_on_{base}_s"]
    out["compact_new_traces"] = len(fresh)
    out["compaction_growth"] = out[f"compact_new_on_{base * factor}_s"] / out[f"compact_new_on_{base}_s"]
    return out


def _write_alone(location: Any, files: list[str]) -> dict[str, int]:
    """One writer of the many-writers figure (a Ray task): its files staged and committed
    by itself, as one write (its own catalog connection, racing the others)."""
    from tracedb.lake import catalog, ingest, write

    staged = ingest.ingest_files(location, files, False)["staged"]
    report = write.commit(catalog.Opened.worker(location), [staged])
    return {"traces": report.traces, "commits": report.commits, "retries": report.retries}


def writer_input(jsonl: Path, out: Path, traces: int = WRITER_TRACES) -> tuple[Path, int]:
    """The first ``traces`` lines (one trace each) of ``jsonl`` as the many-writers input."""
    with jsonl.open("rb") as f:
        lines = [line for _, line in zip(range(traces), f, strict=False)]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_bytes(b"".join(lines))
    return out, len(lines)


def measure_writers(
    jsonl: Path, scratch: Path, catalogs: dict[str, Lakes | str], expected: int, budget: float = WRITER_SECONDS
) -> dict[str, Any]:
    """Commits per second and retries per commit of N writers at once (:data:`WRITERS`),
    each a Ray task writing and committing one shard file itself, on each catalog (Ray
    running, with at least 8 CPUs); ``expected``: the traces of ``jsonl``, which every
    run must add. A catalog's N not started within ``budget`` seconds of its first are
    reported as not measured."""
    import ray

    from tracedb.lake.ingest import run_limited

    runs = _shards(jsonl, scratch / "writer-shards", WRITER_SHARDS)
    task = ray.remote(max_retries=0)(_write_alone)
    out: dict[str, Any] = {}
    for name, lakes in catalogs.items():
        if isinstance(lakes, str):
            out[name] = {"skipped": lakes}
            continue
        figures: dict[str, Any] = {}
        began = time.perf_counter()
        for writers in WRITERS:
            if time.perf_counter() - began > budget:
                figures[str(writers)] = {"skipped": f"the phase passed its {budget:.0f} s"}
                continue
            lake = lakes.make(f"w{writers}")
            started = time.perf_counter()
            calls = [(task, (lake.location, [str(r / "traces.jsonl")])) for r in runs]
            got = run_limited(ray, calls, writers)
            seconds = time.perf_counter() - started
            traces, commits, retries = (sum(g[k] for g in got) for k in ("traces", "commits", "retries"))
            if traces != expected:
                raise CorrectnessError(f"{name}, {writers} writers: {traces} of {expected} traces added")
            figures[str(writers)] = {
                "seconds": seconds,
                "writes": len(runs),
                "commits": commits,
                "retries": retries,
                "commits_per_s": commits / seconds,
                "retries_per_commit": retries / max(1, commits),
            }
        out[name] = figures
    return out


def measure(
    jsonl: Path,
    sql_jsonl: Path,
    workdir: Path,
    shards: int,
    catalogs: list[str],
    quick: bool,
    partial: Path | None = None,
) -> dict[str, Any]:
    """The measurements (inside the namespace): see the module notes. ``partial`` (a
    path): the figures so far written there after each step, so that a run that fails
    late (or is stopped) still shows what it measured."""
    import ray

    import tracedb

    scratch = Path(tempfile.mkdtemp(prefix="lake-bench-", dir=workdir))
    out: dict[str, Any] = {}

    def log(message: str) -> None:
        print(message, file=sys.stderr, flush=True)
        if partial is not None and out:
            out.setdefault("load", {})[f"at {message}"] = os.getloadavg()
            partial.write_text(json.dumps(out, indent=2))

    try:
        runs = _shards(jsonl, scratch / "shards", shards)
        out.update({"shards": len(runs), "input_bytes": jsonl.stat().st_size, "load": {}})
        out["load"]["start"] = os.getloadavg()
        started = time.perf_counter()
        with tracedb.connect(scratch / "file.duckdb") as db:
            report = db.ingest(runs)
            out["file_ingest_s"] = time.perf_counter() - started
            n_traces = db.sql("SELECT count(*) FROM traces").column(0)[0].as_py()
            tokens = db.sql("SELECT sum(n_tokens) FROM traces").column(0)[0].as_py()
            out["file_views_s"], views = _warm(lambda: db.branches(train_once=True).replace_schema_metadata(None))
            out["file_micro_batches_s"], plan = _warm(lambda: db.micro_batches(32_768, ranks=8))
        out.update(traces=n_traces, tokens=int(tokens), lines=report.lines, branches=views.num_rows)
        out["file_bytes"] = (scratch / "file.duckdb").stat().st_size
        log("lake: file store measured")
        with _catalogs(catalogs, scratch, log) as chosen:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
            ray.data.DataContext.get_current().enable_progress_bars = False
            try:
                warm = Lakes("warm-up", scratch).make("ray")  # Ray's workers started, their imports and kernels loaded
                warm.ingest(runs[:2], workers=2)
                ray.get(warm.branches(traces_per_task=1).to_arrow_refs())
                for name, lakes in chosen.items():
                    if isinstance(lakes, str):
                        out.setdefault("skipped", {})[name] = lakes
                        continue
                    log(f"lake: {name}: ingest, views, micro-batches, compaction")
                    out[name] = measure_lake(lakes, runs, views, plan, n_traces)
                    out["load"][name] = os.getloadavg()
            finally:
                ray.shutdown()
            with tracedb.connect(scratch / "sql.duckdb") as db:
                db.ingest(sql_jsonl)
                ids = db.sql("SELECT trace_id FROM traces ORDER BY seq, trace_id").column(0).to_pylist()
                for name, lakes in chosen.items():
                    if isinstance(lakes, str):
                        continue
                    log(f"lake: {name}: one-trace SQL, compaction growth")
                    out[name].update(measure_sql(lakes, db, ids))
                    out[name].update(measure_growth(lakes, db, ids, GROWTH_QUICK if quick else GROWTH))
                    log(f"lake: {name}: one-trace SQL and compaction growth measured")
            ray.init(num_cpus=max(WRITERS), include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
            try:
                log("lake: many writers")
                small, count = writer_input(sql_jsonl, scratch / "writers" / "traces.jsonl")
                out["writers"] = measure_writers(small, scratch, chosen, count)
            finally:
                ray.shutdown()
        out["load"]["end"] = os.getloadavg()
        log("lake: done")
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def ratios(m: dict[str, Any], catalog: str) -> dict[str, float]:
    """The lake's figures of ``catalog`` over the file store's (and the absolute targets):
    what :data:`TARGETS` bounds."""
    lake = m[catalog]
    return {
        "ingest": lake["lake_ingest_1w_s"] / m["file_ingest_s"],
        "views": lake["lake_views_s"] / m["file_views_s"],
        "views_compacted": lake["lake_views_compacted_s"] / m["file_views_s"],
        "micro_batches": lake["lake_micro_batches_s"] / m["file_micro_batches_s"],
        "commits_per_256": lake["commits_per_256_traces"],
        "sql": lake["sql_lake_s"] / lake["sql_file_s"],
        "compaction_growth": lake["compaction_growth"],
    }


def project(m: dict[str, Any], target: dict[str, Any] = TARGET) -> dict[str, Any]:
    """The run of ``target`` from the measured per-trace and per-commit figures: the
    PostgreSQL catalog's (the one for many writers) when measured, else SQLite's."""
    lake = m["postgres"] if "postgres" in m else m[next(c for c in CATALOGS if c in m)]
    scale = target["tokens"] / (m["tokens"] / m["traces"])  # measured traces were this much shorter
    commits = target["rollouts"] / target["traces_per_commit"]
    per_commit = lake["commits_per_256_traces"] * target["traces_per_commit"] / 256
    commit_rate = target["writers"] * target["traces_per_writer_minute"] / 60 / target["traces_per_commit"]
    files_per_commit = lake["lake_data_files"] / (m["traces"] / 256)  # data files a 256-trace commit adds
    return {
        "input_bytes": m["input_bytes"] / m["traces"] * scale * target["rollouts"],
        "lake_bytes": lake["lake_bytes"] / m["traces"] * scale * target["rollouts"],
        "commits_of_traces": commits,
        "table_commits": commits * per_commit,
        "commits_per_s": commit_rate * per_commit,
        "traces_commits_per_s": commit_rate,
        "ingest_core_s": lake["lake_ingest_1w_s"] / m["traces"] * scale * target["rollouts"],
        "ingest_core_s_per_commit": lake["lake_ingest_1w_s"] / m["traces"] * scale * target["traces_per_commit"],
        "data_files_per_commit": files_per_commit * target["traces_per_commit"] / 256,
        "data_files_before_compaction": commits * files_per_commit * target["traces_per_commit"] / 256,
        "compact_core_s": lake["compact_new_s"] / lake["compact_new_traces"] * sql_scale(m) * target["rollouts"],
        "views_core_s": lake["lake_views_compacted_s"] * 2 / m["traces"] * scale * target["rollouts"],
    }


def sql_scale(m: dict[str, Any], target: dict[str, Any] = TARGET) -> float:
    """How much longer the target's traces are than the one-trace SQL lake's."""
    return target["tokens"] / m["sql_tokens_per_trace"]


def run(
    files: WorkloadFiles, workdir: Path, repeat: int, *, log: Any = print, catalog: str = "both", **_: Any
) -> dict[str, Any]:
    """Run :func:`measure` in a loopback-only network namespace, then :func:`project`.
    ``catalog``: the catalogs measured (sqlite, postgres, both)."""
    if catalog not in (*CATALOGS, "both"):
        raise ValueError(f"catalog must be one of {[*CATALOGS, 'both']}, not {catalog!r}")
    if catalog == "postgres":
        from benchmarks import postgres

        if problem := postgres.problem():
            raise RuntimeError(f"the lake benchmark's postgres catalog: {problem}")
    from benchmarks.workload import build, make

    catalogs = list(CATALOGS) if catalog == "both" else [catalog]
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise RuntimeError("the lake benchmark needs unshare and ip (a loopback-only network namespace for Ray)")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    quick = files.manifest["traces"] <= 32
    shards = 4 if quick else 8
    sizes = SQL_QUICK if quick else SQL
    sql_files = build(make("core", traces=sizes["traces"], tokens=sizes["tokens"]), workdir, log=log)
    result_file = workdir / f"lake-measure-{os.getpid()}.json"
    inner = (
        f"ip link set lo up && exec {sys.executable} -m benchmarks.lake "
        f"{files.jsonl.resolve()} {sql_files.jsonl.resolve()} {workdir} {shards} {result_file} "
        f"{','.join(catalogs)} {int(quick)}"
    )
    root = str(Path(__file__).resolve().parents[1])  # benchmarks importable in the child
    env = {
        **os.environ,
        "RAY_USAGE_STATS_ENABLED": "0",
        "RAY_DISABLE_DOCKER_CPU_WARNING": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p),
    }
    log(f"lake: measuring {files.manifest['traces']} traces in {shards} shards (Ray in a loopback-only namespace)")
    done = subprocess.run(["unshare", "--net", "sh", "-c", inner], env=env, capture_output=True, text=True)
    if done.returncode == 2:
        raise CorrectnessError(done.stderr.strip().splitlines()[-1])
    if done.returncode != 0:
        raise RuntimeError(f"the lake measurement failed: {done.stderr[-3000:]}")
    measured = json.loads(result_file.read_text())
    result_file.unlink()
    measured["sql_tokens_per_trace"] = sql_files.manifest["tokens"] / sql_files.manifest["traces"]
    return {
        "suite": "lake",
        "workload": files.manifest,
        "sql_workload": sql_files.manifest,
        "measured": measured,
        "target": TARGET,
        "targets": TARGETS,
        "ratios": {c: ratios(measured, c) for c in catalogs if c in measured},
        "projected": project(measured),
    }


def _rate(n: float, seconds: float) -> str:
    return f"{n / seconds:,.1f}/s" if seconds else "-"


def render(results: dict[str, Any]) -> str:
    """The side-by-side table per catalog, the targets, the writers and the projection."""
    m, p = results["measured"], results["projected"]
    t, k = m["traces"], m["tokens"]
    load = m.get("load", {})
    lines = [
        f"measured: {t} traces, {k:,} tokens, {m['shards']} shard files (2 cores, driver included);"
        f" load average at start {load.get('start', ['?'])[0]}, at end {load.get('end', ['?'])[0]}",
        f"  {'file store: ingest':<40} {m['file_ingest_s']:8.2f} s  {_rate(t, m['file_ingest_s']):>12} traces",
        f"  {'file store: views (warm)':<40} {m['file_views_s']:8.2f} s",
        f"  {'file store: micro_batches (warm)':<40} {m['file_micro_batches_s']:8.2f} s",
    ]
    for catalog in CATALOGS:
        lake = m.get(catalog)
        if lake is None:
            if catalog in m.get("skipped", {}):
                lines.append(f"{catalog}: not measured ({m['skipped'][catalog]})")
            continue
        lines.append(f"{catalog} catalog:")
        rows = [
            ("ingest, 1 worker", "lake_ingest_1w_s"),
            ("ingest, 2 workers", "lake_ingest_2w_s"),
            ("views (Ray, cold)", "lake_views_cold_s"),
            ("views (Ray, warm)", "lake_views_s"),
            ("read every visible row", "lake_visible_s"),
            ("micro_batches (warm)", "lake_micro_batches_s"),
            ("compact", "lake_compact_s"),
            ("views after compact", "lake_views_compacted_s"),
            ("micro_batches after compact", "lake_micro_batches_compacted_s"),
            (f"lake.sql one trace ({lake.get('sql_traces', '?')} traces)", "sql_lake_s"),
            ("  the same after compact", "sql_lake_compacted_s"),
            ("  db.sql of the same (file store)", "sql_file_s"),
        ]
        lines += [f"  {label:<40} {lake[key]:8.3f} s" for label, key in rows if key in lake]
        lines.append(
            f"  commits per 256 traces {lake['commits_per_256_traces']:.1f}; files {lake['lake_files_before_compact']}"
            f" -> {lake['lake_files_after_compact']} after compact; bytes {lake['lake_bytes']:,}"
            f" (file store {m['file_bytes']:,}, input {m['input_bytes']:,})"
        )
        if "compaction_growth" in lake:
            lines.append(
                f"  compaction of the same new traces on a lake 4x larger: x{lake['compaction_growth']:.2f}"
                f" ({lake['compact_new_s']:.2f} s for {lake['compact_new_traces']} new traces)"
            )
        got = results.get("ratios", {}).get(catalog, {})
        marks = ", ".join(
            f"{name} {value:.2f} ({'MET' if value <= TARGETS[name] else 'MISSED'} <= {TARGETS[name]:g})"
            for name, value in got.items()
        )
        lines.append(f"  targets: {marks}")
    lines.append(
        f"projected ({TARGET['rollouts']:,} rollouts x {TARGET['tokens']:,} tokens, {TARGET['writers']} writers):"
        f" input {p['input_bytes'] / 1e12:.2f} TB, lake {p['lake_bytes'] / 1e12:.2f} TB,"
        f" {p['commits_of_traces']:,.0f} commits of {TARGET['traces_per_commit']} traces,"
        f" {p['commits_per_s']:.2f} table commits/s ({p['traces_commits_per_s']:.2f}/s on traces)"
    )
    for name, figures in m.get("writers", {}).items():
        if "skipped" in figures:
            lines.append(f"writers on {name}: not measured ({figures['skipped']})")
            continue
        cells = ", ".join(
            f"{n}: not measured ({f['skipped']})"
            if "skipped" in f
            else f"{n}: {f['commits_per_s']:.1f} commits/s, {f['retries_per_commit']:.2f} retries/commit"
            for n, f in figures.items()
        )
        lines.append(f"writers on {name} ({WRITER_SHARDS} writes; N at once): {cells}")
    return "\n".join(lines)


if __name__ == "__main__":  # the child, inside the namespace: measure and write the JSON
    jsonl, sql_jsonl, workdir, shards, result, chosen, quick = sys.argv[1:8]
    try:
        measured = measure(
            Path(jsonl),
            Path(sql_jsonl),
            Path(workdir),
            int(shards),
            [c for c in chosen.split(",") if c],
            quick == "1",
            partial=Path(result).with_suffix(".partial.json"),
        )
    except CorrectnessError as e:
        print(f"CORRECTNESS FAILURE: {e}", file=sys.stderr)
        sys.exit(2)
    Path(result).write_text(json.dumps(measured, indent=2))
