"""Ingest on Ray: files parsed in Ray tasks by the file store's own ingest, appended to the lake.

An ingest task ingests its files into an in-memory tracedb (the same scanner, parser
and validation, rejects kept) and stages the result as one write: its data files
written, nothing committed (:func:`tracedb.lake.write.stage`). The driver gathers the
staged writes and commits them together once they hold ``commit_traces`` traces, and the
rest at the end (:func:`tracedb.lake.write.commit`: one commit per table, ``traces``
last, idempotent by trace id whatever else writes at the same time, so a task Ray retries
after its worker died adds nothing twice). A write of 256 traces without tags, credit or
rejects is five commits (episodes, segments, nodes, branches, traces), whatever the
number of tasks whose output it gathers. A driver killed before a commit leaves the
staged files of its tasks unreferenced (compaction's expiry deletes them after its grace).

A plain ``.jsonl`` file larger than ``range_bytes`` is cut into byte ranges, one task
each: a range holds the lines that *start* in its span of ``range_bytes`` bytes (a line
straddling a cut belongs to the range it starts in), so every line is in exactly one.
Its lines are numbered as in the whole file, for which a first round of tasks counts
the line breaks of each range (the driver adds them up: no process reads a whole file).
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import accumulate, islice
from pathlib import Path
from typing import Any

from tracedb.database import connect
from tracedb.ingest.files import ByteRange, find_files
from tracedb.ingest.run import ingest_files as ingest_into
from tracedb.lake import catalog, labels, move
from tracedb.lake.workers import chunks, running_ray
from tracedb.lake.write import AppendReport, Staged, commit, stage


@dataclass
class LakeIngestReport:
    """What a ``lake ingest`` did."""

    files: int = 0
    lines: int = 0
    traces: int = 0
    skipped: int = 0
    """Traces the lake showed already (from an earlier or a concurrent ingest)."""
    rejected: int = 0
    rows: dict[str, int] = field(default_factory=dict)
    tasks: int = 0
    """Ingest tasks (each one write); the counting tasks of large files are not counted."""
    ranges: int = 0
    """Byte ranges the large files were cut into (each an ingest task of its own)."""
    commits: int = 0
    """Table commits made (the staged writes of several tasks share them)."""
    retries: int = 0
    """Commit attempts that conflicted with another writer's and were made again."""

    def to_dict(self) -> dict[str, Any]:
        keys = ("files", "lines", "traces", "skipped", "rejected", "rows", "tasks", "ranges", "commits", "retries")
        return {k: getattr(self, k) for k in keys}

    def __str__(self) -> str:
        cut = f", {self.ranges} of them byte ranges of large files" if self.ranges else ""
        return (
            f"ingested {self.traces} traces from {self.files} files in {self.tasks} Ray tasks{cut}"
            f" ({self.skipped} already in the lake, {self.rejected} rejected)"
        )


RANGE_BYTES = 128 << 20
"""Plain ``.jsonl`` files larger than this are cut into byte ranges of about this size."""
COMMIT_TRACES = 256
"""Traces an ingest gathers (from its tasks' staged writes) before it commits them."""


def splittable(path: Path) -> bool:
    """Whether ``path`` can be cut into byte ranges: a plain ``.jsonl`` file (a compressed
    stream has no byte offsets of lines, and a ``.json`` file is one record)."""
    return path.name.endswith(".jsonl")


def spans(size: int, range_bytes: int) -> list[tuple[int, int]]:
    """The spans ``[at, to)`` of ``range_bytes`` bytes that cover a file of ``size`` bytes."""
    return [(at, min(at + range_bytes, size)) for at in range(0, size, range_bytes)]


def _line_start(f: Any, at: int, size: int) -> int:
    """The first line start at or after byte ``at`` of the open file ``f`` (``size`` when none)."""
    if at <= 0:
        return 0
    if at >= size:
        return size
    where = at - 1  # a line starts at ``at`` when the byte before it is a line break
    f.seek(where)
    while where < size and (block := f.read(min(1 << 16, size - where))):
        found = block.find(b"\n")
        if found >= 0:
            return where + found + 1
        where += len(block)
    return size


def measure(path: str, at: int, to: int, size: int) -> tuple[int, int, int]:
    """One counting task: the range of ``path`` holding the lines that start in bytes
    ``[at, to)`` of its first ``size``: (start, stop, line breaks in it). Its lines are
    as many as its line breaks (it ends just after one), unless it ends the file."""
    with open(path, "rb") as f:
        start, stop = _line_start(f, at, size), _line_start(f, to, size)
        f.seek(start)
        breaks, left = 0, stop - start
        while left > 0 and (block := f.read(min(left, 16 << 20))):
            breaks += block.count(b"\n")
            left -= len(block)
    return start, stop, breaks


def numbered(path: str, measured: Sequence[tuple[int, int, int]]) -> list[ByteRange]:
    """One file's ranges from its spans' :func:`measure` (in file order), each numbered on
    from the line breaks before it; an empty one (a span inside one long line) left out."""
    firsts = accumulate((breaks for _, _, breaks in measured), initial=1)
    return [
        ByteRange(Path(path), start, stop, first) for (start, stop, _), first in zip(measured, firsts) if stop > start
    ]


