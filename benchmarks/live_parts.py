"""The moving parts of the live benchmark (``benchmarks/live.py``): the writer process,
the REST readers, the watcher and the server's sampler.

- **Writer** (:func:`write_run`, run as ``python -m benchmarks.live_parts --write SPEC``):
  appends the workload's lines to the run directory, first at a fixed mean rate (Poisson
  arrivals, as episodes finish at random moments; each line in one to three pieces, so
  the follower sometimes finds half a line), then as fast as it can in randomly sized
  chunks that cut lines anywhere, into a second file that appears in a subdirectory.
  After every write it prints, on stdout, the source lines the write
  completed and ``time.monotonic()`` (CLOCK_MONOTONIC, the same clock in every process
  of the machine), so append times are comparable with the readers', and the wall
  clock (for the database's ``ingested_at``).
- **Reader** (:class:`Reader`): polls ``GET /traces?after=W&wait=S`` and fetches each new
  trace's branches (``GET /traces/{id}/branches/{i}``, Arrow or JSON), keeping a digest
  of each branch and every request's latency; any non-2xx answer or exception is an error.
- **Watcher** (:class:`Watcher`): only long-polls the listing: the time it first sees a
  trace is when the trace became visible over REST (the readers' own listing times are
  later whenever they are busy fetching).
- **Sampler** (:class:`Sampler`): the server's RSS (``/proc/PID/status``) and its
  follower's status (``/health``) every ``period`` seconds.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import mmap
import os
import random
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import orjson
import pyarrow as pa
import pyarrow.ipc as ipc

ARROW = "application/vnd.apache.arrow.stream"
COLUMNS = ["token_ids", "sampled_mask", "logprobs", "advantages"]
DTYPES = {"token_ids": np.int64, "sampled_mask": np.bool_, "logprobs": np.float32, "advantages": np.float32}
"""The dtypes a branch's arrays are compared in (both sides are cast to them)."""


# ------------------------------------------------------------------ digests


def branch_digest(arrays: dict[str, Any]) -> str:
    """A digest of one branch's arrays (``None`` for a null column), cast to :data:`DTYPES`."""
    h = hashlib.blake2b(digest_size=16)
    for name in COLUMNS:
        values = arrays[name]
        if values is None:
            h.update(f"{name}:null;".encode())
            continue
        data = np.ascontiguousarray(np.asarray(values, DTYPES[name]))
        h.update(f"{name}:{len(data)};".encode())
        h.update(data.tobytes())
    return h.hexdigest()


def table_digests(table: pa.Table) -> dict[tuple[str, int], str]:
    """:func:`branch_digest` of every row of a branch view (``db.branches`` or the branch
    route's Arrow answer), by (trace id, branch index)."""
    flat = {}
    for name in COLUMNS:
        arr = table[name].combine_chunks()
        flat[name] = (
            arr.offsets.to_numpy(),
            arr.values.to_numpy(zero_copy_only=False),
            arr.is_valid().to_numpy(zero_copy_only=False),
        )
    out = {}
    for i, (trace_id, index) in enumerate(zip(table["trace_id"].to_pylist(), table["branch_index"].to_pylist())):
        arrays = {
            name: values[offsets[i] : offsets[i + 1]] if valid[i] else None
            for name, (offsets, values, valid) in flat.items()
        }
        out[(trace_id, index)] = branch_digest(arrays)
    return out


# ------------------------------------------------------------------ the writer


@dataclass(frozen=True)
class WriterSpec:
    """What the writer appends: ``source``'s first ``rate_lines`` lines to ``first`` at
    ``rate`` lines/s on average (exponential gaps), then (after ``gap`` s) the rest to ``second`` as fast as it can, in
    chunks of ``min_chunk`` to ``max_chunk`` bytes (log-uniform)."""

    source: str
    first: str
    second: str
    rate: float
    rate_lines: int
    seed: int = 0
    gap: float = 3.0
    """Seconds between the phases."""
    min_chunk: int = 16 << 10
    max_chunk: int = 8 << 20


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(record) + "\n")
    sys.stdout.flush()


