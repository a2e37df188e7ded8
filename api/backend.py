"""The server's hold on one tracedb database: a read cursor per thread, one serialized writer.

DuckDB runs queries concurrently on *cursors* (separate connections to one database
instance), never on one connection from several threads. Reads go through
:class:`ThreadDatabase`, one :class:`tracedb.Database` object whose connection, view
cache and transaction flag are per thread: each worker thread of the server reads on
its own cursor, so every library call works unchanged and nothing has to be handed
back (a request cancelled mid-way cannot leak a cursor). Readers see a consistent
snapshot (DuckDB's MVCC) and are never blocked by a writer; writers take one lock and
run in one transaction on one fixed cursor, so a write stalls only other writes. After
any write a shared generation counter moves on, which makes every thread's view cache
stale.
"""

from __future__ import annotations

import base64
import datetime
import decimal
import math
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb

import tracedb
from tracedb.store import Database

from .cache import ViewCache
from .errors import ApiError


class _Generation:
    """A counter shared by all cursors of one server; bumped after every write."""

    def __init__(self) -> None:
        self.value = 0
        self.lock = threading.Lock()

    def bump(self) -> None:
        with self.lock:
            self.value += 1


class PooledDatabase(Database):
    """A :class:`tracedb.Database` over one cursor of a shared database instance.

    Only the connection differs from a plain ``Database``: the schema was installed and
    checked when the server opened the file, and the view cache is invalidated by the
    shared generation, so a write through any cursor is seen by all of them.
    """

    def __init__(self, root: Database, generation: _Generation) -> None:
        # No super().__init__(): that would open a new connection and install the schema.
        self._follow(root, generation)
        self.con = root.cursor()
        self._release = self.con.close
        self._cache = None
        self._in_transaction = False

    def _follow(self, root: Database, generation: _Generation) -> None:
        """What a handle over the server's database takes from its root handle."""
        self.path = root.path
        self._catalog = root._catalog
        self._instance_key = root._instance_key
        self._shared = generation

    @property  # type: ignore[override]
    def _generation(self) -> int:
        return self._shared.value

    @_generation.setter
    def _generation(self, value: int) -> None:  # Database._changed() does `+= 1`
        self._shared.bump()

    def _changed(self) -> None:
        self._shared.bump()
        self._cache = None


class ThreadDatabase(PooledDatabase):
    """One object for every reading thread; each thread gets its own cursor and cache."""

    def __init__(self, root: Database, generation: _Generation) -> None:
        self._follow(root, generation)
        self._root = root
        self._local = threading.local()
        self._cursors: dict[threading.Thread, duckdb.DuckDBPyConnection] = {}
        self._lock = threading.Lock()

    @property  # type: ignore[override]
    def con(self) -> duckdb.DuckDBPyConnection:
        con = getattr(self._local, "con", None)
        if con is None:
            with self._lock:
                for thread in [t for t in self._cursors if not t.is_alive()]:  # threads come and go
                    self._cursors.pop(thread).close()
                con = self._local.con = self._root.cursor()
                self._cursors[threading.current_thread()] = con
        return con

    @property  # type: ignore[override]
    def _cache(self) -> Any:
        return getattr(self._local, "cache", None)

    @_cache.setter
    def _cache(self, value: Any) -> None:
        self._local.cache = value

    @property  # type: ignore[override]
    def _in_transaction(self) -> bool:
        return getattr(self._local, "in_transaction", False)

    @_in_transaction.setter
    def _in_transaction(self, value: bool) -> None:
        self._local.in_transaction = value

    def close(self) -> None:
        with self._lock:
            for con in self._cursors.values():
                con.close()
            self._cursors.clear()


