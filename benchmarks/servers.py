"""A server the benchmark starts in a subprocess on loopback: a free port, and the wait
until it answers ``GET /health`` (the live suite's ``tracedb serve --follow``, the REST
benchmark's uvicorn)."""

from __future__ import annotations

import socket
import subprocess
import time

import httpx


def free_port() -> int:
    """A TCP port free on 127.0.0.1 (the kernel's choice)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def healthy(proc: subprocess.Popen, base: str, *, seconds: float, timeout: float, pause: float) -> bool:
    """Whether ``base/health`` answered 200 within ``seconds`` (each request waiting at most
    ``timeout``, ``pause`` between tries) while ``proc`` ran; False once it exits or the time
    is up (the caller stops it and says why)."""
    deadline = time.monotonic() + seconds
    while True:
        try:
            if httpx.get(base + "/health", timeout=timeout).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            return False
        time.sleep(pause)