def _line_ends(data: mmap.mmap, step: int = 64 << 20) -> np.ndarray:
    """The end offset of every line (one past its newline), read in ``step``-byte slices."""
    parts = []
    for start in range(0, len(data), step):
        chunk = np.frombuffer(data, np.uint8, count=min(step, len(data) - start), offset=start)
        parts.append(np.flatnonzero(chunk == ord("\n")) + (start + 1))
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def write_run(spec: WriterSpec) -> None:
    """Append as :class:`WriterSpec` says; stdout gets ``{"lines": [j, ...], "t": ...}``
    per write that completed source lines ``j`` (0-based), ``{"phase": name, "t": ...}``
    when a phase starts and ``{"done": true, ...}`` with the bytes written per phase."""
    rng = random.Random(spec.seed)
    with open(spec.source, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        ends = _line_ends(data)
        Path(spec.second).parent.mkdir(parents=True, exist_ok=True)
        _emit({"ready": True, "lines": len(ends), "t": time.monotonic()})
        sys.stdin.readline()  # the harness says go
        source = memoryview(data)
        try:
            _write_phases(spec, source, ends, rng)
        finally:
            source.release()


def _write_phases(spec: WriterSpec, data: memoryview, ends: np.ndarray, rng: random.Random) -> None:
    rate_lines = min(spec.rate_lines, len(ends))
    fd = os.open(spec.first, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    start = time.monotonic()
    _emit({"phase": "rate", "t": start})
    begin, due = 0, start
    for j in range(rate_lines):
        due += rng.expovariate(spec.rate)  # Poisson arrivals: no fixed phase against the follower's polls
        delay = due - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        end = int(ends[j])
        pieces = rng.choice((1, 1, 2, 3))
        cuts = sorted(rng.sample(range(begin + 1, end), pieces - 1)) if end - begin > pieces else []
        for a, b in zip([begin, *cuts], [*cuts, end]):
            _write_all(fd, data[a:b])
            if b != end:
                time.sleep(rng.uniform(0.0, 0.05))  # half a line on disk for a moment
        _emit({"lines": [j], "t": time.monotonic(), "wall": time.time()})
        begin = end
    os.close(fd)
    rate_end = time.monotonic()
    if rate_lines and rate_lines < len(ends):
        time.sleep(spec.gap)  # the rate phase's last lines are not measured behind the fast phase's backlog

    fd = os.open(spec.second, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    fast_start = time.monotonic()
    _emit({"phase": "fast", "t": fast_start})
    j, pos = rate_lines, begin
    log_min, log_max = np.log(spec.min_chunk), np.log(spec.max_chunk)
    while pos < len(data):
        stop = min(len(data), pos + int(np.exp(rng.uniform(log_min, log_max))))
        _write_all(fd, data[pos:stop])
        done = []
        while j < len(ends) and ends[j] <= stop:
            done.append(j)
            j += 1
        if done:
            _emit({"lines": done, "t": time.monotonic(), "wall": time.time()})
        pos = stop
    os.close(fd)
    fast_end = time.monotonic()
    _emit(
        {
            "done": True,
            "rate": {"bytes": begin, "seconds": rate_end - start, "lines": rate_lines},
            "fast": {"bytes": len(data) - begin, "seconds": fast_end - fast_start, "lines": len(ends) - rate_lines},
            "t": fast_end,
        }
    )


# ------------------------------------------------------------------ REST clients


@dataclass
class Seen:
    """What one client got of one trace."""

    listed_at: float
    seq: int
    n_branches: int
    ingested_at: str | None = None
    """The trace's ``ingested_at`` (its ingest transaction's start, UTC) as listed."""
    fetched_at: float | None = None
    digests: dict[int, str] = field(default_factory=dict)


@dataclass
class ClientLog:
    """One client's record: traces seen (and how often), request latencies, errors."""

    seen: dict[str, Seen] = field(default_factory=dict)
    repeats: dict[str, int] = field(default_factory=dict)
    fetch_seconds: list[float] = field(default_factory=list)
    poll_seconds: list[float] = field(default_factory=list)
    """Listing requests that answered with traces at once (a long-poll that waited is
    not a latency)."""
    errors: int = 0
    error_messages: list[str] = field(default_factory=list)
    order_problems: list[str] = field(default_factory=list)
    requests: int = 0
    bytes: int = 0

    def error(self, message: str) -> None:
        self.errors += 1
        if len(self.error_messages) < 10:
            self.error_messages.append(message)


class _Client(threading.Thread):
    """A thread that pages through ``GET /traces?after=&wait=`` until ``expected`` traces
    were listed or ``stop`` is set; :meth:`handle` gets each page's new rows."""

    WAIT_S = 2.0
    RETRIES = 3

    def __init__(self, name: str, base: str, expected: int, stop: threading.Event) -> None:
        super().__init__(name=name, daemon=True)
        self.base, self.expected, self.stop = base, expected, stop
        self.log = ClientLog()
        self.watermark = 0

    def _get(self, http: httpx.Client, path: str, **kw: Any) -> httpx.Response | None:
        """One request, retried after an error (each failed try counts as an error)."""
        for _ in range(self.RETRIES):
            self.log.requests += 1
            try:
                response = http.get(path, **kw)
            except httpx.HTTPError as e:
                self.log.error(f"{path}: {type(e).__name__}: {e}")
                continue
            if response.is_success:
                self.log.bytes += len(response.content)
                return response
            self.log.error(f"{path}: HTTP {response.status_code} {response.text[:200]}")
        return None

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=60) as http:
            while not self.stop.is_set() and len(self.log.seen) < self.expected:
                t0 = time.monotonic()
                response = self._get(http, "/traces", params={"after": self.watermark, "wait": self.WAIT_S})
                now = time.monotonic()
                if response is None:
                    self.stop.wait(0.5)
                    continue
                try:
                    body = orjson.loads(response.content)
                    rows, mark = body["traces"], int(body["watermark"])
                    header = int(response.headers["X-Tracedb-Watermark"])
                except (ValueError, KeyError, TypeError) as e:
                    self.log.error(f"/traces: unreadable answer: {type(e).__name__}: {e}")
                    continue
                if header != mark:
                    self.log.order_problems.append(f"header watermark {header} != body {mark}")
                if rows and now - t0 < self.WAIT_S / 2:
                    self.log.poll_seconds.append(now - t0)
                self._check_order(rows, mark)
                self.watermark = max(self.watermark, mark)
                fresh = []
                for row in rows:
                    trace_id = row["trace_id"]
                    if trace_id in self.log.seen:
                        self.log.repeats[trace_id] = self.log.repeats.get(trace_id, 1) + 1
                        continue
                    self.log.seen[trace_id] = Seen(now, int(row["seq"]), int(row["n_branches"]), row["ingested_at"])
                    fresh.append(trace_id)
                self.handle(http, fresh)

    def _check_order(self, rows: list[dict[str, Any]], mark: int) -> None:
        seqs = [int(r["seq"]) for r in rows]
        if seqs and (seqs[0] <= self.watermark or seqs != sorted(seqs) or seqs[-1] > mark):
            self.log.order_problems.append(f"after={self.watermark}: seqs {seqs[:3]}..{seqs[-1:]} watermark {mark}")
        elif mark < self.watermark:
            self.log.order_problems.append(f"watermark went back from {self.watermark} to {mark}")

    def handle(self, http: httpx.Client, trace_ids: list[str]) -> None:
        """Called with each page's traces not seen before."""


class Watcher(_Client):
    """Lists only: the first time a trace is listed is when it became visible over REST."""


class Reader(_Client):
    """Lists, and fetches every branch of each new trace (``fmt`` ``arrow`` or ``json``)."""

    def __init__(self, name: str, base: str, expected: int, stop: threading.Event, fmt: str) -> None:
        super().__init__(name, base, expected, stop)
        self.fmt = fmt

    def handle(self, http: httpx.Client, trace_ids: list[str]) -> None:
        headers = {"Accept": ARROW if self.fmt == "arrow" else "application/json"}
        params = [("fields", c) for c in COLUMNS]
        for trace_id in trace_ids:
            seen = self.log.seen[trace_id]
            for index in range(seen.n_branches):
                t0 = time.monotonic()
                response = self._get(http, f"/traces/{trace_id}/branches/{index}", params=params, headers=headers)
                if response is None:
                    continue
                try:
                    seen.digests[index] = self._digest(response.content, trace_id, index)
                except (ValueError, KeyError, TypeError, pa.ArrowException) as e:
                    self.log.error(f"{trace_id}/{index}: unreadable answer: {type(e).__name__}: {e}")
                    continue
                self.log.fetch_seconds.append(time.monotonic() - t0)
            seen.fetched_at = time.monotonic()

    def _digest(self, content: bytes, trace_id: str, index: int) -> str:
        if self.fmt == "arrow":
            with ipc.open_stream(io.BytesIO(content)) as stream:
                table = stream.read_all()
            digests = table_digests(table)
            if list(digests) != [(trace_id, index)]:
                raise ValueError(f"asked for {trace_id}/{index}, the answer holds {list(digests)}")
            return digests[(trace_id, index)]
        body = orjson.loads(content)
        return branch_digest({name: body[name] for name in COLUMNS})


# ------------------------------------------------------------------ the server's memory


def rss_bytes(pid: int) -> tuple[int, int]:
    """``VmRSS`` and ``VmHWM`` (peak) of process ``pid``, in bytes."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) * 1024
    return values["VmRSS"], values["VmHWM"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far (``/proc/PID/stat``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Sampler(threading.Thread):
    """Every ``period`` s: the server's RSS and its follower's status from ``/health``."""

    def __init__(self, base: str, pid: int, stop: threading.Event, period: float) -> None:
        super().__init__(name="sampler", daemon=True)
        self.base, self.pid, self.stop, self.period = base, pid, stop, period
        self.samples: list[dict[str, Any]] = []
        self.errors: list[str] = []

    def sample(self, http: httpx.Client) -> None:
        try:
            health = http.get("/health")
            rss, hwm = rss_bytes(self.pid)
        except (httpx.HTTPError, OSError) as e:
            self.errors.append(f"{type(e).__name__}: {e}")
            return
        if not health.is_success:
            self.errors.append(f"/health: HTTP {health.status_code}")
            return
        follower = health.json()["follower"] or {}
        self.samples.append(
            {
                "t": time.monotonic(),
                "rss": rss,
                "hwm": hwm,
                "bytes": follower.get("bytes"),
                "traces": follower.get("traces"),
                "watermark": follower.get("watermark"),
                "behind": follower.get("behind"),
                "state": follower.get("state"),
                "errors": follower.get("errors"),
                "rejected": follower.get("rejected"),
            }
        )

    def run(self) -> None:
        with httpx.Client(base_url=self.base, timeout=30) as http:
            while not self.stop.is_set():
                began = time.monotonic()
                self.sample(http)
                self.stop.wait(max(0.0, self.period - (time.monotonic() - began)))
            self.sample(http)


def read_writer(stream: io.TextIOBase) -> Iterator[dict[str, Any]]:
    """The writer's records, one JSON object a line, until it closes stdout."""
    for line in stream:
        if line.strip():
            yield json.loads(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="the live benchmark's writer process")
    parser.add_argument("--write", required=True, help="the WriterSpec as JSON")
    args = parser.parse_args(argv)
    write_run(WriterSpec(**json.loads(args.write)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