class Backend:
    """The database behind one app: per-thread readers, the writer, SQL limits, the tokenizer."""

    def __init__(
        self,
        db_path: str | Path,
        *,
        allow_sql: bool = False,
        sql_row_limit: int = 1000,
        sql_timeout_s: float = 5.0,
        tokenizer: Any = None,
        view_cache_tokens: int = 8_000_000,
    ) -> None:
        # With user SQL the instance goes without external access (SET below), which must
        # not reach the other databases of the process: the server gets its own instance.
        self.root = tracedb.connect(db_path, isolated=allow_sql)
        self.path = self.root.path
        self.allow_sql = allow_sql
        self.sql_row_limit = sql_row_limit
        self.sql_timeout_s = sql_timeout_s
        self.tokenizer = tokenizer
        if allow_sql:
            # User SQL must not reach files or the network; tracedb itself only reads
            # and writes files from Python, so the whole instance can go without.
            self.root.con.execute("SET enable_external_access = false")
        self._generation = _Generation()
        self.db = ThreadDatabase(self.root, self._generation)
        self.views = ViewCache(view_cache_tokens, lambda: self._generation.value)
        self._write_lock = threading.Lock()
        self._writer: PooledDatabase | None = None
        self._closed = False

    @contextmanager
    def reader(self) -> Iterator[Database]:
        """The calling thread's read handle (for code outside a request, e.g. tests)."""
        yield self.db

    @contextmanager
    def writer(self) -> Iterator[PooledDatabase]:
        """The one writer: exclusive among writers, invisible to readers until commit."""
        with self._write_lock:
            if self._writer is None:
                self._writer = PooledDatabase(self.root, self._generation)
            yield self._writer

    def fresh_cursor(self) -> PooledDatabase:
        """A cursor of its own, for work that may be interrupted (user SQL)."""
        return PooledDatabase(self.root, self._generation)

    def close(self) -> None:
        """Close every cursor and the database (idempotent)."""
        if self._closed:
            return
        self._closed = True
        self.db.close()
        if self._writer is not None:
            self._writer.close()
        self.root.close()

    # ------------------------------------------------------------------ user SQL

    def read_sql(self, text: str, limit: int | None = None) -> dict[str, Any]:
        """Run one read-only SELECT with a row limit and a time limit.

        Only a single statement whose type is SELECT is accepted; it runs on a fresh
        cursor inside a READ ONLY transaction that is always rolled back (a SELECT can
        hide a write in a CTE), and a timer interrupts it past ``sql_timeout_s``.
        """
        if not self.allow_sql:
            raise ApiError(403, "sql_disabled", "SQL is disabled on this server; start it with --allow-sql")
        cap = self.sql_row_limit if limit is None else min(limit, self.sql_row_limit)
        db = self.fresh_cursor()
        con = db.con
        try:
            try:
                statements = con.extract_statements(text)
            except duckdb.Error as e:
                raise ApiError(400, "bad_sql", f"{type(e).__name__}: {e}") from None
            if len(statements) != 1:
                raise ApiError(403, "not_a_read", f"send exactly one SELECT statement, got {len(statements)}")
            kind = statements[0].type
            if kind != duckdb.StatementType.SELECT:
                raise ApiError(403, "not_a_read", f"only SELECT is allowed here; this is {kind.name}")
            timer = threading.Timer(self.sql_timeout_s, con.interrupt)
            started = time.perf_counter()
            con.execute("BEGIN TRANSACTION READ ONLY")
            timer.start()
            try:
                table = con.sql(text).limit(cap + 1).to_arrow_table()
            except duckdb.InterruptException:
                raise ApiError(
                    400, "sql_timeout", f"query ran past the time limit of {self.sql_timeout_s:g} s and was stopped"
                ) from None
            except duckdb.Error as e:
                raise ApiError(400, "bad_sql", f"{type(e).__name__}: {e}") from None
            finally:
                timer.cancel()
                try:
                    con.execute("ROLLBACK")
                except duckdb.Error:  # an interrupted transaction may be gone already
                    pass
            elapsed = (time.perf_counter() - started) * 1000
        finally:
            db.close()
        rows = [[_jsonable(v) for v in row.values()] for row in table.slice(0, cap).to_pylist()]
        return {
            "columns": [{"name": f.name, "type": str(f.type)} for f in table.schema],
            "rows": rows,
            "row_count": len(rows),
            "truncated": table.num_rows > cap,
            "limit": cap,
            "elapsed_ms": round(elapsed, 3),
        }


def _jsonable(value: Any) -> Any:
    """A SQL value JSON can carry: huge integers and decimals as strings, bytes as base64."""
    if value is None or isinstance(value, bool | str):
        return value
    if isinstance(value, int):
        return value if -(2**63) <= value < 2**64 else str(value)
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, decimal.Decimal):
        return str(value)
    if isinstance(value, bytes):
        return base64.b64encode(value).decode()
    if isinstance(value, datetime.date | datetime.time | datetime.datetime):
        return value.isoformat()
    if isinstance(value, datetime.timedelta | uuid.UUID):
        return str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)
