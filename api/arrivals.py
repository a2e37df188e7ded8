"""Long-poll wakeups: :class:`Arrivals` tells waiting requests when the watermark moves.

A long-poll (``GET /traces?wait=``) is a coroutine awaiting a future; one thread per
server watches the database's change condition and wakes them all, so a waiting request
holds neither a worker thread nor a cursor.
"""

from __future__ import annotations

import asyncio
import threading

import duckdb

from tracedb.handle import Handle


class Arrivals:
    """Wakes long-polls when the watermark moves. One thread (started by the first
    wait) sleeps on the database's change condition, which every commit of this process
    signals, and reads the watermark after each; a waiting request is a coroutine with a
    future, so any number of them cost no worker thread and no cursor."""

    def __init__(self, root: Handle) -> None:
        self._root = root
        self._lock = threading.Lock()
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = set()
        self._handle: Handle | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.watermark = 0
        """The last watermark read (a moment behind a commit, never ahead of it)."""

    def _start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._handle = self._root.child()
            self.watermark = self._handle.watermark()
            self._thread = threading.Thread(target=self._run, name="tracedb-arrivals", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self._handle is not None
        shared = self._root.shared
        seen = shared.generation
        while not self._stop.is_set():
            with shared.changed:
                shared.changed.wait_for(lambda seen=seen: shared.generation != seen or self._stop.is_set(), 1.0)
                seen = shared.generation
            try:
                mark = self._handle.watermark()
            except duckdb.Error:  # closing under it
                continue
            if mark != self.watermark:
                self.watermark = mark
                self._wake()
        self._wake()

    def _wake(self) -> None:
        with self._lock:
            waiters = list(self._waiters)
        for loop, future in waiters:
            loop.call_soon_threadsafe(_resolve, future)

    async def wait(self, after: int, timeout: float) -> int:
        """The watermark once it is above ``after``, or after ``timeout`` seconds."""
        self._start()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.watermark <= after and not self._stop.is_set():
            left = deadline - loop.time()
            if left <= 0:
                break
            entry = (loop, loop.create_future())
            with self._lock:
                self._waiters.add(entry)
            try:
                if self.watermark > after:  # moved while this one was being registered
                    break
                await asyncio.wait_for(entry[1], left)
            except TimeoutError:
                break
            finally:
                with self._lock:
                    self._waiters.discard(entry)
        return self.watermark

    def close(self) -> None:
        """End the thread (and with it every wait) and close its cursor."""
        self._stop.set()
        shared = self._root.shared
        with shared.changed:
            shared.changed.notify_all()
        with self._lock:
            thread, handle = self._thread, self._handle
        if thread is not None:
            thread.join(5.0)
        if handle is not None and (thread is None or not thread.is_alive()):
            handle.close()


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)
