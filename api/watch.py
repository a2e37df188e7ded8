"""The limits one ``POST /sql`` query runs under: its time and the server's memory.

DuckDB's ``memory_limit`` (the server's, ``--memory-limit``: see
:func:`tracedb.runtime.connect_isolated`) bounds what its buffer manager holds (hash
tables, sorts, aggregate states: ``string_agg`` of gigabytes fails with DuckDB's
out-of-memory error), but not every allocation of a query: ``repeat('x', 1.5e9)`` builds
its string outside it and took ~3 GB. :class:`Watch` is one thread per query that
interrupts its connection past the time limit, or once the process has grown by more
than the memory limit since the query began (its resident memory read every 20 ms), and
says which stopped it. An allocation in flight finishes before DuckDB sees the interrupt:
the process can pass the budget by what one operator allocates at once, then it is freed.
"""

from __future__ import annotations

import threading
import time

import duckdb

from tracedb import runtime


class Watch:
    """Interrupts ``con`` past ``seconds`` or past ``memory_bytes`` of growth (None: no
    memory watch); :attr:`why` is then ``"time"`` or ``"memory"``. A context manager."""

    POLL_S = 0.02

    def __init__(self, con: duckdb.DuckDBPyConnection, seconds: float, memory_bytes: int | None) -> None:
        self.con = con
        self.seconds = seconds
        self.memory_bytes = memory_bytes
        self.why: str | None = None
        self.peak = 0
        """The most the process grew while watched, in bytes (as far as it was seen)."""
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name="tracedb-sql-watch", daemon=True)
        self.started = 0.0

    def __enter__(self) -> Watch:
        self.started = time.perf_counter()
        self._base = runtime.rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5.0)

    def over(self) -> str | None:
        """Why the query must stop now (also between rows of the answer), or None."""
        if self.why is None and time.perf_counter() - self.started > self.seconds:
            self.why = "time"
        return self.why

    def _run(self) -> None:
        watch_memory = self.memory_bytes is not None and self._base is not None
        while not self._done.wait(self.POLL_S):
            if watch_memory:
                now = runtime.rss_bytes()
                if now is not None:
                    self.peak = max(self.peak, now - self._base)
                    if self.peak > self.memory_bytes and self.why is None:
                        self.why = "memory"
            if self.over() is not None:
                self.con.interrupt()
                return
