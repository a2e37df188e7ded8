"""Servers a test starts and stops itself, on loopback only, with bounded waits."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from typing import Any

import httpx
import uvicorn


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def in_thread(app: Any, *, close_backend: bool = True) -> Iterator[str]:
    """``app`` served by uvicorn on a thread of this process; yields its base URL and
    stops it after (closing the app's database unless ``close_backend`` is False)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=20)
        assert not thread.is_alive(), "uvicorn did not stop"
        if close_backend:
            app.state.backend.close()


@contextlib.contextmanager
def in_process(
    command: Sequence[str], port: int, *, env: dict[str, str] | None = None, cwd: Any = None
) -> Iterator[str]:
    """``command`` (a server listening on 127.0.0.1:``port``) as a child process; yields
    its base URL once ``/health`` answers, and terminates it after."""
    proc = subprocess.Popen(
        list(command),
        env={**os.environ, **(env or {})},
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"the server exited ({proc.returncode}): {proc.stdout.read()[-2000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "the server did not answer /health within 60 s"
            time.sleep(0.1)
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=20)
