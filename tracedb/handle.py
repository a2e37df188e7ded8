"""The internal handle on one open database: its connection, its transaction, the small
SQL helpers, how new traces are numbered, and what a write invalidates.

Every module below the :class:`tracedb.Database` facade takes a :class:`Handle` and uses
only the documented members here; none of them imports the facade. A handle on a file
comes from :func:`tracedb.dbfile.open_handle`, which attaches the file to the process's
DuckDB instance (:mod:`tracedb.runtime`), installs the schema when it opens a file for
writing, and refuses a file of another schema version.

A handle serves one thread at a time (a DuckDB connection does). :meth:`Handle.child`
gives another thread a handle of its own on the same database. Every handle on one file
of the process shares its :class:`~tracedb.runtime.Shared` state (write counter, write
lock, change condition), so a write through any of them makes every view cached on any
of them stale;
:class:`PerThread` is one object that hands each calling thread its own child (the REST
server reads through one).
"""

from __future__ import annotations

import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import duckdb
import pyarrow as pa

from tracedb import runtime, sqlvalues
from tracedb.sqltext import WATERMARK_KEY, quote_identifier


class Handle:
    """One connection to one tracedb database. Open with :func:`tracedb.dbfile.open_handle`."""

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        *,
        path: str,
        catalog: str | None,
        instance_key: object,
        read_only: bool,
        release: Callable[[], None],
        shared: runtime.Shared | None = None,
    ) -> None:
        self.con = con
        """The DuckDB connection; its default catalog is this database."""
        self.path = path
        """The file (or ``:memory:``) as given to :meth:`open`."""
        self.catalog = catalog
        """This database's catalog name in a shared instance (None: an instance of its own)."""
        self.instance_key = instance_key
        """Which DuckDB instance (whose settings are shared) the connection belongs to."""
        self.read_only = read_only
        self.shared = shared or runtime.Shared()
        """The write counter, write lock and change condition of this database (all its handles')."""
        self.view_cache: Any = None
        """The decoded nodes of the last view (:mod:`tracedb.views`), keyed by generation."""
        self.in_transaction = False
        """True inside :meth:`transaction` (a nested one joins it)."""
        self._sequencing = 0
        self._release = release
        self.session_sql: str | None = None
        """SQL every new connection of this handle runs first (:meth:`cursor`): this
        tracedb's macros as temporary ones, on a file opened read-only whose stored macros
        differ (:mod:`tracedb.dbfile`)."""

    def release_when_dropped(self) -> None:
        """Detach the file when this handle is garbage-collected without :meth:`close`."""
        self._release = weakref.finalize(self, _close_then, self.con, self._release)

    def child(self) -> Handle:
        """A handle of its own (a new cursor) on the same database, for another thread;
        it shares this handle's write counter. Closing it closes only its cursor."""
        con = self.cursor()
        child = Handle(
            con,
            path=self.path,
            catalog=self.catalog,
            instance_key=self.instance_key,
            read_only=self.read_only,
            release=con.close,
            shared=self.shared,
        )
        child.session_sql = self.session_sql
        return child

    # ----------------------------------------------------------------- lifecycle

    def table_names(self) -> set[str]:
        """The tables of this database (not of the other databases of the instance), and
        its views (``nodes`` and ``segments`` are views over the tables holding them
        encoded: :data:`tracedb.tables.ENCODED`)."""
        rows = self.con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
            "AND schema_name = current_schema() UNION ALL "
            "SELECT view_name FROM duckdb_views() WHERE database_name = current_database() "
            "AND schema_name = current_schema() AND NOT internal"
        ).fetchall()
        return {r[0] for r in rows}

    def stored_version(self) -> int | None:
        """The file's schema version (None when it has none)."""
        value = self.scalar("SELECT value FROM tracedb_meta WHERE key = 'schema_version'")
        return None if value is None else int(value)

    def close(self) -> None:
        """Close the connection and release the database (idempotent); a file opened for
        writing is checkpointed. Raises (and can be retried) while another thread is
        still running a query on the connection."""
        self.con.close()
        self._release()

    def cursor(self) -> duckdb.DuckDBPyConnection:
        """A new connection to this database (its default catalog), for another thread."""
        con = self.con.cursor()
        if self.catalog is not None:
            con.execute(f"USE {quote_identifier(self.catalog)}")
        if self.session_sql is not None:
            con.execute(self.session_sql)
        return con

    # ----------------------------------------------------------------- writes

    @property
    def generation(self) -> int:
        """How many writes this database has seen through its handles."""
        return self.shared.generation

    def watermark(self, con: Any = None) -> int:
        """The highest ingest sequence number committed (0 before the first trace), as
        ``con`` (default: this handle's connection, in its transaction if one is open) sees it."""
        rows = (con or self.con).execute("SELECT value FROM tracedb_meta WHERE key = ?", [WATERMARK_KEY]).fetchall()
        return int(rows[0][0]) if rows else 0

    @contextmanager
    def sequencing(self) -> Iterator[None]:
        """Hold the database's writing lock for the block; begin the write's transaction
        inside it, so that its snapshot sees every write committed before it and two
        writes never hand out the same sequence number. :meth:`numbering` works only here."""
        with self.shared.writing:
            self._sequencing += 1
            try:
                yield
            finally:
                self._sequencing -= 1

    def numbering(self) -> Numbering:
        """The sequence numbers a write hands its new traces: the next after the watermark
        this handle's transaction sees (inside :meth:`sequencing` only: a RuntimeError
        elsewhere). Every path that adds traces (ingest, a follower, a lake pull) numbers
        them here; :meth:`Numbering.store` moves the watermark past them before COMMIT."""
        if not self._sequencing:
            raise RuntimeError("traces are numbered under the writing lock: inside handle.sequencing() only")
        return Numbering(self, self.watermark())

    def wait_for(self, after: int, timeout: float) -> int:
        """Until the watermark is above ``after`` or ``timeout`` seconds passed; returns
        the watermark. Woken by every write of this process (the only one that can
        write the file while it is open here)."""
        deadline = time.monotonic() + max(timeout, 0.0)
        while True:
            generation = self.shared.generation  # before the read: a commit after it wakes the wait
            mark = self.watermark()
            left = deadline - time.monotonic()
            if mark > after or left <= 0:
                return mark
            self.shared.wait(generation, left)

    def changed(self) -> None:
        """Something was written: views cached on any handle of the database are stale."""
        self.shared.bump()
        self.view_cache = None

    @contextmanager
    def transaction(self) -> Iterator[None]:
        """All or nothing: commit on success, roll back on any error. Nests as one."""
        if self.in_transaction:
            try:
                yield
            finally:
                self.changed()  # views read inside the transaction must see its writes
            return
        self.con.execute("BEGIN TRANSACTION")
        self.in_transaction = True
        try:
            yield
        except BaseException:
            self.con.execute("ROLLBACK")
            raise
        else:
            self.con.execute("COMMIT")
        finally:
            self.in_transaction = False
            self.changed()

    # ----------------------------------------------------------------- queries

    def sql(
        self, query: str, params: Sequence[Any] | dict[str, Any] | None = None, *, portable: bool = False
    ) -> pa.Table:
        """Run SQL (tracedb's macros are there) and return the result as Arrow; with
        ``portable``, values Arrow or Python cannot hold faithfully as DuckDB's text of
        them (:func:`tracedb.sqlvalues.portable`)."""
        result = self.con.sql(query, params=params)
        if result is None:  # a statement without a result set
            return pa.table({})
        return (sqlvalues.portable(result) if portable else result).to_arrow_table()

    def row(self, query: str, params: Sequence[Any] | None = None) -> tuple[Any, ...] | None:
        """The first row of a query, or None; the result is always consumed whole."""
        rows = self.con.execute(query, params or []).fetchall()
        return rows[0] if rows else None

    def scalar(self, query: str, params: Sequence[Any] | None = None) -> Any:
        """The first value of the first row, or None."""
        row = self.row(query, params)
        return None if row is None else row[0]

    def columns(self, table: str) -> list[str]:
        """Column names of one of this database's tables ([] when there is no such table).
        Other databases of the process share the DuckDB instance, hence the catalog filter."""
        rows = self.con.execute(
            "SELECT column_name FROM duckdb_columns() WHERE table_name = ? AND database_name = current_database() "
            "AND schema_name = current_schema() ORDER BY column_index",
            [table],
        ).fetchall()
        return [r[0] for r in rows]

    def existing(
        self,
        table: str,
        column: str,
        keys: Iterable[str] | Iterable[bytes],
        con: Any = None,
        sql_type: str = "VARCHAR",
        rows: int | None = None,
    ) -> set:
        """Which of ``keys`` (of SQL type ``sql_type``) ``table.column`` holds, read on
        ``con`` (default: this handle's connection; an ingest passes the reader that sees
        the database as committed before it). A large table is probed through the key's
        index, a small one, or one without an index on the key (``segment_store``), scanned
        (see :data:`INDEX_ROWS_PER_KEY`); ``rows`` is the table's size when the caller knows
        it (:meth:`table_rows`; it only picks the way)."""
        keys = list(keys)
        if not keys:
            return set()
        reader = con or self.con
        size = self.table_rows(table, reader) if rows is None else rows
        name = quote_identifier(column)
        select = f"SELECT {name} FROM {quote_identifier(table)} WHERE {name} IN "
        if size <= INDEX_ROWS_PER_KEY * len(keys) or not self._keyed(table, column, reader):
            if len(keys) < 256:
                found = reader.execute(select + f"(SELECT unnest(?::{sql_type}[]))", [keys]).fetchall()
            else:  # as an Arrow column: binding 20,000 Python values as a list took ~35 ms, this ~4 ms
                given = pa.Table.from_arrays([pa.array(keys, _KEY_TYPES[sql_type])], names=["key"])
                found = reader.from_arrow(given).query("keys", select + "(SELECT key FROM keys)").fetchall()
            return {r[0] for r in found}
        step = runtime.settings().segment_lookup
        out: set = set()
        for at in range(0, len(keys), step):
            part = keys[at : at + step]
            out.update(r[0] for r in reader.execute(select + f"({', '.join('?' * len(part))})", part).fetchall())
        return out

    def _keyed(self, table: str, column: str, con: Any) -> bool:
        """Whether ``table`` has a primary key or unique constraint on ``column`` alone."""
        return bool(
            con.execute(
                "SELECT count(*) FROM duckdb_constraints() WHERE database_name = current_database() "
                "AND schema_name = current_schema() AND table_name = ? "
                "AND constraint_type IN ('PRIMARY KEY', 'UNIQUE') AND constraint_column_names = [?]",
                [table, column],
            ).fetchall()[0][0]
        )

    def table_rows(self, table: str, con: Any = None) -> int:
        """DuckDB's estimate of ``table``'s rows, read on ``con`` (default: this handle's
        connection); 0 for a table it does not hold."""
        rows = (
            (con or self.con)
            .execute(
                "SELECT estimated_size FROM duckdb_tables() WHERE database_name = current_database() "
                "AND schema_name = current_schema() AND table_name = ?",
                [table],
            )
            .fetchall()
        )
        return rows[0][0] if rows else 0

    @contextmanager
    def registered(self, name: str, table: pa.Table, con: Any = None) -> Iterator[str]:
        """``table`` visible to SQL as ``name`` for the block (on ``con``, default this
        handle's connection); unregistered after, also when the block fails."""
        con = con or self.con
        con.register(name, table)
        try:
            yield name
        finally:
            try:
                con.unregister(name)
            except duckdb.Error:  # an aborted transaction refuses it; its ROLLBACK drops it
                pass


