"""``python -m benchmarks lake``: the lake on this machine beside the file store, and a projection.

Measured (this machine, one local Ray of 2 CPUs, the driver on the same cores): the
workload cut into shard files; the file store's ingest of them and ``db.branches()``;
the lake's ``lake.ingest`` with 1 and 2 workers (fresh lakes), ``lake.branches`` (Ray
workers) and ``lake.micro_batches``; bytes on disk; the catalog commits a write makes.
The lake's views are checked against the file store's (exit 2 when they differ).
Projected (arithmetic on the measured per-trace figures, see ``docs/scale.md``): a run
of 1M rollouts x 30k tokens over 64 writers.

Many writers (``--catalog sqlite|postgres|both``, default both): the workload cut into
16 shard files ingested by ``lake.ingest(..., workers=N)`` into a fresh lake on each
catalog, N = 1, 2, 4, 8 writes at once (one local Ray of 8 CPUs): commits per second and
retries per commit, as the writes' reports count them. The PostgreSQL catalog is a
throwaway server (``benchmarks/postgres.py``) started and stopped by the benchmark; with
``both`` and no server to be had it is left out, saying why.

Ray binds every interface, so the measurements run in a child process inside a network
namespace holding only loopback (``unshare --net``, root; PostgreSQL is reached over a
Unix socket); without one the suite stops saying why. Writes ``benchmarks/results-lake.json``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.harness import CorrectnessError
from benchmarks.workload import WorkloadFiles

RESULTS = Path(__file__).resolve().parent / "results-lake.json"
QUICK = {"traces": 16, "tokens": 3_000, "repeat": 1}
FULL = {"traces": 256, "tokens": 30_000, "repeat": 1}

CATALOGS = ("sqlite", "postgres")
WRITERS = (1, 2, 4, 8)
WRITER_SHARDS = 16

TARGET = {"rollouts": 1_000_000, "tokens": 30_000, "writers": 64, "traces_per_write": 64, "write_seconds": 60.0}
"""The run the projection is for: 1M rollouts x 30k tokens, 64 writers, each write (one
ingest task) holding ``traces_per_write`` traces; ``write_seconds``: how long a writer
takes to produce one write's traces (rollout time, not tracedb's)."""


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


def measure_writers(jsonl: Path, scratch: Path, catalogs: list[str], expected: int, log: Any = print) -> dict[str, Any]:
    """Commits per second and retries per commit of N writes at once (:data:`WRITERS`),
    on each of ``catalogs`` (Ray running, with at least 8 CPUs); ``expected``: the traces
    of ``jsonl``, which every run must add."""
    import contextlib

    import tracedb.lake as lakes
    from benchmarks import postgres

    runs = _shards(jsonl, scratch / "writer-shards", WRITER_SHARDS)
    out: dict[str, Any] = {}
    for name in catalogs:
        with contextlib.ExitStack() as stack:
            if name == "postgres":
                problem = postgres.problem()
                if problem:
                    out[name] = {"skipped": problem}
                    log(f"lake writers: postgres left out: {problem}")
                    continue
                server = stack.enter_context(postgres.cluster())
            figures = {}
            for writers in WRITERS:
                where: Path = scratch / f"{name}-w{writers}"
                if name == "postgres":
                    where = server.lake_properties(scratch / f"{name}-w{writers}.yaml", where)
                lake = lakes.init(where)
                started = time.perf_counter()
                got = lake.ingest(runs, workers=writers)
                seconds = time.perf_counter() - started
                if got.traces != expected or got.rejected:
                    raise CorrectnessError(f"{name}, {writers} writers: {got.traces} of {expected} traces added")
                figures[str(writers)] = {
                    "seconds": seconds,
                    "writes": got.tasks,
                    "commits": got.commits,
                    "retries": got.retries,
                    "commits_per_s": got.commits / seconds,
                    "retries_per_commit": got.retries / max(1, got.commits),
                }
            out[name] = figures
    return out


def measure(jsonl: Path, workdir: Path, shards: int, catalogs: list[str] | None = None) -> dict[str, Any]:
    """The measurements (inside the namespace): see the module notes."""
    import pyarrow as pa
    import ray

    import tracedb
    import tracedb.lake as lakes

    scratch = Path(tempfile.mkdtemp(prefix="lake-bench-", dir=workdir))
    try:
        runs = _shards(jsonl, scratch / "shards", shards)
        out: dict[str, Any] = {"shards": len(runs), "input_bytes": jsonl.stat().st_size}
        started = time.perf_counter()
        with tracedb.connect(scratch / "file.duckdb") as db:
            report = db.ingest(runs)
            out["file_ingest_s"] = time.perf_counter() - started
            n_traces = db.sql("SELECT count(*) FROM traces").column(0)[0].as_py()
            tokens = db.sql("SELECT sum(n_tokens) FROM traces").column(0)[0].as_py()
            started = time.perf_counter()
            views = db.branches(train_once=True).replace_schema_metadata(None)
            out["file_views_s"] = time.perf_counter() - started
            started = time.perf_counter()
            plan = db.micro_batches(32_768, ranks=8)
            out["file_micro_batches_s"] = time.perf_counter() - started
        out.update(traces=n_traces, tokens=int(tokens), lines=report.lines, branches=views.num_rows)
        out["file_bytes"] = (scratch / "file.duckdb").stat().st_size

        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
        ray.data.DataContext.get_current().enable_progress_bars = False
        try:
            for workers in (1, 2):
                lake = lakes.init(scratch / f"lake{workers}")
                started = time.perf_counter()
                got = lake.ingest(runs, workers=workers)
                out[f"lake_ingest_{workers}w_s"] = time.perf_counter() - started
                if got.traces != n_traces:
                    raise CorrectnessError(f"lake ingest ({workers} workers) added {got.traces} of {n_traces} traces")
            out["lake_writes"] = got.tasks
            out["lake_commits"] = _commits(lake)
            out["lake_bytes"] = _bytes(scratch / "lake2" / "warehouse")
            out["lake_catalog_bytes"] = (scratch / "lake2" / "catalog.db").stat().st_size
            key = [("trace_id", "ascending"), ("branch_index", "ascending")]
            for run in ("cold", "warm"):  # cold: Ray starts the view workers (imports, JIT cache loads)
                started = time.perf_counter()
                dataset = lake.branches(train_once=True, traces_per_task=max(1, n_traces // 4))
                parts = ray.get(dataset.to_arrow_refs())
                out[f"lake_views_{run}_s"] = time.perf_counter() - started
                if not pa.concat_tables(parts).sort_by(key).equals(views.sort_by(key)):
                    raise CorrectnessError("lake.branches differs from db.branches on the same traces")
            out["lake_views_s"] = out["lake_views_warm_s"]
            started = time.perf_counter()
            local = lake.tables()
            out["lake_visible_s"] = time.perf_counter() - started  # the driver reading every visible row
            out["lake_visible_rows"] = sum(t.num_rows for t in local.values())
            started = time.perf_counter()
            lake_plan = lake.micro_batches(32_768, ranks=8)
            out["lake_micro_batches_s"] = time.perf_counter() - started
            if lake_plan.report.samples != plan.report.samples:
                raise CorrectnessError("lake.micro_batches packed another number of samples than db.micro_batches")
            started = time.perf_counter()
            compacted = lake.compact(grace=0)
            out["lake_compact_s"] = time.perf_counter() - started
            out["lake_files_before_compact"] = sum(e["files_before"] for e in compacted.tables.values())
            out["lake_files_after_compact"] = sum(e["files_after"] for e in compacted.tables.values())
            started = time.perf_counter()  # the same views over one file per partition
            parts = ray.get(lake.branches(train_once=True, traces_per_task=max(1, n_traces // 4)).to_arrow_refs())
            out["lake_views_compacted_s"] = time.perf_counter() - started
            if not pa.concat_tables(parts).sort_by(key).equals(views.sort_by(key)):
                raise CorrectnessError("lake.branches after compaction differs from db.branches")
            started = time.perf_counter()
            lake.micro_batches(32_768, ranks=8)
            out["lake_micro_batches_compacted_s"] = time.perf_counter() - started
        finally:
            ray.shutdown()
        if catalogs:  # many writers: a Ray with a CPU per writer (they share the machine's cores)
            ray.init(num_cpus=max(WRITERS), include_dashboard=False, log_to_driver=False, _node_ip_address="127.0.0.1")
            try:
                out["writers"] = measure_writers(
                    jsonl, scratch, catalogs, n_traces, log=lambda m: print(m, file=sys.stderr)
                )
            finally:
                ray.shutdown()
        return out
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def project(m: dict[str, Any], target: dict[str, Any] = TARGET) -> dict[str, Any]:
    """The run of ``target`` from the measured per-token and per-write figures."""
    scale = target["tokens"] / (m["tokens"] / m["traces"])  # measured traces were this much shorter
    per_trace_input = m["input_bytes"] / m["traces"] * scale
    per_trace_lake = m["lake_bytes"] / m["traces"] * scale
    writes = target["rollouts"] / target["traces_per_write"]
    commits_per_write = m["lake_commits"] / max(1, m["lake_writes"])
    write_rate = target["writers"] / target["write_seconds"]  # writes/s arriving at the catalog
    ingest_s_per_trace = m["lake_ingest_1w_s"] / m["traces"] * scale  # one worker, this machine
    return {
        "input_bytes": per_trace_input * target["rollouts"],
        "lake_bytes": per_trace_lake * target["rollouts"],
        "writes": writes,
        "commits_per_write": commits_per_write,
        "commits": writes * commits_per_write,
        "writes_per_s": write_rate,
        "commits_per_s": write_rate * commits_per_write,
        "traces_commits_per_s": write_rate,
        "ingest_cpu_s_per_write": ingest_s_per_trace * target["traces_per_write"],
        "files_per_write": commits_per_write * 16,  # at most one file per bucket per table
        "files_before_compaction": writes * commits_per_write * 16,
    }


def run(
    files: WorkloadFiles, workdir: Path, repeat: int, *, log: Any = print, catalog: str = "both", **_: Any
) -> dict[str, Any]:
    """Run :func:`measure` in a loopback-only network namespace, then :func:`project`.
    ``catalog``: the catalogs of the many-writers measurement (sqlite, postgres, both)."""
    if catalog not in (*CATALOGS, "both"):
        raise ValueError(f"catalog must be one of {[*CATALOGS, 'both']}, not {catalog!r}")
    if catalog == "postgres":
        from benchmarks import postgres

        if problem := postgres.problem():
            raise RuntimeError(f"the lake benchmark's postgres catalog: {problem}")
    catalogs = list(CATALOGS) if catalog == "both" else [catalog]
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        raise RuntimeError("the lake benchmark needs unshare and ip (a loopback-only network namespace for Ray)")
    workdir = Path(workdir).resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    shards = 4 if files.manifest["traces"] <= 32 else 8
    result_file = workdir / f"lake-measure-{os.getpid()}.json"
    inner = (
        f"ip link set lo up && exec {sys.executable} -m benchmarks.lake "
        f"{files.jsonl.resolve()} {workdir} {shards} {result_file} {','.join(catalogs)}"
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
    return {
        "suite": "lake",
        "workload": files.manifest,
        "measured": measured,
        "target": TARGET,
        "projected": project(measured),
    }


def _rate(n: float, seconds: float) -> str:
    return f"{n / seconds:,.1f}/s" if seconds else "-"


def render(results: dict[str, Any]) -> str:
    """The side-by-side table and the projection."""
    m, p = results["measured"], results["projected"]
    t, k = m["traces"], m["tokens"]
    rows = [
        ("ingest (file store)", m["file_ingest_s"], _rate(t, m["file_ingest_s"]), _rate(k, m["file_ingest_s"])),
        ("ingest (lake, 1 worker)", m["lake_ingest_1w_s"], _rate(t, m["lake_ingest_1w_s"]), ""),
        ("ingest (lake, 2 workers)", m["lake_ingest_2w_s"], _rate(t, m["lake_ingest_2w_s"]), ""),
        ("views (db.branches)", m["file_views_s"], _rate(t, m["file_views_s"]), _rate(k, m["file_views_s"])),
        *(
            (
                f"views (lake.branches, Ray, {run})",
                m[f"lake_views_{run}_s"],
                _rate(t, m[f"lake_views_{run}_s"]),
                _rate(k, m[f"lake_views_{run}_s"]),
            )
            for run in ("cold", "warm")
            if f"lake_views_{run}_s" in m
        ),
        ("read every visible row (lake)", m.get("lake_visible_s", float("nan")), "", ""),
        ("micro_batches (file)", m["file_micro_batches_s"], _rate(t, m["file_micro_batches_s"]), ""),
        ("micro_batches (lake)", m["lake_micro_batches_s"], _rate(t, m["lake_micro_batches_s"]), ""),
        ("lake compact", m["lake_compact_s"], "", ""),
        *(
            (label, m[k], _rate(t, m[k]), "")
            for label, k in (
                ("views (lake, after compact)", "lake_views_compacted_s"),
                ("micro_batches (lake, after compact)", "lake_micro_batches_compacted_s"),
            )
            if k in m
        ),
    ]
    lines = [f"measured: {t} traces, {k:,} tokens, {m['shards']} shard files (2 cores, driver included)"]
    lines += [f"  {name:<34} {s:8.2f} s  {a:>12} traces  {b:>14} tokens" for name, s, a, b in rows]
    lines.append(
        f"  bytes: input {m['input_bytes']:,}, file store {m['file_bytes']:,}, lake {m['lake_bytes']:,}"
        f" (+ catalog {m['lake_catalog_bytes']:,}); {m['lake_commits']} commits for {m['lake_writes']} writes;"
        f" files {m['lake_files_before_compact']} -> {m['lake_files_after_compact']} after compact"
    )
    lines.append(
        f"projected ({TARGET['rollouts']:,} rollouts x {TARGET['tokens']:,} tokens, {TARGET['writers']} writers):"
        f" input {p['input_bytes'] / 1e12:.2f} TB, lake {p['lake_bytes'] / 1e12:.2f} TB, {p['writes']:,.0f} writes,"
        f" {p['commits']:,.0f} commits, {p['commits_per_s']:.1f} commits/s"
        f" ({p['traces_commits_per_s']:.2f}/s on traces)"
    )
    for name, figures in m.get("writers", {}).items():
        if "skipped" in figures:
            lines.append(f"writers on {name}: not measured ({figures['skipped']})")
            continue
        cells = ", ".join(
            f"{n}: {f['commits_per_s']:.1f} commits/s, {f['retries_per_commit']:.2f} retries/commit"
            for n, f in figures.items()
        )
        lines.append(f"writers on {name} ({WRITER_SHARDS} writes; N at once): {cells}")
    return "\n".join(lines)


if __name__ == "__main__":  # the child, inside the namespace: measure and write the JSON
    jsonl, workdir, shards, result = sys.argv[1:5]
    chosen = [c for c in (sys.argv[5] if len(sys.argv) > 5 else "").split(",") if c]
    try:
        measured = measure(Path(jsonl), Path(workdir), int(shards), chosen)
    except CorrectnessError as e:
        print(f"CORRECTNESS FAILURE: {e}", file=sys.stderr)
        sys.exit(2)
    Path(result).write_text(json.dumps(measured, indent=2))
