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

A server that follows a run (``follow=``) owns the file: a :class:`.follower.LiveFollower`
ingests on a handle of its own in a background thread, and long-polls wait on
:class:`.arrivals.Arrivals`, one thread that watches the watermark for every waiting
request (a waiting request holds neither a worker thread nor a cursor). The last
micro-batch plans are kept in a :class:`.plans.PlanCache`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb

from tracedb import runtime, sqlcheck, sqlvalues
from tracedb.database import Database
from tracedb.dbfile import open_handle
from tracedb.errors import SqlRefused
from tracedb.handle import PerThread

from .arrivals import Arrivals
from .cache import ViewCache
from .errors import ApiError, dumps
from .follower import LiveFollower
from .plans import PlanCache
from .watch import Watch


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
        branch_row_limit: int = 10_000,
        max_wait_s: float = 60.0,
        follow: Sequence[str | Path] | None = None,
        follow_interval: float = 0.25,
        follow_settle: float = 2.0,
        follow_tags: Iterable[str] = (),
        follow_allow_ragged: bool = False,
        follow_rotated: Iterable[str] = (),
    ) -> None:
        if follow and read_only:
            raise ValueError("a server that follows a run writes its database: it cannot open it read-only")
        if branch_token_limit < 1 or branch_row_limit < 1 or max_wait_s < 0:
            raise ValueError(
                "branch_token_limit and branch_row_limit must be >= 1, max_wait_s >= 0: "
                f"{branch_token_limit}, {branch_row_limit}, {max_wait_s}"
            )
        # With user SQL the instance goes without external access (SET below), which must
        # not reach the other databases of the process: the server gets its own instance.
        self.root = open_handle(db_path, isolated=allow_sql, read_only=read_only)
        self.branch_token_limit = branch_token_limit
        """The most view tokens one ``GET /branches`` answer holds (whole traces; said when reached)."""
        self.branch_row_limit = branch_row_limit
        """The most branches one ``GET /branches`` answer, or one page of a trace's branch list, holds."""
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
                    rotated=follow_rotated,
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
