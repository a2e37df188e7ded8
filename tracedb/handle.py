"""The internal handle on one open database: its connection, its transaction, the small
SQL helpers, the schema install and version check, and what a write invalidates.

Every module below the :class:`tracedb.Database` facade takes a :class:`Handle` and uses
only the documented members here; none of them imports the facade. ``Handle.open``
attaches a file to the process's DuckDB instance (:mod:`tracedb.runtime`), installs the
schema when it opens a file for writing, and refuses a file of another schema version.

A handle serves one thread at a time (a DuckDB connection does). :meth:`Handle.child`
gives another thread a handle of its own on the same database. Every handle on one file
of the process shares its :class:`~tracedb.runtime.Shared` state (write counter, write
lock, change condition), so a write through any of them makes every view cached on any
of them stale;
:class:`PerThread` is one object that hands each calling thread its own child (the REST
server reads through one).
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa

from tracedb import migrations, publish, runtime, sqlvalues
from tracedb.errors import DatabaseError, DatabaseLocked, SchemaVersionError
from tracedb.migrations import SCHEMA_VERSION
from tracedb.sqltext import load_sql, quote_identifier

TRACE_FILE_SUFFIXES = (".jsonl", ".json", ".zst", ".ndjson")
"""A database path ending so names a trace file: almost always swapped arguments."""
_LOCK = re.compile(r"Could not set lock on file .*?Conflicting lock is held in (?P<program>.*?) \(PID (?P<pid>\d+)\)")


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
        self._release = release

    @classmethod
    def open(cls, path: str | Path = ":memory:", *, read_only: bool = False, isolated: bool = False) -> Handle:
        """Open (creating if needed) a tracedb database; see :func:`tracedb.connect`.

        Refused with :class:`DatabaseError`, before anything is created or written: a
        path that names a trace file (``.jsonl``, ``.json``, ``.zst``), an existing file
        that is not a DuckDB database, a DuckDB database that is not a tracedb one, a file
        another process holds (:class:`DatabaseLocked`), and a schema version this
        tracedb cannot read (:class:`SchemaVersionError`). A read-write open of an older
        file upgrades it in place (:mod:`tracedb.migrations`)."""
        text = str(path)
        check_path(text)
        fresh = True
        handle = None
        own_instance = isolated  # asked for: its limits are the process's (not so when joining another's)
        try:
            if not read_only:
                create_whole(text)
            if not isolated:
                try:
                    con, catalog, fresh, shared, release = runtime.attach(text, read_only=read_only)
                    handle = cls(
                        con,
                        path=text,
                        catalog=catalog,
                        instance_key="shared",
                        read_only=read_only,
                        release=release,
                        shared=shared,
                    )
                    # A handle dropped without close() still detaches its file.
                    handle._release = weakref.finalize(handle, _close_then, con, release)
                except duckdb.ResourceInUseException:
                    isolated = True  # a plain duckdb.connect of this process holds it: join that instance
            if isolated:
                if own_instance:
                    con = runtime.connect_isolated(text, read_only=read_only)
                else:
                    con = duckdb.connect(text, read_only=read_only)
                handle = cls(con, path=text, catalog=None, instance_key=con, read_only=read_only, release=con.close)
        except duckdb.IOException as e:
            raise _refusal(text, e, read_only) from None
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
            shared=self.shared,
        )

    # ----------------------------------------------------------------- lifecycle

    def install(self) -> None:
        """Create the tables and macros of a new file, or bring an existing one up to
        date: upgrade an older schema, repair a first install that was cut short, rewrite
        the macros when they changed. Each in one transaction; a file of another kind is
        refused before anything is written to it."""
        tables = self.table_names()
        if "tracedb_meta" not in tables:
            if tables:
                raise DatabaseError(
                    f"{self.path} is a DuckDB database but not a tracedb one (it has {', '.join(sorted(tables)[:5])}"
                    f"{', ...' if len(tables) > 5 else ''} and no tracedb_meta); tracedb does not write into it"
                )
            with self.transaction():
                self.con.execute(load_sql("tables.sql"))
                self.con.execute("INSERT INTO tracedb_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
                self._install_macros()
            return
        found = self.stored_version()
        if found is None:
            self._repair()
        elif found < SCHEMA_VERSION and migrations.can_upgrade(found):
            with self.transaction():
                migrations.upgrade(self.con, found)
                self._install_macros()
        elif found != SCHEMA_VERSION:
            self.check_version()  # refused, naming both versions
        if self.scalar("SELECT value FROM tracedb_meta WHERE key = 'macros_sha256'") != _macros_digest():
            with self.transaction():
                self._install_macros()

    def _install_macros(self) -> None:
        """(Re)write the macros and remember which text they are (a read-write open then
        skips writing them again: each rewrite grows the WAL)."""
        self.con.execute(load_sql("macros.sql"))
        self.con.execute("INSERT OR REPLACE INTO tracedb_meta VALUES ('macros_sha256', ?)", [_macros_digest()])

    def _repair(self) -> None:
        """A file with tracedb's tables but no version row: a first install killed before
        it committed it (older tracedb installed table by table). Empty, it is finished now;
        holding data, it is refused (its version cannot be told)."""
        self._refuse_unversioned_rows()
        with self.transaction():
            self.con.execute(load_sql("tables.sql"))
            self.con.execute("DELETE FROM tracedb_meta WHERE key = 'schema_version'")
            self.con.execute("INSERT INTO tracedb_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
            self._install_macros()

    def _refuse_unversioned_rows(self) -> None:
        """Refuse a file without a version row that holds data (its version cannot be told)."""
        known = (
            "episodes",
            "traces",
            "nodes",
            "segments",
            "branches",
            "rejects",
            "credit_sets",
            "credit",
            "trace_credit",
        )
        present = [t for t in known if t in self.table_names()]
        rows = sum(self.scalar(f"SELECT count(*) FROM {quote_identifier(t)}") for t in present)
        if rows:
            raise SchemaVersionError(
                f"{self.path} has tracedb's tables and {rows} rows but no schema version; it cannot be read safely"
            )

    def table_names(self) -> set[str]:
        """The tables of this database (not of the other databases of the instance)."""
        rows = self.con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
            "AND schema_name = current_schema()"
        ).fetchall()
        return {r[0] for r in rows}

    def stored_version(self) -> int | None:
        """The file's schema version (None when it has none)."""
        value = self.scalar("SELECT value FROM tracedb_meta WHERE key = 'schema_version'")
        return None if value is None else int(value)

    def check_version(self) -> None:
        """Raise unless the file holds this tracedb's schema version: a file that is not a
        tracedb database, an older one opened read-only (how to upgrade it is said), a newer one."""
        if "tracedb_meta" not in self.table_names():
            raise DatabaseError(f"{self.path} is not a tracedb database (no tracedb_meta table)")
        found = self.stored_version()
        if found == SCHEMA_VERSION:
            return
        if found is None:
            self._refuse_unversioned_rows()  # holding data, it cannot be repaired either
            raise SchemaVersionError(
                f"{self.path}: no schema version (a first install cut short); open it read-write once to repair it"
            )
        if found < SCHEMA_VERSION and not migrations.can_upgrade(found):
            raise SchemaVersionError(
                f"{self.path}: schema version {found} is older than any this tracedb upgrades "
                f"(it reads {SCHEMA_VERSION} and upgrades from {min(migrations.MIGRATIONS)} on)"
            )
        if found < SCHEMA_VERSION:
            raise SchemaVersionError(
                f"{self.path}: schema version {found}, this tracedb reads {SCHEMA_VERSION}; upgrade the file "
                f"with `tracedb migrate --db {self.path}` (or open it read-write once)"
            )
        raise SchemaVersionError(
            f"{self.path}: schema version {found} is newer than this tracedb reads ({SCHEMA_VERSION}); "
            "upgrade tracedb to read it"
        )

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
        return self.shared.generation

    def watermark(self, con: Any = None) -> int:
        """The highest ingest sequence number committed (0 before the first trace), as
        ``con`` (default: this handle's connection, in its transaction if one is open) sees it."""
        rows = (con or self.con).execute("SELECT value FROM tracedb_meta WHERE key = 'last_seq'").fetchall()
        return int(rows[0][0]) if rows else 0

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


