"""The server's live follower: a :class:`~tracedb.ingest.follow.Follower` that ingests the
files of a run being written, on a handle of its own, polled by a background thread.

A server started with ``follow=`` owns its file; :class:`.backend.Backend` starts one
:class:`LiveFollower` and stops it on close, and ``GET /health`` shows its :meth:`~LiveFollower.status`.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from tracedb.database import Database
from tracedb.handle import Handle

log = logging.getLogger("tracedb.api")


class LiveFollower:
    """The server's follower: a :class:`~tracedb.ingest.follow.Follower` on a handle of
    its own, polled by a background thread. A poll that fails (the disk, a damaged
    database) is logged, counted and shown in :meth:`status`, and tried again after a
    pause that doubles up to ``RETRY_MAX_S``; the server goes on serving meanwhile. A
    failed poll commits nothing and moves no position, so retrying it is exact."""

    RETRY_MAX_S = 30.0
    STOP_S = 20.0
    """How long :meth:`stop` waits for the poll under way before interrupting it."""

    def __init__(
        self,
        root: Handle,
        paths: Sequence[str | Path],
        *,
        interval: float,
        settle: float,
        tags: Iterable[str],
        allow_ragged: bool,
        rotated: Iterable[str] = (),
    ) -> None:
        self.paths = [str(p) for p in paths]
        self.rotated = list(rotated)
        """The glob patterns of rotated copies looked at besides the usual names (``--rotated``)."""
        self.db = Database.on(root.child())
        """The follower's own database handle (it writes through it from its thread)."""
        try:
            self.follower = self.db.follow(
                paths,
                interval=interval,
                settle=settle,
                tags=list(tags),
                allow_ragged=allow_ragged,
                rotated=self.rotated,
                on_commit=self._committed,
            )
        except BaseException:
            self.db.close()
            raise
        self.errors = 0
        self.last_error: str | None = None
        self.last_error_at: float | None = None
        self.last_commit_at: float | None = None
        self.failing = False
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracedb-follower", daemon=True)
        self._thread.start()

    def _committed(self, _: Any) -> None:
        self.last_commit_at = time.time()

    def _run(self) -> None:
        pause = 1.0
        interval = self.follower.interval
        while not self._stop.is_set():
            began = time.monotonic()
            try:
                result = self.follower.poll()
            except Exception as e:  # reported in /health; the server goes on
                self.errors += 1
                self.failing = True
                self.last_error = f"{type(e).__name__}: {e}"
                self.last_error_at = time.time()
                log.exception("the follower's poll failed; trying again in %.0f s", pause)
                self._stop.wait(pause)
                pause = min(pause * 2, self.RETRY_MAX_S)
                continue
            self.failing, pause = False, 1.0
            if result is None or not self.follower.behind:
                self._stop.wait(max(0.0, interval - (time.monotonic() - began)))

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def status(self) -> dict[str, Any]:
        """What the follower did and where it is (read from another thread: copies only)."""
        report = self.follower.report
        state = "stopped" if not self.running else "failing" if self.failing else "following"
        return {
            "state": state,
            "paths": self.paths,
            "rotated": self.rotated,
            "files": report.files,
            "polls": report.polls,
            "commits": report.commits,
            "lines": report.lines,
            "traces": report.traces,
            "skipped": report.skipped,
            "rejected": report.rejected,
            "bytes": report.bytes,
            "watermark": report.watermark,
            "behind": self.follower.behind,
            "waiting": dict(report.waiting),
            "restarts": list(report.restarts)[-20:],
            "rotations": list(report.rotations)[-20:],
            "lost": [{"file": e.file, "bytes": e.bytes, "lines": e.lines, "message": e.message} for e in report.lost][
                -20:
            ],
            "lost_bytes": report.lost_bytes,
            "errors": self.errors,
            "last_error": self.last_error,
            "last_error_at": _iso(self.last_error_at),
            "last_commit_at": _iso(self.last_commit_at),
            "interval_s": self.follower.interval,
            "settle_s": self.follower.settle,
        }

    def stop(self) -> bool:
        """Stop after the poll under way (interrupted past ``STOP_S``); True once stopped."""
        self._stop.set()
        self._thread.join(self.STOP_S)
        if self._thread.is_alive():
            log.warning("the follower did not finish its poll within %.0f s: interrupting it", self.STOP_S)
            self.db.con.interrupt()
            self._thread.join(5.0)
        if self._thread.is_alive():
            return False
        self.follower.close()
        self.db.close()
        return True


def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()
