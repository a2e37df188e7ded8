"""Ingest on Ray: files parsed in Ray tasks by the file store's own ingest, appended to the lake.

An ingest task ingests its files into an in-memory tracedb (the same scanner, parser
and validation, rejects kept) and appends the result to the lake as one write
(:mod:`tracedb.lake.write`: idempotent by trace id whatever else writes at the same
time, so a task Ray retries after its worker died adds nothing twice).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tracedb.database import connect
from tracedb.ingest.files import find_files
from tracedb.lake import catalog, move
from tracedb.lake.workers import chunks, running_ray
from tracedb.lake.write import AppendReport, append


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

    def to_dict(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in ("files", "lines", "traces", "skipped", "rejected", "rows", "tasks")}

    def __str__(self) -> str:
        return (
            f"ingested {self.traces} traces from {self.files} files in {self.tasks} Ray tasks"
            f" ({self.skipped} already in the lake, {self.rejected} rejected)"
        )


def ingest_files(location: catalog.Location, files: list[str], allow_ragged: bool) -> dict[str, Any]:
    """One ingest task: ``files`` into an in-memory tracedb (its scanner, parser and
    checks), then appended to the lake as one write. Returns the counts."""

    lake = catalog.Opened.at(location)
    with connect(":memory:") as db:
        report = db.ingest(files, allow_ragged=allow_ragged)
        ids = db.sql("SELECT trace_id FROM traces ORDER BY seq").column("trace_id").to_pylist()
        appended: AppendReport = append(lake, move.file_rows(db, ids))
    return {
        "lines": report.lines,
        "rejected": len(report.rejected),
        "traces": appended.traces,
        "skipped": appended.skipped + report.skipped,
        "rows": appended.rows,
    }


def ingest(
    lake: catalog.Opened,
    paths: Iterable[str | Path],
    *,
    workers: int | None = None,
    files_per_task: int = 1,
    allow_ragged: bool = False,
) -> LakeIngestReport:
    """See :meth:`tracedb.lake.Lake.ingest`."""
    if workers is not None and (not isinstance(workers, int) or workers < 1):
        raise ValueError(f"workers is a number of tasks at once (an int >= 1), not {workers!r}")
    ray = running_ray()
    files = [str(p.resolve()) for p in find_files(paths)]
    task = ray.remote(max_retries=3, retry_exceptions=False)(ingest_files)
    groups = chunks(files, max(1, files_per_task))
    limit = workers or max(1, int(ray.available_resources().get("CPU", 1)))
    report = LakeIngestReport(files=len(files), tasks=len(groups))
    pending: list[Any] = []
    results: list[dict[str, Any]] = []
    for group in groups:
        if len(pending) >= limit:
            done, pending = ray.wait(pending, num_returns=1)
            results.extend(ray.get(done))
        pending.append(task.remote(lake.location, group, allow_ragged))
    results.extend(ray.get(pending))
    for r in results:
        report.lines += r["lines"]
        report.traces += r["traces"]
        report.skipped += r["skipped"]
        report.rejected += r["rejected"]
        for name, n in r["rows"].items():
            report.rows[name] = report.rows.get(name, 0) + n
    return report


__all__ = ["LakeIngestReport", "ingest", "ingest_files"]
