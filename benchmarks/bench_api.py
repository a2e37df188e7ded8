"""REST branch lookup over loopback: JSON vs Arrow IPC, 8 concurrent clients.

    python -m benchmarks.bench_api              # 30 s per row: {warm, cold} x {json, arrow}
    python -m benchmarks.bench_api --quick      # 2 s per row, 8 traces: a smoke run
    python -m benchmarks api [--quick]          # the same as a suite: results-api.json

The workload is ``tracedb.synthetic`` rollouts of ~32k tokens each with no compaction, so
every trace is one 32k-token branch. The server is ``uvicorn`` running ``api.create_app``
in a subprocess on 127.0.0.1; the clients are ``--clients`` threads in this process,
each with its own keep-alive ``httpx.Client``, fetching random branches for
``--seconds`` per format. Two servers run in turn: *warm*, as configured by default (the
view cache holds every branch of the workload, so a request costs HTTP and encoding),
and *cold*, with the view cache off (every request builds its view from DuckDB). A
request counts when the client holds usable arrays: JSON is
parsed (orjson) and Arrow read into a table, so the figures are what a trainer pays.
Any non-200 answer or wrong-sized branch is an error (there must be none): this command
then exits 1, and the suite (``python -m benchmarks api``) 2, as for any wrong answer.
"""

from __future__ import annotations

import argparse
import io
import os
import random
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pyarrow.ipc as ipc

from benchmarks.harness import CorrectnessError, write_results
from benchmarks.servers import free_port, healthy
from benchmarks.workload import WorkloadFiles

ARROW = "application/vnd.apache.arrow.stream"
RESULTS = Path(__file__).resolve().parent / "results-api.json"
FULL = {"traces": 32, "tokens": 32_768, "repeat": 1, "seconds": 30.0, "clients": 8}
QUICK = {**FULL, "traces": 8, "seconds": 2.0}
"""The suite's sizes (``python -m benchmarks api``): traces of one ``tokens``-token branch,
``seconds`` per row, ``clients`` threads; ``repeat`` is not used (one run per row)."""
WARM_CACHE_TOKENS = 8_000_000
"""The warm server's view cache (the default's size): every branch of the workload fits."""


