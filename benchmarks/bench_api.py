"""REST branch lookup over loopback: JSON vs Arrow IPC, 8 concurrent clients.

    python -m benchmarks.bench_api              # 30 s per row: {warm, cold} x {json, arrow}
    python -m benchmarks.bench_api --quick      # 2 s per row, 8 traces: a smoke run

The workload is ``tracedb.synthetic`` rollouts of ~32k tokens each with no compaction, so
every trace is one 32k-token branch. The server is ``uvicorn`` running ``api.create_app``
in a subprocess on 127.0.0.1; the clients are ``--clients`` threads in this process,
each with its own keep-alive ``httpx.Client``, fetching random branches for
``--seconds`` per format. Two servers run in turn: *warm*, as configured by default (the
view cache holds every branch of the workload, so a request costs HTTP and encoding),
and *cold*, with the view cache off (every request builds its view from DuckDB). A
request counts when the client holds usable arrays: JSON is
parsed (orjson) and Arrow read into a table, so the figures are what a trainer pays.
Any non-200 answer or wrong-sized branch is an error (there must be none).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pyarrow.ipc as ipc

ARROW = "application/vnd.apache.arrow.stream"


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
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen(
        [sys.executable, "-m", "benchmarks.bench_api", "--serve", str(db), "--port", str(port)]
        + ["--view-cache-tokens", str(cache_tokens)],
        cwd=root,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(base + "/health", timeout=1).status_code == 200:
                return proc, base
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            proc.kill()
            raise RuntimeError("the API server did not start")
        time.sleep(0.1)


def decode(fmt: str, content: bytes) -> int:
    """Usable arrays from a response; returns the branch's token count."""
    if fmt == "arrow":
        table = ipc.open_stream(io.BytesIO(content)).read_all()
        return len(table.column("token_ids").chunk(0).values)
    body = orjson.loads(content)
    return len(np.asarray(body["token_ids"], np.int32))


def check(base: str, sizes: dict[str, int]) -> None:
    """Before timing: both formats give the library's view of a few branches."""
    import tracedb

    with httpx.Client(base_url=base, timeout=30) as http:
        for trace_id in list(sizes)[:3]:
            arrow = ipc.open_stream(
                io.BytesIO(http.get(f"/traces/{trace_id}/branches/0", headers={"Accept": ARROW}).content)
            ).read_all()
            body = orjson.loads(http.get(f"/traces/{trace_id}/branches/0").content)
            assert arrow.schema.equals(tracedb.BRANCH_SCHEMA)
            assert arrow.column("token_ids").to_pylist()[0] == body["token_ids"]
            assert np.array_equal(np.float32(arrow.column("advantages").to_pylist()[0]), np.float32(body["advantages"]))


def run(base: str, fmt: str, sizes: dict[str, int], clients: int, seconds: float) -> dict[str, Any]:
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


def show(label: str, rows: list[dict[str, Any]]) -> None:
    cache = "views cached (all fit)" if label == "warm" else "view cache off: every request builds its view"
    print(f"\n{label}: {cache}")
    print(f"{'format':8}{'req/s':>9}{'Mtok/s':>9}{'MB/s':>8}{'KB/resp':>9}{'p50 ms':>9}{'p99 ms':>9}{'errors':>8}")
    for r in rows:
        print(
            f"{r['format']:8}{r['throughput_rps']:>9}{r['tokens_per_s'] / 1e6:>9.2f}{r['mb_per_s']:>8}"
            f"{r['bytes_per_response'] / 1024:>9.0f}{r['p50_ms']:>9}{r['p99_ms']:>9}{r['errors']:>8}"
        )
    q = ratios(rows)
    print(f"arrow vs json: {q['throughput']}x throughput, {q['p50']}x lower p50, {q['p99']}x lower p99")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=30.0, help="per row (default 30)")
    parser.add_argument("--quick", action="store_true", help="2 s per row, 8 traces: a smoke run")
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--traces", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=32_768, help="tokens per branch")
    parser.add_argument("--workdir", type=Path, default=Path("out/bench"))
    parser.add_argument("--results", type=Path, default=None, help="write the figures as JSON here")
    parser.add_argument("--view-cache-tokens", type=int, default=8_000_000, help=argparse.SUPPRESS)
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.serve:
        serve(args.serve, args.port, args.view_cache_tokens)
        return 0
    if args.quick:
        args.seconds, args.traces = min(args.seconds, 2.0), min(args.traces, 8)
    args.workdir.mkdir(parents=True, exist_ok=True)
    db, sizes = build(args.workdir, args.traces, args.tokens)
    result: dict[str, Any] = {
        "clients": args.clients,
        "traces": len(sizes),
        "tokens_per_branch": int(np.mean(list(sizes.values()))),
        "seconds": args.seconds,
    }
    print(
        f"REST branch lookup: {args.clients} clients, {len(sizes)} traces, ~{result['tokens_per_branch']} "
        f"tokens/branch, {args.seconds:g} s per row, loopback, {os.cpu_count()} cpus"
    )
    for label, cache_tokens in (("warm", 8_000_000), ("cold", 0)):
        proc, base = start_server(db, cache_tokens)
        try:
            check(base, sizes)
            rows = [run(base, fmt, sizes, args.clients, args.seconds) for fmt in ("json", "arrow")]
        finally:
            proc.terminate()
            proc.wait(timeout=30)
        result[label] = rows
        show(label, rows)
    result["arrow_vs_json"] = {label: ratios(result[label]) for label in ("warm", "cold")}
    if args.results:
        args.results.write_text(json.dumps(result, indent=2) + "\n")
    return 0 if all(r["errors"] == 0 for label in ("warm", "cold") for r in result[label]) else 1


if __name__ == "__main__":
    sys.exit(main())
