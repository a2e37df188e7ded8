"""``tracedb ingest --follow``: run a follower in the foreground until SIGINT or SIGTERM."""

from __future__ import annotations

import json
import signal
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

from tracedb.cli.common import err
from tracedb.database import Database
from tracedb.ingest.follow import FollowEvent, FollowReport
from tracedb.ingest.run import IngestReport


@contextmanager
def stopped_by_signals(stop: threading.Event) -> Iterator[None]:
    """SIGINT and SIGTERM set ``stop`` (the transaction under way finishes) for the block;
    the handlers before it are put back after."""
    before: dict[int, Any] = {}

    def handler(signum: int, frame: FrameType | None) -> None:
        stop.set()

    for sig in (signal.SIGINT, signal.SIGTERM):
        before[sig] = signal.signal(sig, handler)
    try:
        yield
    finally:
        for sig, previous in before.items():
            signal.signal(sig, previous)


def follow(
    database: Database,
    paths: list[Path],
    *,
    interval: float,
    settle: float,
    tags: list[str],
    allow_ragged: bool,
    as_json: bool,
    rotated: list[str] | None = None,
) -> FollowReport:
    """Follow ``paths`` into ``database`` until a signal; a line per commit on stderr (a JSON
    object per commit on stdout with ``--json``). A file read again from its start, a
    rotation followed and bytes lost are said on stderr as they are found (and, with
    ``--json``, as ``{"event": ...}`` lines on stdout)."""

    def committed(report: IngestReport) -> None:
        total = follower.report
        if as_json:
            line = {"traces": report.traces, "rejected": len(report.rejected), "watermark": total.watermark}
            _write(line)
        elif report.traces or report.rejected:
            note = f", {len(report.rejected)} rejected" if report.rejected else ""
            err.print(f"+{report.traces} traces{note} (watermark {total.watermark})", style="dim")

    def happened(event: FollowEvent) -> None:
        if event.kind == "loss":
            err.print(f"[bold red]LOST[/bold red] [red]{event.message}[/red]", highlight=False)
        else:
            err.print(f"[yellow]{event.message}[/yellow]", highlight=False)
        if as_json:
            _write(
                {
                    "event": event.kind,
                    "file": event.file,
                    "message": event.message,
                    "bytes": event.bytes,
                    "lines": event.lines,
                }
            )

    follower = database.follow(
        paths,
        interval=interval,
        settle=settle,
        tags=tags,
        allow_ragged=allow_ragged,
        rotated=rotated or (),
        on_commit=committed,
        on_event=happened,
    )
    stop = threading.Event()
    if not as_json:
        err.print(f"following {', '.join(map(str, paths))} into {database.path} (Ctrl-C stops)", style="dim")
    try:
        with stopped_by_signals(stop):
            report = follower.run(stop)
    finally:
        follower.close()
    return report


def _write(line: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(line) + "\n")
    sys.stdout.flush()