def cut(path: str | Path, range_bytes: int = RANGE_BYTES) -> list[ByteRange]:
    """The byte ranges of a plain ``.jsonl`` file, measured here one after the other (the
    lake's ingest measures them in Ray tasks at once)."""
    size = os.path.getsize(path)
    return numbered(str(path), [measure(str(path), at, to, size) for at, to in spans(size, range_bytes)])


def ingest_files(location: catalog.Location, files: Sequence[str | ByteRange], allow_ragged: bool) -> dict[str, Any]:
    """One ingest task: ``files`` (paths, or byte ranges of files) into an in-memory tracedb
    (its scanner, parser and checks), then staged as one write (:func:`tracedb.lake.write.stage`:
    its data files written, nothing committed). Returns the counts and the staged write."""
    lake = catalog.Opened.worker(location)
    paths = [f for f in files if not isinstance(f, ByteRange)]
    ranges = [f for f in files if isinstance(f, ByteRange)]
    with connect(":memory:") as db:
        labels.seed(db, lake)  # the traces' policy-version bounds under the lake's mapping
        report = ingest_into(db.handle, paths, ranges=ranges, allow_ragged=allow_ragged)
        ids = db.sql("SELECT trace_id FROM traces ORDER BY seq").column("trace_id").to_pylist()
        staged: Staged = stage(lake, move.file_rows(db, ids))
    return {
        "lines": report.lines,
        "rejected": len(report.rejected),
        "skipped": report.skipped,
        "staged": staged,
    }


def ingest(
    lake: catalog.Opened,
    paths: Iterable[str | Path],
    *,
    workers: int | None = None,
    files_per_task: int = 1,
    allow_ragged: bool = False,
    range_bytes: int = RANGE_BYTES,
    commit_traces: int = COMMIT_TRACES,
) -> LakeIngestReport:
    """See :meth:`tracedb.lake.Lake.ingest`."""
    named = (
        ("workers", workers),
        ("files_per_task", files_per_task),
        ("range_bytes", range_bytes),
        ("commit_traces", commit_traces),
    )
    for name, value in named:
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"{name} must be an int >= 1, not {value!r}")
    ray = running_ray()
    files = [p.resolve() for p in find_files(paths)]
    limit = workers or max(1, int(ray.available_resources().get("CPU", 1)))
    sizes = {p: p.stat().st_size for p in files}
    large = {p: spans(sizes[p], range_bytes) for p in files if splittable(p) and sizes[p] > range_bytes}
    counting = ray.remote(max_retries=3)(measure)  # first round: every span of every large file at once
    spans_of = [(counting, (str(p), *s, sizes[p])) for p, cut in large.items() for s in cut]
    measured = iter(run_limited(ray, spans_of, limit))
    ranges = [r for p, cut in large.items() for r in numbered(str(p), list(islice(measured, len(cut))))]
    groups: list[list[str | ByteRange]] = [*chunks([str(p) for p in files if p not in large], files_per_task)]
    groups += [[r] for r in ranges]
    task = ray.remote(max_retries=3, retry_exceptions=False)(ingest_files)
    report = LakeIngestReport(files=len(files), tasks=len(groups), ranges=len(ranges))
    pending: list[Staged] = []
    written = AppendReport()

    def gathered(result: dict[str, Any]) -> None:
        report.lines += result["lines"]
        report.rejected += result["rejected"]
        report.skipped += result["skipped"]
        pending.append(result["staged"])
        if sum(s.n_traces for s in pending) >= commit_traces:
            written.merge(commit(lake, pending))
            pending.clear()

    run_limited(ray, [(task, (lake.location, group, allow_ragged)) for group in groups], limit, gathered)
    if pending:
        written.merge(commit(lake, pending))
    report.traces = written.traces
    report.skipped += written.skipped
    report.commits = written.commits
    report.retries = written.retries
    report.rows = written.rows
    return report


def run_limited(ray: Any, calls: list[tuple[Any, tuple]], limit: int, each: Any = None) -> list[Any]:
    """Run remote ``(function, arguments)`` calls with at most ``limit`` at once; their
    results in order. ``each`` (given): called with each result as it arrives, in the
    order they finish (the driver commits while the tasks run)."""
    pending: list[Any] = []
    refs: list[Any] = []
    results: dict[Any, Any] = {}

    def take(ready: list[Any]) -> None:
        for ref in ready:
            results[ref] = ray.get(ref)
            if each is not None:
                each(results[ref])

    for function, arguments in calls:
        if len(pending) >= limit:
            ready, pending = ray.wait(pending, num_returns=1)
            take(ready)
        ref = function.remote(*arguments)
        refs.append(ref)
        pending.append(ref)
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        take(ready)
    return [results[ref] for ref in refs]


__all__ = [
    "COMMIT_TRACES",
    "RANGE_BYTES",
    "LakeIngestReport",
    "cut",
    "ingest",
    "ingest_files",
    "measure",
    "numbered",
    "spans",
]
