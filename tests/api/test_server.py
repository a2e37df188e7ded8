"""A real uvicorn server on loopback, hit over HTTP by several clients at once, with
writes in flight: readers are never stalled by a write beyond its own transaction."""

from __future__ import annotations

import io
import os
import random
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pyarrow.ipc as ipc
import pytest
import uvicorn

import tracedb
from tracedb.api import create_app
from tracedb.synthetic import write_sample

from support import FIXTURES

TOKEN = "server-token"
ARROW = "application/vnd.apache.arrow.stream"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, object]]:
    path = tmp_path_factory.mktemp("server") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
    app = create_app(path, token=TOKEN)
    port = free_port()
    config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not srv.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}", app
    srv.should_exit = True
    thread.join(timeout=20)
    assert not thread.is_alive()
    app.state.backend.close()


def test_real_server_serves_json_and_arrow(server) -> None:
    base, app = server
    with httpx.Client(base_url=base, timeout=30) as http:
        assert http.get("/health").json()["status"] == "ok"
        first = http.get("/traces", params={"limit": 1}).json()["traces"][0]["trace_id"]
        body = http.get(f"/traces/{first}/branches/0").json()
        arrow = ipc.open_stream(io.BytesIO(http.get(f"/traces/{first}/branches/0", headers={"Accept": ARROW}).content))
        table = arrow.read_all()
        assert table.schema.equals(tracedb.BRANCH_SCHEMA)
        assert table.column("token_ids").to_pylist()[0] == body["token_ids"]
        assert http.get("/traces/nope").status_code == 404
        assert http.get("/").status_code == 200 and "<table" in http.get("/").text
        assert http.get("/openapi.json").json()["info"]["title"] == "tracedb"


def test_many_concurrent_readers(server) -> None:
    base, _ = server
    with httpx.Client(base_url=base, timeout=30) as http:
        rows = http.get("/traces", params={"limit": 1000}).json()["traces"]
        urls = [f"/traces/{r['trace_id']}/branches/{b}" for r in rows for b in range(r["n_branches"])]
        expected = {u: http.get(u).content for u in urls}

    def fetch(seed: int) -> int:
        order = random.Random(seed).sample(urls, min(30, len(urls)))
        with httpx.Client(base_url=base, timeout=30) as c:
            return sum(c.get(url).content == expected[url] for url in order)

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(fetch, range(8))) == [min(30, len(urls))] * 8


def test_an_open_write_transaction_does_not_block_readers(server) -> None:
    base, app = server
    backend = app.state.backend
    with httpx.Client(base_url=base, timeout=10) as http:
        trace_id = http.get("/traces", params={"limit": 1}).json()["traces"][0]["trace_id"]
        before = http.get(f"/traces/{trace_id}").json()
        with backend.writer() as db:  # hold the write lock with an uncommitted change
            db.con.execute("BEGIN TRANSACTION")
            db.con.execute("UPDATE traces SET reward = 123.0 WHERE trace_id = ?", [trace_id])
            started = time.perf_counter()
            during = http.get(f"/traces/{trace_id}").json()  # readers see the last commit, at once
            assert time.perf_counter() - started < 5
            assert during["reward"] == before["reward"]
            db.con.execute("ROLLBACK")


def test_reads_go_on_while_an_ingest_runs(server, tmp_path: Path) -> None:
    base, _ = server
    sample = write_sample(tmp_path / "traces.jsonl", groups=8, group_size=8, tokens_per_trace=20_000, seed=11)
    with httpx.Client(base_url=base, timeout=60) as http:
        trace_id = http.get("/traces", params={"limit": 1}).json()["traces"][0]["trace_id"]
        known = http.get("/health").json()["traces"]
        # The first view of a process loads the compiled kernels (~0.4 s): done before the
        # window opens, so that the window measures concurrency, not the first call.
        assert http.get(f"/traces/{trace_id}/branches/0", headers={"Accept": ARROW}).status_code == 200
    window: dict[str, float] = {}
    done: list[float] = []
    failures: list[int] = []

    def ingest() -> None:
        with httpx.Client(base_url=base, timeout=120) as c:
            window["start"] = time.perf_counter()
            response = c.post("/ingest", content=sample.read_bytes(), headers={"Authorization": f"Bearer {TOKEN}"})
            window["end"] = time.perf_counter()
            assert response.status_code == 200 and response.json()["traces"] == 64

    def read(stop: threading.Event) -> None:
        with httpx.Client(base_url=base, timeout=60) as c:
            while not stop.is_set():
                response = c.get(f"/traces/{trace_id}/branches/0", headers={"Accept": ARROW})
                if response.status_code != 200:
                    failures.append(response.status_code)
                done.append(time.perf_counter())

    stop = threading.Event()
    readers = [threading.Thread(target=read, args=(stop,)) for _ in range(4)]
    for r in readers:
        r.start()
    writer = threading.Thread(target=ingest)
    writer.start()
    writer.join()
    stop.set()
    for r in readers:
        r.join()
    assert not failures
    during = [t for t in done if window["start"] < t < window["end"]]
    assert len(during) >= 3, f"{len(during)} reads finished during a {window['end'] - window['start']:.2f}s ingest"
    with httpx.Client(base_url=base, timeout=30) as http:
        assert http.get("/health").json()["traces"] == known + 64


def test_tracedb_serve_command(tmp_path: Path) -> None:
    """`tracedb serve` starts uvicorn on loopback with the app."""
    db = tmp_path / "runs.duckdb"
    with tracedb.connect(db) as database:
        database.ingest(FIXTURES)
    port = free_port()
    command = [
        sys.executable,
        "-c",
        "from tracedb.cli.main import app; app()",
        "serve",
        "--db",
        str(db),
        "--port",
        str(port),
    ]
    proc = subprocess.Popen(command, env={**os.environ, "TRACEDB_TOKEN": TOKEN})
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                health = httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).json()
                break
            except httpx.HTTPError:
                assert time.monotonic() < deadline and proc.poll() is None, "tracedb serve did not start"
                time.sleep(0.1)
        assert health["traces"] == 44 and health["writes_enabled"] is True and health["sql_enabled"] is False
    finally:
        proc.terminate()
        proc.wait(timeout=30)
