"""The scanner reads one chunk ahead on another thread (``IngestRun.read``), into the
other of two sets of buffers, or on the ingest's own thread (``scan_ahead``): whatever the
chunking, the rows, their order (sequence numbers, line numbers), the rejects and the
lines before a damaged part are what the parser alone stores; ``auto`` scans ahead unless
the process is pinned to one CPU."""

from __future__ import annotations

import json

import pytest
import zstandard

import tracedb
from tracedb import runtime
from tracedb.ingest import run

from support import FIXTURES
from support.faults import contents

RUNS = ["linear", "groups", "forest", "compaction", "subagent_fork", "partial_credit", "empty_tokens"]


def _lines() -> list[bytes]:
    out = []
    for name in RUNS:
        out += [line for line in (FIXTURES / f"{name}.traces.jsonl").read_bytes().splitlines() if line.strip()]
    return out


def _ingest(path, scanner: str, **knobs):
    with runtime.configure(scanner=scanner, **knobs), tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        order = db.sql("SELECT trace_id, seq, line FROM traces ORDER BY seq").to_pylist()
        return report, order, contents(db)


@pytest.mark.parametrize("ahead", ["always", "never"])
@pytest.mark.parametrize("chunk_bytes", [1, 3000, 1 << 20], ids=["chunk-per-line", "few-lines", "one-chunk"])
def test_scanning_ahead_stores_what_the_parser_stores(tmp_path, chunk_bytes, ahead):
    lines = _lines()
    bad = json.loads(lines[3])
    bad["traces"][0]["nodes"][0]["token_ids"] = "not a list"
    lines.insert(4, json.dumps(bad).encode())
    lines.insert(7, b"x" * 30_000)  # over max_line_bytes: rejected unread (within a read block)
    lines.insert(9, b"")
    lines.insert(12, b"y" * 150_000)  # the same, across read blocks (handed out as a LongLine)
    path = tmp_path / "run.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    knobs = {"chunk_bytes": chunk_bytes, "max_line_bytes": 20_000, "batch_tokens": 500}
    scanned = _ingest(path, "always", scan_ahead=ahead, **knobs)
    parsed = _ingest(path, "never", **knobs)
    assert scanned[1] == parsed[1]  # the same traces, numbered in the file's order
    assert [r["line"] for r in scanned[1]] == sorted(r["line"] for r in scanned[1])
    assert [(r.line, r.field) for r in scanned[0].rejected] == [(r.line, r.field) for r in parsed[0].rejected]
    assert [r.line for r in scanned[0].rejected] == [5, 8, 13]
    assert scanned[2] == parsed[2]


@pytest.mark.parametrize("ahead", ["always", "never"])
def test_a_damaged_frame_keeps_the_chunks_scanned_before_it(tmp_path, ahead):
    """The chunk scanned ahead when the reading fails further on is still taken."""
    lines = _lines()[:12]
    frames = b"".join(zstandard.ZstdCompressor().compress(line + b"\n") for line in lines)
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(frames[: len(frames) - 40])  # inside the last frame
    report, order, _ = _ingest(path, "always", chunk_bytes=1, scan_ahead=ahead)
    assert report.unreadable == [str(path)]
    assert [r["line"] for r in order] == list(range(1, 12))


@pytest.mark.parametrize(("cpus", "expected"), [({0, 1}, True), ({0, 1, 2, 3}, True), ({0}, False), ({3}, False)])
def test_auto_scans_ahead_when_the_process_may_use_two_cpus(monkeypatch, cpus, expected):
    """Pinned to one CPU the two threads would only take turns: ``auto`` scans on one."""
    monkeypatch.setattr(runtime.os, "sched_getaffinity", lambda pid: cpus)
    assert runtime.spare_core() is expected
    with runtime.configure(scan_ahead="auto"):
        assert run.scans_ahead(runtime.settings()) is expected
    for fixed, ahead in (("always", True), ("never", False)):
        with runtime.configure(scan_ahead=fixed):
            assert run.scans_ahead(runtime.settings()) is ahead


@pytest.mark.parametrize(("setting", "threads"), [("always", True), ("never", False)])
def test_the_scan_runs_on_the_thread_the_setting_says(tmp_path, monkeypatch, setting, threads):
    """``never`` scans on the ingest's own thread: the thread pool is not asked."""
    path = tmp_path / "run.jsonl"
    path.write_bytes(b"\n".join(_lines()) + b"\n")
    asked = []
    pool = runtime.threads()
    real = pool.submit

    def submit(fn, *args, **kwargs):
        asked.append(getattr(fn, "__name__", fn))
        return real(fn, *args, **kwargs)

    monkeypatch.setattr(pool, "submit", submit)
    report, _, _ = _ingest(path, "always", chunk_bytes=3000, scan_ahead=setting)
    assert report.ok and report.traces
    assert ("scan_only" in asked) is threads
