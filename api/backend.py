"""The server's hold on one tracedb database: a read handle per thread, one serialized writer.

DuckDB runs queries concurrently on *cursors* (separate connections to one database
instance), never on one connection from several threads. The server opens the file once
(a :class:`~tracedb.handle.Handle`) and composes handles over it: reads go through one
:class:`tracedb.Database` over a :class:`~tracedb.handle.PerThread` handle, whose
connection, view cache and transaction state are the calling thread's own, so every
library call works unchanged and nothing has to be handed back (a request cancelled
mid-way cannot leak a cursor). Readers see a consistent snapshot (DuckDB's MVCC) and are
never blocked by a writer; writers take one lock and run in one transaction on one fixed
child handle, so a write stalls only other writes. Every handle shares the root's write
counter, so a write through any of them makes every thread's view cache stale.

A server that follows a run (``follow=``) owns the file: a :class:`LiveFollower` ingests
on a handle of its own in a background thread, and long-polls wait on :class:`Arrivals`,
one thread that watches the watermark for every waiting request (a waiting request holds
neither a worker thread nor a cursor).
"""

from __future__ import annotations

import asyncio
import datetime
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb

from tracedb import runtime, sqlcheck, sqlvalues
from tracedb.batches import Plan
from tracedb.database import Database
from tracedb.dbfile import open_handle
from tracedb.errors import SqlRefused
from tracedb.handle import Handle, PerThread

from .cache import ViewCache
from .errors import ApiError, dumps
from .watch import Watch

log = logging.getLogger("tracedb.api")