_KEY_TYPES = {"VARCHAR": pa.string(), "BLOB": pa.binary()}
"""The Arrow type of each SQL type :meth:`Handle.existing` looks keys up by."""

INDEX_ROWS_PER_KEY = 500
""":meth:`Handle.existing` probes keys through the key's index when the table holds more
than this many rows per key looked up, else it scans the key column (an index lookup costs
~10 µs a key, flat in the table's size; a scan ~20 ns a row: at 5M segments a 2,000-key
batch takes 20 ms through the index and 110 ms scanning, measured)."""


class Numbering:
    """The sequence numbers one write hands out, from the watermark it started at
    (:meth:`Handle.numbering`): 1, 2, ... in commit order, never twice."""

    def __init__(self, handle: Handle, start: int) -> None:
        self.handle = handle
        self.start = start
        """The watermark the write started at."""
        self.last = start
        """The highest number handed out so far (``start`` before the first)."""

    def take(self, count: int = 1) -> int:
        """``count`` numbers for new traces; returns the first."""
        if count < 0:
            raise ValueError(f"count is a number of traces (an int >= 0), not {count!r}")
        first = self.last + 1
        self.last += count
        return first

    def store(self) -> int | None:
        """Move the watermark past the numbers handed out, in the write's transaction (no
        other thread may be using the handle's connection); returns the new watermark, or
        None when nothing was numbered."""
        if self.last == self.start:
            return None
        self.handle.con.execute("INSERT OR REPLACE INTO tracedb_meta VALUES (?, ?)", [WATERMARK_KEY, str(self.last)])
        return self.last