def build(workdir: Path, traces: int, tokens: int) -> tuple[Path, dict[str, int]]:
    """The workload database (cached under ``workdir``): one ``tokens``-token branch per trace."""
    import tracedb
    from tracedb.synthetic import write_sample

    db_path = workdir / f"api-{traces}x{tokens}.duckdb"
    if not db_path.exists():
        jsonl = write_sample(
            workdir / f"api-{traces}x{tokens}.jsonl",
            groups=max(1, traces // 8),
            group_size=min(8, traces),
            tokens_per_trace=tokens,
            compaction_every=10 * tokens,
            advantages=True,
        )
        with tracedb.connect(db_path) as db:
            db.ingest(jsonl)
        jsonl.unlink()
    import tracedb

    with tracedb.connect(db_path, read_only=True) as db:
        sizes = dict(db.con.execute("SELECT trace_id, n_tokens FROM branches WHERE branch_index = 0").fetchall())
    return db_path, sizes


def serve(db: str, port: int, cache_tokens: int) -> None:
    """The server side: uvicorn over the app, until killed."""
    import uvicorn

    from tracedb.api import create_app

    app = create_app(db, view_cache_tokens=cache_tokens)
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def start_server(db: Path, cache_tokens: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_api", "--serve", str(db), "--port", str(port)]
        + ["--view-cache-tokens", str(cache_tokens)],
        cwd=root,
    )
    base = f"http://127.0.0.1:{port}"
    if not healthy(proc, base, seconds=60, timeout=1, pause=0.1):
        proc.kill()
        raise RuntimeError("the API server did not start")
    return proc, base


def decode(fmt: str, content: bytes) -> int:
    """Usable arrays from a response; returns the branch's token count."""
    if fmt == "arrow":
        table = ipc.open_stream(io.BytesIO(content)).read_all()
        return len(table.column("token_ids").chunk(0).values)
    body = orjson.loads(content)
    return len(np.asarray(body["token_ids"], np.int32))


def check(base: str, sizes: dict[str, int]) -> None:
    """Before timing: both formats give the library's view of a few branches (a
    :class:`CorrectnessError` otherwise)."""
    import tracedb

    with httpx.Client(base_url=base, timeout=30) as http:
        for trace_id in list(sizes)[:3]:
            arrow = ipc.open_stream(
                io.BytesIO(http.get(f"/traces/{trace_id}/branches/0", headers={"Accept": ARROW}).content)
            ).read_all()
            body = orjson.loads(http.get(f"/traces/{trace_id}/branches/0").content)
            if not arrow.schema.equals(tracedb.BRANCH_SCHEMA):
                raise CorrectnessError(f"trace {trace_id} branch 0: the Arrow answer's schema is not BRANCH_SCHEMA")
            if arrow.column("token_ids").to_pylist()[0] != body["token_ids"]:
                raise CorrectnessError(f"trace {trace_id} branch 0: token_ids differ between Arrow and JSON")
            arrow_advantages = np.float32(arrow.column("advantages").to_pylist()[0])
            if not np.array_equal(arrow_advantages, np.float32(body["advantages"])):
                raise CorrectnessError(f"trace {trace_id} branch 0: advantages differ between Arrow and JSON")


def run_format(base: str, fmt: str, sizes: dict[str, int], clients: int, seconds: float) -> dict[str, Any]:
    """``clients`` threads fetching random branches in ``fmt`` for ``seconds``: the row's figures."""
    ids = list(sizes)
    headers = {"Accept": ARROW if fmt == "arrow" else "application/json"}
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    nbytes = [0] * clients
    tokens = [0] * clients
    start = threading.Barrier(clients + 1)
    stop_at = [0.0]

    def client(k: int) -> None:
        rng = random.Random(k)
        with httpx.Client(base_url=base, timeout=30, headers=headers) as http:
            http.get("/health")
            start.wait()
            while time.perf_counter() < stop_at[0]:
                trace_id = rng.choice(ids)
                t0 = time.perf_counter()
                try:
                    response = http.get(f"/traces/{trace_id}/branches/0")
                    n = decode(fmt, response.content) if response.status_code == 200 else -1
                except (httpx.HTTPError, ValueError, KeyError):
                    n = -1
                latencies[k].append(time.perf_counter() - t0)
                if n != sizes[trace_id]:
                    errors[k] += 1
                else:
                    tokens[k] += n
                    nbytes[k] += len(response.content)

    threads = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in threads:
        t.start()
    stop_at[0] = time.perf_counter() + seconds
    t0 = time.perf_counter()
    start.wait()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - t0
    lat = np.array([x for xs in latencies for x in xs]) * 1000
    n = len(lat)
    return {
        "format": fmt,
        "requests": n,
        "seconds": round(elapsed, 2),
        "throughput_rps": round(n / elapsed, 1),
        "tokens_per_s": round(sum(tokens) / elapsed),
        "mb_per_s": round(sum(nbytes) / elapsed / 1e6, 1),
        "bytes_per_response": round(sum(nbytes) / max(1, n - sum(errors))),
        "p50_ms": round(float(np.percentile(lat, 50)), 2) if n else None,
        "p99_ms": round(float(np.percentile(lat, 99)), 2) if n else None,
        "errors": sum(errors),
    }


def ratios(rows: list[dict[str, Any]]) -> dict[str, float]:
    by = {r["format"]: r for r in rows}
    return {
        "throughput": round(by["arrow"]["throughput_rps"] / by["json"]["throughput_rps"], 2),
        "p50": round(by["json"]["p50_ms"] / by["arrow"]["p50_ms"], 2),
        "p99": round(by["json"]["p99_ms"] / by["arrow"]["p99_ms"], 2),
    }


def measure(
    workdir: Path, *, traces: int, tokens: int, clients: int, seconds: float, log: Callable[[str], None]
) -> dict[str, Any]:
    """Both servers in turn (warm, cold), each checked, then both formats for ``seconds``."""
    workdir.mkdir(parents=True, exist_ok=True)
    db, sizes = build(workdir, traces, tokens)
    result: dict[str, Any] = {
        "clients": clients,
        "traces": len(sizes),
        "tokens_per_branch": int(np.mean(list(sizes.values()))),
        "seconds": seconds,
    }
    for label, cache_tokens in (("warm", WARM_CACHE_TOKENS), ("cold", 0)):
        log(f"api: the {label} server ({len(sizes)} traces, {clients} clients, {seconds:g} s per format)")
        proc, base = start_server(db, cache_tokens)
        try:
            check(base, sizes)
            rows = [run_format(base, fmt, sizes, clients, seconds) for fmt in ("json", "arrow")]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        result[label] = rows
    result["arrow_vs_json"] = {label: ratios(result[label]) for label in ("warm", "cold")}
    return result


def errors(result: dict[str, Any]) -> int:
    """Requests that failed or gave a wrong-sized branch, over both servers."""
    return sum(r["errors"] for label in ("warm", "cold") for r in result[label])


def run(
    files: WorkloadFiles | None,
    workdir: Path,
    repeat: int,
    *,
    log: Callable[[str], None],
    traces: int,
    tokens: int,
    clients: int,
    seconds: float,
) -> dict[str, Any]:
    """The suite (``python -m benchmarks api``): :func:`measure` on its own workload (``files``
    and ``repeat`` are not used); a request that failed is a :class:`CorrectnessError`."""
    result = measure(workdir, traces=traces, tokens=tokens, clients=clients, seconds=seconds, log=log)
    if failed := errors(result):
        raise CorrectnessError(f"{failed} requests failed or gave a wrong-sized branch")
    return result


def render(result: dict[str, Any]) -> str:
    """The setting, then per server the table of both formats and Arrow's ratios to JSON."""
    lines = [
        f"REST branch lookup: {result['clients']} clients, {result['traces']} traces, ~{result['tokens_per_branch']} "
        f"tokens/branch, {result['seconds']:g} s per row, loopback, {os.cpu_count()} cpus"
    ]
    for label in ("warm", "cold"):
        rows = result[label]
        cache = "views cached (all fit)" if label == "warm" else "view cache off: every request builds its view"
        lines += [
            "",
            f"{label}: {cache}",
            f"{'format':8}{'req/s':>9}{'Mtok/s':>9}{'MB/s':>8}{'KB/resp':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}",
        ]
        for r in rows:
            lines.append(
                f"{r['format']:8}{r['throughput_rps']:>9}{r['tokens_per_s'] / 1e6:>9.2f}{r['mb_per_s']:>8}"
                f"{r['bytes_per_response'] / 1024:>9.0f}{r['p50_ms']:>9}{r['p99_ms']:>9}{r['errors']:>8}"
            )
        q = ratios(rows)
        lines.append(f"arrow vs json: {q['throughput']}x throughput, {q['p50']}x lower p50, {q['p99']}x lower p99")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=FULL["seconds"], help="per row (default 30)")
    parser.add_argument("--quick", action="store_true", help="2 s per row, 8 traces: a smoke run")
    parser.add_argument("--clients", type=int, default=FULL["clients"])
    parser.add_argument("--traces", type=int, default=FULL["traces"])
    parser.add_argument("--tokens", type=int, default=FULL["tokens"], help="tokens per branch")
    parser.add_argument("--workdir", type=Path, default=Path("out/bench"))
    parser.add_argument("--results", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--view-cache-tokens", type=int, default=WARM_CACHE_TOKENS, help=argparse.SUPPRESS)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.view_cache_tokens)
        return 0
    if args.quick:
        args.seconds, args.traces = min(args.seconds, QUICK["seconds"]), min(args.traces, QUICK["traces"])
    result = measure(
        args.workdir,
        traces=args.traces,
        tokens=args.tokens,
        clients=args.clients,
        seconds=args.seconds,
        log=lambda message: print(f"[bench] {message}", file=sys.stderr, flush=True),
    )
    if args.results:
        write_results(result, args.results)
    print(render(result))
    return 0 if errors(result) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
