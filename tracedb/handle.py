"""The internal handle on one open database: its connection, its transaction, the small
SQL helpers, the schema install and version check, and what a write invalidates.

Every module below the :class:`tracedb.Database` facade takes a :class:`Handle` and uses
only the documented members here; none of them imports the facade. ``Handle.open``
attaches a file to the process's DuckDB instance (:mod:`tracedb.runtime`), installs the
schema when it opens a file for writing, and refuses a file of another schema version.

A handle serves one thread at a time (a DuckDB connection does). :meth:`Handle.child`
gives another thread a handle of its own on the same database, sharing the write
counter, so a write through any of them makes every view cached on any of them stale;
:class:`PerThread` is one object that hands each calling thread its own child (the REST
server reads through one).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from tracedb import runtime
from tracedb.errors import SchemaVersionError
from tracedb.sqltext import load_sql, quote_identifier

SCHEMA_VERSION = 1
"""Version of the stored layout; a file of another version is refused, not guessed at."""


class Generation:
    """A write counter shared by the handles of one database (see :meth:`Handle.child`)."""

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def bump(self) -> None:
        with self._lock:
            self.value += 1


class Handle:
    """One connection to one tracedb database. Open with :meth:`Handle.open`."""

    def __init__(
        self,
        con: duckdb.DuckDBPyConnection,
        *,
        path: str,
        catalog: str | None,
        instance_key: object,
        read_only: bool,
        release: Callable[[], None],
        generation: Generation | None = None,
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
        self.shared_generation = generation or Generation()
        self.view_cache: Any = None
        """The decoded nodes of the last view (:mod:`tracedb.views`), keyed by generation."""
        self.in_transaction = False
        """True inside :meth:`transaction` (a nested one joins it)."""
        self._release = release

    @classmethod
    def open(cls, path: str | Path = ":memory:", *, read_only: bool = False, isolated: bool = False) -> Handle:
        """Open (creating if needed) a tracedb database; see :func:`tracedb.connect`."""
        text = str(path)
        fresh = True
        handle = None
        if not isolated:
            try:
                con, catalog, fresh, release = runtime.attach(text, read_only=read_only)
                handle = cls(
                    con, path=text, catalog=catalog, instance_key="shared", read_only=read_only, release=release
                )
                # A handle dropped without close() still detaches its file.
                handle._release = weakref.finalize(handle, _close_then, con, release)
            except duckdb.ResourceInUseException:
                isolated = True  # a plain duckdb.connect of this process holds it: join that instance
        if isolated:
            con = duckdb.connect(text, read_only=read_only)
            handle = cls(con, path=text, catalog=None, instance_key=con, read_only=read_only, release=con.close)
        assert handle is not None
        try:
            if not read_only and fresh:  # an attachment shared with another handle is installed
                handle.install()
            handle.check_version()
        except BaseException:
            handle.close()  # a refused file is not kept open
            raise
        return handle

    def child(self) -> Handle:
        """A handle of its own (a new cursor) on the same database, for another thread;
        it shares this handle's write counter. Closing it closes only its cursor."""
        con = self.cursor()
        return Handle(
            con,
            path=self.path,
            catalog=self.catalog,
            instance_key=self.instance_key,
            read_only=self.read_only,
            release=con.close,
            generation=self.shared_generation,
        )

    # ----------------------------------------------------------------- lifecycle

    def install(self) -> None:
        """Create the tables and (re)write the macros; an existing file of another
        version is refused before anything is written to it."""
        if self.columns("tracedb_meta"):
            self.check_version()
        self.con.execute(load_sql("tables.sql"))
        if self.row("SELECT value FROM tracedb_meta WHERE key = 'schema_version'") is None:
            self.con.execute("INSERT INTO tracedb_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
        self.con.execute(load_sql("macros.sql"))

    def check_version(self) -> None:
        """Raise :class:`SchemaVersionError` unless the file holds this tracedb's schema version."""
        row = self.row("SELECT value FROM tracedb_meta WHERE key = 'schema_version'")
        if row is None or int(row[0]) != SCHEMA_VERSION:
            found = None if row is None else row[0]
            raise SchemaVersionError(f"{self.path}: schema version {found}, this tracedb reads {SCHEMA_VERSION}")

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
        return con

    # ----------------------------------------------------------------- writes

    @property
    def generation(self) -> int:
        """How many writes this database has seen through its handles."""
        return self.shared_generation.value

    def changed(self) -> None:
        """Something was written: views cached on any handle of the database are stale."""
        self.shared_generation.bump()
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

    def sql(self, query: str, params: Sequence[Any] | dict[str, Any] | None = None) -> pa.Table:
        """Run SQL (tracedb's macros are there) and return the result as Arrow."""
        result = self.con.sql(query, params=params)
        if result is None:  # a statement without a result set
            return pa.table({})
        return result.to_arrow_table()

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

    def existing(self, table: str, column: str, ids: Iterable[str], con: Any = None) -> set[str]:
        """Which of ``ids`` are in ``table.column`` (read on ``con``, default this handle's)."""
        ids = list(ids)
        if not ids:
            return set()
        rows = (
            (con or self.con)
            .execute(
                f"SELECT {quote_identifier(column)} FROM {quote_identifier(table)} "
                f"WHERE {quote_identifier(column)} IN (SELECT unnest(?::VARCHAR[]))",
                [ids],
            )
            .fetchall()
        )
        return {r[0] for r in rows}

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