def _close_then(con: duckdb.DuckDBPyConnection, release: Callable[[], None]) -> None:
    try:
        con.close()
    finally:
        release()


class PerThread:
    """One object that acts as a :class:`Handle` of the calling thread: each thread that
    uses it gets a :meth:`Handle.child` of ``root`` (its own cursor, view cache and
    transaction state), so every library call works unchanged from any thread. Threads
    come and go; the handles of finished threads are closed on the next new thread."""

    def __init__(self, root: Handle) -> None:
        object.__setattr__(self, "root", root)
        object.__setattr__(self, "_local", threading.local())
        object.__setattr__(self, "_handles", {})
        object.__setattr__(self, "_lock", threading.Lock())

    def current(self) -> Handle:
        """The calling thread's handle."""
        handle = getattr(self._local, "handle", None)
        if handle is None:
            with self._lock:
                for thread in [t for t in self._handles if not t.is_alive()]:
                    self._handles.pop(thread).close()
                handle = self._local.handle = self.root.child()
                self._handles[threading.current_thread()] = handle
        return handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self.current(), name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.current(), name, value)

    def open_handles(self) -> int:
        """How many threads have a handle of their own now."""
        with self._lock:
            return len(self._handles)

    def close(self) -> None:
        """Close every thread's handle (not the root)."""
        with self._lock:
            for handle in self._handles.values():
                handle.close()
            self._handles.clear()


HandleOf = Any
"""What the library's entry points take as their database: a :class:`tracedb.Database`
(the facade, whose ``handle`` they use) or a :class:`Handle`."""


def handle_of(db: HandleOf) -> Handle:
    """The handle of ``db``: a :class:`tracedb.Database` (its ``handle``) or a handle itself."""
    return getattr(db, "handle", db)