def check_path(path: str) -> None:
    """Refuse, before anything is created, a database path that names a trace file or an
    existing file that is not a DuckDB database."""
    if path in ("", ":memory:") or path.startswith(":memory:"):
        return
    if os.path.basename(path).lower().endswith(TRACE_FILE_SUFFIXES):
        raise DatabaseError(
            f"{path} names a trace file, not a database (a database is a .duckdb file); were the arguments swapped?"
        )
    if os.path.isdir(path):
        raise DatabaseError(f"{path} is a directory, not a database file")
    if os.path.exists(path):
        with open(path, "rb") as f:
            head = f.read(12)
        if head[8:12] != b"DUCK":
            raise DatabaseError(
                f"{path} exists and is not a DuckDB database ({'empty' if not head else 'another kind of file'}); "
                "tracedb does not overwrite it"
            )


def create_whole(path: str) -> None:
    """Put a new database file at ``path`` whole, if there is none: made by DuckDB under a
    name of its own beside it, then linked into place. (ATTACH creates the file empty and
    writes its header after; a process killed between the two left an empty file that
    neither DuckDB nor tracedb opens again.) A killed creation leaves at most the hidden
    ``.NAME.*.creating`` file, never a part of a file at ``path``."""
    if path in ("", ":memory:") or path.startswith(":memory:") or os.path.lexists(path):
        return
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return  # ATTACH says what is wrong
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.{os.urandom(4).hex()}.creating")
    try:
        con, _, _, _, release = runtime.attach(tmp, read_only=False)
        con.close()
        release()  # detached: a whole, empty DuckDB file
        publish.sync_file(Path(tmp))
        try:
            os.link(tmp, path)  # fails if another process made it meanwhile: that one stands
        except FileExistsError:
            pass
        except OSError:  # no hard links here
            if not os.path.lexists(path):
                os.rename(tmp, path)
        publish.sync_dir(Path(folder))  # the new name survives a crash of the machine
    finally:
        for leftover in (tmp, tmp + ".wal"):
            if os.path.lexists(leftover):
                os.unlink(leftover)


def _refusal(path: str, error: duckdb.IOException, read_only: bool) -> DatabaseError:
    """DuckDB's lock conflict as one line: the file, the holder, what to do."""
    found = _LOCK.search(str(error))
    if found is None:
        return DatabaseError(f"{path}: {error}")
    pid = int(found["pid"])
    if read_only:
        what = (
            f"{path} is open for writing in another process (PID {pid}, {found['program']}): stop it, "
            "or query it through the server that holds it (its REST API)"
        )
    else:
        what = (
            f"{path} is open in another process (PID {pid}, {found['program']}), so it cannot be opened for "
            "writing here: stop that process, or open the file read-only"
        )
    return DatabaseLocked(what, pid)


def _macros_digest() -> str:
    return hashlib.sha256(load_sql("macros.sql").encode()).hexdigest()


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
