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

from tracedb.database import Database
from tracedb.handle import Handle, PerThread

from .cache import ViewCache
from .errors import ApiError, dumps


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
    ) -> None:
        # With user SQL the instance goes without external access (SET below), which must
        # not reach the other databases of the process: the server gets its own instance.
        self.root = Handle.open(db_path, isolated=allow_sql, read_only=read_only)
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
        self._readers = PerThread(self.root)
        self.db = Database.on(self._readers)
        """The read handle: each thread that uses it reads on its own cursor."""
        self.views = ViewCache(view_cache_tokens, lambda: self.root.generation)
        self._write_lock = threading.Lock()
        self._writer: Database | None = None
        self._closed = False

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
            yield self._writer

    def fresh_cursor(self) -> Database:
        """A cursor of its own, for work that may be interrupted (user SQL)."""
        return Database.on(self.root.child())

    def close(self) -> None:
        """Close every cursor and the database (idempotent)."""
        if self._closed:
            return
        self._closed = True
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
        the query and the answer: a timer interrupts the query past ``sql_timeout_s``, and
        building the answer stops there too.
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
                answer = self._answer(con, text, cap, started)
            except duckdb.InterruptException:
                raise self._timeout() from None
            except duckdb.Error as e:
                raise ApiError(400, "bad_sql", f"{type(e).__name__}: {e}") from None
            finally:
                timer.cancel()
                try:
                    con.execute("ROLLBACK")
                except duckdb.Error:  # an interrupted transaction may be gone already
                    pass
            answer["elapsed_ms"] = round((time.perf_counter() - started) * 1000, 3)
        finally:
            db.close()
        return answer

    def _answer(self, con: duckdb.DuckDBPyConnection, text: str, cap: int, started: float) -> dict[str, Any]:
        relation = con.sql(text).limit(cap + 1)
        columns = [{"name": name, "type": str(kind)} for name, kind in zip(relation.columns, relation.types)]
        rows: list[list[Any]] = []
        size = 2  # "[]"
        truncated_by = None
        with relation.to_arrow_reader(batch_size=256) as reader:
            for batch in reader:
                for row in batch.to_pylist():
                    if time.perf_counter() - started > self.sql_timeout_s:
                        raise self._timeout()
                    if len(rows) == cap:
                        truncated_by = "rows"
                        break
                    values = [_jsonable(v) for v in row.values()]
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

    def _timeout(self) -> ApiError:
        return ApiError(
            400, "sql_timeout", f"query ran past the time limit of {self.sql_timeout_s:g} s and was stopped"
        )


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