class Backend:
    """The database behind one app: per-thread readers, the writer, SQL limits, the tokenizer."""

    def __init__(
        self,
        db_path: str | Path,
        *,
        allow_sql: bool = False,
        sql_row_limit: int = 1000,
        sql_timeout_s: float = 5.0,
        sql_max_bytes: int = 4 * 1024 * 1024,
        tokenizer: Any = None,
        view_cache_tokens: int = 8_000_000,
        read_only: bool = False,
        branch_token_limit: int = 4_000_000,
        max_wait_s: float = 60.0,
        follow: Sequence[str | Path] | None = None,
        follow_interval: float = 0.25,
        follow_settle: float = 2.0,
        follow_tags: Iterable[str] = (),
        follow_allow_ragged: bool = False,
    ) -> None:
        if follow and read_only:
            raise ValueError("a server that follows a run writes its database: it cannot open it read-only")
        if branch_token_limit < 1 or max_wait_s < 0:
            raise ValueError(f"branch_token_limit must be >= 1, max_wait_s >= 0: {branch_token_limit}, {max_wait_s}")
        # With user SQL the instance goes without external access (SET below), which must
        # not reach the other databases of the process: the server gets its own instance.
        self.root = open_handle(db_path, isolated=allow_sql, read_only=read_only)
        self.branch_token_limit = branch_token_limit
        """The most view tokens one ``GET /branches`` answer holds (whole traces; said when reached)."""
        self.max_wait_s = max_wait_s
        """The longest a long-poll waits, whatever it asks for."""
        self.read_only = read_only
        self.sql_max_bytes = sql_max_bytes
        self.path = self.root.path
        self.allow_sql = allow_sql
        self.sql_row_limit = sql_row_limit
        self.sql_timeout_s = sql_timeout_s
        self.tokenizer = tokenizer
        if allow_sql:
            # User SQL must not reach files or the network; tracedb itself only reads
            # and writes files from Python, so the whole instance can go without.
            self.root.con.execute("SET enable_external_access = false")
        self.sql_memory_limit = self.root.scalar("SELECT current_setting('memory_limit')")
        """The memory limit user SQL runs under: the server's (its instance's), as DuckDB says it."""
        self.sql_memory_bytes = runtime.size_bytes(self.sql_memory_limit)
        """The same in bytes: also how much the process may grow during one query (:class:`.watch.Watch`)."""
        self._readers = PerThread(self.root)
        self.db = Database.on(self._readers)
        """The read handle: each thread that uses it reads on its own cursor."""
        self.views = ViewCache(view_cache_tokens, lambda: self.root.generation)
        self._write_lock = threading.Lock()
        self._writer: Database | None = None
        self.edits = 0
        """REST writes so far (ingests, credit): a cached plan read before one is stale."""
        self.plans = PlanCache(2)
        """The last micro-batch plans: every rank of a step asks for the same one."""
        self.arrivals = Arrivals(self.root)
        self.follower: LiveFollower | None = None
        self._closed = False
        if follow:
            try:
                self.follower = LiveFollower(
                    self.root,
                    follow,
                    interval=follow_interval,
                    settle=follow_settle,
                    tags=follow_tags,
                    allow_ragged=follow_allow_ragged,
                )
            except BaseException:
                self.close()
                raise

    @contextmanager
    def reader(self) -> Iterator[Database]:
        """The calling thread's read handle (for code outside a request, e.g. tests)."""
        yield self.db

    @contextmanager
    def writer(self) -> Iterator[Database]:
        """The one writer: exclusive among writers, invisible to readers until commit."""
        with self._write_lock:
            if self._writer is None:
                self._writer = Database.on(self.root.child())
            try:
                yield self._writer
            finally:
                self.edits += 1

    def fresh_cursor(self) -> Database:
        """A cursor of its own, for work that may be interrupted (user SQL)."""
        return Database.on(self.root.child())

    def close(self) -> None:
        """Stop the follower (it finishes its transaction; bounded), wake and end the
        long-polls, close every cursor and the database (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self.follower is not None:
            self.follower.stop()
        self.arrivals.close()
        self._readers.close()
        if self._writer is not None:
            self._writer.close()
        self.root.close()

    # ------------------------------------------------------------------ user SQL

    def read_sql(self, text: str, limit: int | None = None) -> dict[str, Any]:
        """Run one read-only SELECT within a row limit, a byte budget and a time limit.

        Only a single statement whose type is SELECT is accepted; it runs on a fresh
        cursor inside a READ ONLY transaction that is always rolled back (a SELECT can
        hide a write in a CTE). Rows are read a batch at a time and turned into JSON as
        they come: the answer stops growing at ``sql_row_limit`` rows or ``sql_max_bytes``
        of JSON, and says which (``truncated``, ``truncated_by``). The time limit covers
        the query and the answer: a :class:`.watch.Watch` interrupts the query past
        ``sql_timeout_s``, and building the answer stops there too. The query runs under
        the server's memory limit (its instance's ``memory_limit``); DuckDB's out-of-memory
        error, or the process growing past that limit meanwhile (the watch interrupts it),
        is 422 ``sql_out_of_memory``.
        """
        if not self.allow_sql:
            raise ApiError(403, "sql_disabled", "SQL is disabled on this server; start it with --allow-sql")
        cap = self.sql_row_limit if limit is None else min(limit, self.sql_row_limit)
        db = self.fresh_cursor()
        con = db.con
        try:
            try:
                sqlcheck.check(con, text, explain=False, single=True)  # one SELECT, by DuckDB's parser
            except duckdb.Error as e:
                raise ApiError(400, "bad_sql", f"{type(e).__name__}: {e}") from None
            except SqlRefused as e:
                raise ApiError(403, "not_a_read", str(e)) from None
            con.execute("BEGIN TRANSACTION READ ONLY")
            watch = Watch(con, self.sql_timeout_s, self.sql_memory_bytes)
            try:
                with watch:
                    answer = self._answer(con, text, cap, watch)
            except duckdb.InterruptException:
                raise (self._out_of_memory(None) if watch.why == "memory" else self._timeout()) from None
            except duckdb.OutOfMemoryException as e:
                raise self._out_of_memory(e) from None
            except duckdb.Error as e:
                raise ApiError(400, "bad_sql", f"{type(e).__name__}: {e}") from None
            except MemoryError:
                raise self._out_of_memory(None) from None
            finally:
                try:
                    con.execute("ROLLBACK")
                except duckdb.Error:  # an interrupted transaction may be gone already
                    pass
            answer["elapsed_ms"] = round((time.perf_counter() - watch.started) * 1000, 3)
        finally:
            db.close()
        return answer

    def _answer(self, con: duckdb.DuckDBPyConnection, text: str, cap: int, watch: Watch) -> dict[str, Any]:
        query = con.sql(text)
        columns = [{"name": name, "type": str(kind)} for name, kind in zip(query.columns, query.types)]
        # Values Arrow or Python cannot hold faithfully (128-bit integers, dates past 9999
        # or infinite, ...) come as DuckDB's text of them (tracedb.sqlvalues).
        relation = sqlvalues.portable(query).limit(cap + 1)
        rows: list[list[Any]] = []
        size = 2  # "[]"
        truncated_by = None
        with relation.to_arrow_reader(batch_size=256) as reader:
            for batch in reader:
                for row in batch.to_pylist():
                    if watch.over() == "time":
                        raise self._timeout()
                    if watch.why == "memory":
                        raise self._out_of_memory(None)
                    if len(rows) == cap:
                        truncated_by = "rows"
                        break
                    values = [sqlvalues.jsonable(v) for v in row.values()]
                    cost = len(dumps(values)) + 1
                    if size + cost > self.sql_max_bytes:
                        truncated_by = "bytes"
                        break
                    rows.append(values)
                    size += cost
                if truncated_by:
                    break
        notes = {
            "rows": f"more rows matched than the row limit ({cap})",
            "bytes": f"the next row would pass the answer's byte budget ({self.sql_max_bytes} bytes of JSON rows)",
        }
        return {
            "columns": columns,
            "rows": rows,
            "row_count": len(rows),
            "truncated": truncated_by is not None,
            "truncated_by": truncated_by,
            "truncated_why": notes.get(truncated_by) if truncated_by else None,
            "limit": cap,
            "max_bytes": self.sql_max_bytes,
        }

    def _out_of_memory(self, error: duckdb.Error | None) -> ApiError:
        limit = self.sql_memory_limit
        why = f"DuckDB: {str(error).strip().splitlines()[0]}" if error is not None else "stopped"
        return ApiError(
            422,
            "sql_out_of_memory",
            f"the query needed more memory than the server's limit ({limit}; --memory-limit): {why}",
        )

    def _timeout(self) -> ApiError:
        return ApiError(
            400, "sql_timeout", f"query ran past the time limit of {self.sql_timeout_s:g} s and was stopped"
        )


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
    ) -> None:
        self.paths = [str(p) for p in paths]
        self.db = Database.on(root.child())
        """The follower's own database handle (it writes through it from its thread)."""
        try:
            self.follower = self.db.follow(
                paths,
                interval=interval,
                settle=settle,
                tags=list(tags),
                allow_ragged=allow_ragged,
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


class PlanCache:
    """The last ``size`` micro-batch plans by their arguments: the ranks of a step each
    ask for their part of one plan, which is built once (the others wait for it)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._entries: OrderedDict[Hashable, Plan] = OrderedDict()
        self._building: dict[Hashable, threading.Lock] = {}
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, key: Hashable, build: Callable[[], Plan]) -> Plan:
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                self.hits += 1
                return self._entries[key]
            building = self._building.setdefault(key, threading.Lock())
        with building:
            with self._lock:
                if key in self._entries:
                    self.hits += 1
                    return self._entries[key]
                self.misses += 1
            try:
                plan = build()
                with self._lock:
                    self._entries[key] = plan
                    while len(self._entries) > self.size:
                        self._entries.popitem(last=False)
            finally:
                with self._lock:
                    self._building.pop(key, None)
        return plan


def _iso(seconds: float | None) -> str | None:
    if seconds is None:
        return None
    return datetime.datetime.fromtimestamp(seconds, datetime.UTC).isoformat()
