"""The figures of one followed run of the live benchmark (``benchmarks/live.py``): what the
run recorded (:class:`FollowedRun`) turned into latencies per phase (append -> listed, append
-> ingest began, append -> delivered), the sustained ingest rate and the backlog, the REST
requests, the errors, and the server's RSS against the bytes ingested with fitted slopes."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np

from benchmarks.live_parts import Reader, Sampler, Watcher
from benchmarks.workload import WorkloadFiles
from tracedb.runtime import DEFAULT_MEMORY_LIMIT

MIN_FIT_BYTES = 100_000_000
"""Below this many bytes ingested no slope is fitted (a smoke run's few MB say nothing)."""
WARMUP_SHARE = 0.25
"""The first RSS slope is fitted over the samples past this share of the bytes: the first
ingests load the compiled kernels and fill the fixed-size caches, a cost paid once."""
TAIL_SHARE = 2 / 3
"""The tail slope is fitted past this share of the bytes. DuckDB's buffer pool keeps the
blocks an ingest writes until it reaches the memory limit (1 GiB by default: ~5 GB of
this workload ingested), so RSS rises until then and is flat after; the soak is sized to
go past it, and its tail slope is the steady state a long run keeps."""


@dataclass
class FollowedRun:
    """What one server run produced: the writer's append times, the clients' records,
    the sampler's samples."""

    files: WorkloadFiles
    line_ids: list[list[str]]
    line_bytes: list[int]
    rate_lines: int
    appended: dict[int, float]
    """Source line -> when the write that completed it returned (CLOCK_MONOTONIC)."""
    appended_wall: dict[int, float]
    """The same on the wall clock."""
    phases: dict[str, float]
    written: dict[str, Any]
    """The writer's last record: bytes and seconds per phase."""
    watcher: Watcher
    readers: list[Reader]
    sampler: Sampler
    server_cpu_seconds: float
    drained_after_writer_s: float
    correctness: dict[str, Any]

    @property
    def expected(self) -> list[str]:
        return [t for ids in self.line_ids for t in ids]


def _latency(seconds: list[float]) -> dict[str, Any]:
    def ms(q: float) -> float | None:
        return round(float(np.percentile(seconds, q)) * 1000, 1) if seconds else None

    return {"n": len(seconds), "p50_ms": ms(50), "p99_ms": ms(99), "max_ms": ms(100)}


def _slope(samples: list[dict[str, Any]], low: float, high: float) -> tuple[float | None, float | None]:
    """MB of RSS per GB ingested, least squares over the samples with bytes in [low, high],
    and its standard error (None, None with fewer than 4 distinct byte counts)."""
    kept = [s for s in samples if s["bytes"] is not None and low <= s["bytes"] <= high]
    xs = [s["bytes"] / 1e9 for s in kept]
    if len(set(xs)) < 4 or high < MIN_FIT_BYTES:
        return None, None
    (slope, _), cov = np.polyfit(xs, [s["rss"] / 1e6 for s in kept], 1, cov=True)
    return round(float(slope), 1), round(float(np.sqrt(cov[0, 0])), 1)


def _slopes(name: str, fit: tuple[float | None, float | None]) -> dict[str, float | None]:
    return {f"{name}_MB_per_GB": fit[0], f"{name}_stderr": fit[1]}


def _rss_at(samples: list[dict[str, Any]], at: float) -> float:
    """RSS (MB) at the first sample with at least ``at`` bytes ingested."""
    return round(next(s["rss"] for s in samples if (s["bytes"] or 0) >= at) / 1e6, 1)


def memory(samples: list[dict[str, Any]], total: int, memory_limit: str | None) -> dict[str, Any]:
    """The server's RSS over the run and its slope over the bytes ingested (fitted while
    ingest went on: up to the first sample that had every byte)."""
    ingesting = []
    for s in samples:
        ingesting.append(s)
        if s["bytes"] is not None and s["bytes"] >= total:
            break
    start, warm = samples[0], WARMUP_SHARE * total
    return {
        "memory_limit": memory_limit or f"default ({DEFAULT_MEMORY_LIMIT})",
        "ingested_GB": round(total / 1e9, 3),
        "rss_idle_MB": round(start["rss"] / 1e6, 1),
        "rss_at_warmup_MB": _rss_at(ingesting, warm),
        "rss_when_ingested_MB": round(ingesting[-1]["rss"] / 1e6, 1),
        "rss_end_MB": round(samples[-1]["rss"] / 1e6, 1),
        "peak_MB": round(max(s["hwm"] for s in samples) / 1e6, 1),
        **_slopes("slope", _slope(ingesting, warm, total)),
        **_slopes("slope_second_half", _slope(ingesting, total / 2, total)),
        **_slopes("slope_tail", _slope(ingesting, TAIL_SHARE * total, total)),
        "rss_at_tail_start_MB": _rss_at(ingesting, TAIL_SHARE * total),
        "samples": len(samples),
        "series": [
            {"t": round(s["t"] - start["t"], 2), "rss_MB": round(s["rss"] / 1e6, 1)}
            | {"GB": round((s["bytes"] or 0) / 1e9, 4)}
            | ({"behind": True} if s["behind"] else {})
            for s in samples
        ],
    }  # fmt: skip


def _max_backlog(samples: list[dict[str, Any]], appended: dict[int, float], line_bytes: list[int]) -> int:
    """The most bytes of whole lines on disk and not yet ingested, over ``samples``."""
    times = np.array([appended[j] for j in range(len(line_bytes))])
    order = np.argsort(times, kind="stable")
    on_disk = np.concatenate([[0], np.cumsum(np.array(line_bytes)[order])])
    at = np.searchsorted(times[order], [s["t"] for s in samples], side="right")
    return int(max((on_disk[k] - (s["bytes"] or 0) for k, s in zip(at, samples)), default=0))


def _until_ingest(
    run: FollowedRun, phase_of: dict[str, str], trace_line: dict[str, int], phases: list[str]
) -> dict[str, Any] | None:
    """Append -> the start of the transaction that ingested the trace (its ``ingested_at``,
    DuckDB's ``current_timestamp``, read as UTC): the part of the visibility latency spent
    before the follower's poll began; the rest is parsing, writing, committing and the
    long-poll's answer. None when the clocks do not agree (the database's time zone is
    not UTC)."""
    out = {}
    for phase in phases:
        gaps = []
        for t, seen in run.watcher.log.seen.items():
            if phase_of.get(t) == phase and seen.ingested_at:
                began = datetime.fromisoformat(seen.ingested_at).replace(tzinfo=UTC).timestamp()
                gaps.append(began - run.appended_wall[trace_line[t]])
        out[phase] = _latency(gaps)
        if gaps and not -1.0 < float(np.median(gaps)) < 600:
            return None
    return out


def figures(run: FollowedRun, memory_limit: str | None) -> dict[str, Any]:
    """The figures of one followed run."""
    trace_line = {t: j for j, ids in enumerate(run.line_ids) for t in ids}
    phase_of = {t: "rate" if j < run.rate_lines else "fast" for t, j in trace_line.items()}
    append_at = {t: run.appended[j] for t, j in trace_line.items()}
    phases = [p for p in ("rate", "fast") if any(v == p for v in phase_of.values())]

    def latencies(when: Callable[[Any, str], float | None], clients: list[Any]) -> dict[str, Any]:
        return {
            phase: _latency(
                [
                    when(c, t) - append_at[t]  # type: ignore[operator]
                    for c in clients
                    for t in run.expected
                    if phase_of[t] == phase and when(c, t) is not None
                ]
            )
            for phase in phases
        }

    out: dict[str, Any] = {
        "workload": {k: run.files.manifest[k] for k in ("traces", "nodes", "tokens", "bytes")},
        "visibility": latencies(lambda c, t: c.log.seen[t].listed_at, [run.watcher]),
        "until_ingest_began": _until_ingest(run, phase_of, trace_line, phases),
    }
    if run.readers:
        out["delivered"] = latencies(lambda c, t: c.log.seen[t].fetched_at, run.readers)
    w = run.written
    ingest: dict[str, Any] = {}
    if run.rate_lines:
        ingest["rate_phase"] = {
            "traces": run.rate_lines,
            "episodes_per_s": round(w["rate"]["lines"] / max(w["rate"]["seconds"], 1e-9), 2),
            "MB_per_s_offered": round(w["rate"]["bytes"] / 1e6 / max(w["rate"]["seconds"], 1e-9), 2),
            "seconds": round(w["rate"]["seconds"], 1),
        }
    fast = [t for t in run.expected if phase_of[t] == "fast"]
    if fast:
        visible_end = max(run.watcher.log.seen[t].listed_at for t in fast)
        span = visible_end - run.phases["fast"]
        in_fast = [s for s in run.sampler.samples if run.phases["fast"] <= s["t"] <= visible_end]
        ingest["fast_phase"] = {
            "traces": len(fast),
            "MB": round(w["fast"]["bytes"] / 1e6, 1),
            "writer_seconds": round(w["fast"]["seconds"], 2),
            "writer_MB_per_s": round(w["fast"]["bytes"] / 1e6 / max(w["fast"]["seconds"], 1e-9), 1),
            "seconds_until_all_visible": round(span, 2),
            "traces_per_s": round(len(fast) / span, 1),
            "MB_per_s": round(w["fast"]["bytes"] / 1e6 / span, 1),
            "health_samples": len(in_fast),
            "samples_behind": sum(bool(s["behind"]) for s in in_fast),
            "max_backlog_MB": round(_max_backlog(in_fast, run.appended, run.line_bytes) / 1e6, 1),
        }
    out["ingest"] = ingest
    clients = [run.watcher, *run.readers]
    out["requests"] = {
        "branch_fetch": _latency([x for c in run.readers for x in c.log.fetch_seconds]),
        "listing_answered_at_once": _latency([x for c in clients for x in c.log.poll_seconds]),
        "total": sum(c.log.requests for c in clients),
        "MB_received": round(sum(c.log.bytes for c in clients) / 1e6, 1),
    }
    last = run.sampler.samples[-1] if run.sampler.samples else {}
    errors = {
        "requests": sum(c.log.errors for c in clients),
        "request_messages": [m for c in clients for m in c.log.error_messages][:10],
        "sampler": run.sampler.errors[:10],
        "follower_errors": last.get("errors") or 0,
        "follower_rejected": last.get("rejected") or 0,
    }
    errors["total"] = errors["requests"] + len(run.sampler.errors) + errors["follower_errors"]
    out["errors"] = errors
    out["memory"] = memory(run.sampler.samples, sum(run.line_bytes), memory_limit)
    out["correctness"] = run.correctness
    out["server_cpu_seconds"] = round(run.server_cpu_seconds, 1)
    out["clients_done_after_writer_s"] = round(run.drained_after_writer_s, 1)
    return out
