"""A database file opened: the path checks, the file made whole, the schema installed,
upgraded or repaired, the version checked.

:func:`open_handle` is how every :class:`~tracedb.handle.Handle` on a file comes to be
(the facade's, the REST server's root): it refuses, before anything is created or
written, a path that names a trace file, an existing file that is not a DuckDB database,
a DuckDB database that is not a tracedb one, a file another process holds, and a schema
version this tracedb cannot read; a read-write open of an older file upgrades it in
place (:mod:`tracedb.migrations`), and rewrites the macros when they changed.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path

import duckdb

from tracedb import migrations, publish, runtime
from tracedb.errors import DatabaseError, DatabaseLocked, SchemaVersionError
from tracedb.handle import Handle
from tracedb.migrations import SCHEMA_VERSION
from tracedb.sqltext import load_sql, quote_identifier, quote_literal

TRACE_FILE_SUFFIXES = (".jsonl", ".json", ".zst", ".ndjson")
"""A database path ending so names a trace file: almost always swapped arguments."""
_LOCK = re.compile(r"Could not set lock on file .*?Conflicting lock is held in (?P<program>.*?) \(PID (?P<pid>\d+)\)")
_DATA_TABLES = (
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


def open_handle(path: str | Path = ":memory:", *, read_only: bool = False, isolated: bool = False) -> Handle:
    """Open (creating if needed) a tracedb database; see :func:`tracedb.connect`.

    Refused with :class:`DatabaseError`, before anything is created or written: a path
    that names a trace file (``.jsonl``, ``.json``, ``.zst``), an existing file that is not
    a DuckDB database, a DuckDB database that is not a tracedb one, a file another process
    holds (:class:`DatabaseLocked`), and a schema version this tracedb cannot read
    (:class:`SchemaVersionError`). A read-write open of an older file upgrades it in place."""
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
                handle = Handle(
                    con,
                    path=text,
                    catalog=catalog,
                    instance_key="shared",
                    read_only=read_only,
                    release=release,
                    shared=shared,
                )
                handle.release_when_dropped()
            except duckdb.ResourceInUseException:
                isolated = True  # a plain duckdb.connect of this process holds it: join that instance
        if isolated:
            if own_instance:
                con = runtime.connect_isolated(text, read_only=read_only)
            else:
                con = duckdb.connect(text, read_only=read_only)
            handle = Handle(con, path=text, catalog=None, instance_key=con, read_only=read_only, release=con.close)
    except duckdb.IOException as e:
        raise _refusal(text, e, read_only) from None
    assert handle is not None
    try:
        if not read_only and fresh:  # an attachment shared with another handle is installed
            install(handle)
        check_version(handle)
        if read_only:
            _session_macros(handle)
    except BaseException:
        handle.close()  # a refused file is not kept open
        raise
    return handle


# --------------------------------------------------------------------------- the schema


def install(handle: Handle) -> None:
    """Create the tables and macros of a new file, or bring an existing one up to date:
    upgrade an older schema, repair a first install that was cut short, rewrite the macros
    when they changed. Each in one transaction; a file of another kind is refused before
    anything is written to it."""
    tables = handle.table_names()
    if "tracedb_meta" not in tables:
        if tables:
            raise DatabaseError(
                f"{handle.path} is a DuckDB database but not a tracedb one (it has {', '.join(sorted(tables)[:5])}"
                f"{', ...' if len(tables) > 5 else ''} and no tracedb_meta); tracedb does not write into it"
            )
        with handle.transaction():
            handle.con.execute(load_sql("tables.sql"))
            handle.con.execute("INSERT INTO tracedb_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
            _install_macros(handle)
        return
    found = handle.stored_version()
    if found is None:
        _repair(handle)
    elif found < SCHEMA_VERSION and migrations.can_upgrade(found):
        with handle.transaction():
            migrations.upgrade(handle.con, found)
            _install_macros(handle)
    elif found != SCHEMA_VERSION:
        check_version(handle)  # refused, naming both versions
    if handle.scalar("SELECT value FROM tracedb_meta WHERE key = 'macros_sha256'") != _macros_digest():
        with handle.transaction():
            _install_macros(handle)


def _install_macros(handle: Handle) -> None:
    """(Re)write the macros and remember which text they are (a read-write open then skips
    writing them again: each rewrite grows the WAL)."""
    handle.con.execute(load_sql("encoded.sql"))  # nodes and segments decoded: the macros read them
    handle.con.execute(load_sql("macros.sql"))
    handle.con.execute("INSERT OR REPLACE INTO tracedb_meta VALUES ('macros_sha256', ?)", [_macros_digest()])


def _session_macros(handle: Handle) -> None:
    """A file opened read-only whose stored macros are not this tracedb's (written by an
    older or newer release of the same schema) gets this tracedb's macros as temporary
    ones, on this connection and every cursor the handle makes: they are found before the
    file's, so the views and SQL a reader runs are the ones its code expects, and nothing
    is written to the file."""
    if handle.scalar("SELECT value FROM tracedb_meta WHERE key = 'macros_sha256'") == _macros_digest():
        return
    # The decoding macros too (the file's own views read them by name, so the temporary
    # ones are what they run), not the views (a file of this schema holds the same).
    text = _VIEW.sub("", load_sql("encoded.sql")) + load_sql("macros.sql")
    text = _TEMP_MACRO.sub("CREATE OR REPLACE TEMP MACRO", text)
    handle.session_sql = text
    handle.con.execute(text)


_TEMP_MACRO = re.compile(r"^CREATE OR REPLACE MACRO", re.MULTILINE)
_VIEW = re.compile(r"^CREATE OR REPLACE VIEW .*?;$", re.MULTILINE | re.DOTALL)


def _repair(handle: Handle) -> None:
    """A file with tracedb's tables but no version row: a first install killed before it
    committed it (older tracedb installed table by table). Empty, it is finished now;
    holding data, it is refused (its version cannot be told)."""
    _refuse_unversioned_rows(handle)
    with handle.transaction():
        handle.con.execute(load_sql("tables.sql"))
        handle.con.execute("DELETE FROM tracedb_meta WHERE key = 'schema_version'")
        handle.con.execute("INSERT INTO tracedb_meta VALUES ('schema_version', ?)", [str(SCHEMA_VERSION)])
        _install_macros(handle)


def _refuse_unversioned_rows(handle: Handle) -> None:
    """Refuse a file without a version row that holds data (its version cannot be told)."""
    present = [t for t in _DATA_TABLES if t in handle.table_names()]
    rows = sum(handle.scalar(f"SELECT count(*) FROM {quote_identifier(t)}") for t in present)
    if rows:
        raise SchemaVersionError(
            f"{handle.path} has tracedb's tables and {rows} rows but no schema version; it cannot be read safely"
        )


def check_version(handle: Handle) -> None:
    """Raise unless the file holds this tracedb's schema version: a file that is not a
    tracedb database, an older one opened read-only (how to upgrade it is said), a newer one."""
    if "tracedb_meta" not in handle.table_names():
        raise DatabaseError(f"{handle.path} is not a tracedb database (no tracedb_meta table)")
    found = handle.stored_version()
    if found == SCHEMA_VERSION:
        return
    path = handle.path
    if found is None:
        _refuse_unversioned_rows(handle)  # holding data, it cannot be repaired either
        raise SchemaVersionError(
            f"{path}: no schema version (a first install cut short); open it read-write once to repair it"
        )
    if found < SCHEMA_VERSION and not migrations.can_upgrade(found):
        raise SchemaVersionError(
            f"{path}: schema version {found} is older than any this tracedb upgrades "
            f"(it reads {SCHEMA_VERSION} and upgrades from {min(migrations.MIGRATIONS)} on)"
        )
    if found < SCHEMA_VERSION:
        raise SchemaVersionError(
            f"{path}: schema version {found}, this tracedb reads {SCHEMA_VERSION}; upgrade the file "
            f"with `tracedb migrate --db {path}` (or open it read-write once)"
        )
    raise SchemaVersionError(
        f"{path}: schema version {found} is newer than this tracedb reads ({SCHEMA_VERSION}); "
        "upgrade tracedb to read it"
    )


def _macros_digest() -> str:
    """The digest of the SQL installed beside the tables: the views of the encoded tables
    and the macros."""
    return hashlib.sha256((load_sql("encoded.sql") + load_sql("macros.sql")).encode()).hexdigest()


# --------------------------------------------------------------------------- the file


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
        con, _, _, _, release = runtime.attach(tmp, read_only=False, block_size=runtime.BLOCK_SIZE)
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


def storage_version(con: duckdb.DuckDBPyConnection, catalog: str) -> str | None:
    """The storage format of attached database ``catalog`` (DuckDB's ``v1.5.0+``, ``v2.0.0+``)."""
    row = con.execute("SELECT tags FROM duckdb_databases() WHERE database_name = ?", [catalog]).fetchone()
    return None if row is None else dict(row[0] or {}).get("storage_version")


def rewrite_storage(path: str | Path) -> dict[str, str | bool | None]:
    """Rewrite the database file ``path`` into :data:`tracedb.runtime.STORAGE_VERSION`
    (a file DuckDB 1.5 reads) unless it is in it: every table, constraint and macro copied
    (``COPY FROM DATABASE``) into a new file beside it, which is fsynced and renamed over
    ``path`` (mode kept), the directory fsynced. The file is held read-only meanwhile, so
    no writer changes it under the copy; a failure or a crash leaves ``path`` as it was
    (at most a hidden ``.NAME.*.rewriting`` beside it). Refused (:class:`DatabaseError`)
    with a WAL beside it: a read-write open checkpoints that first (``tracedb migrate``
    does). Returns the format before and after, and whether it was rewritten."""
    text = str(path)
    check_path(text)
    if not os.path.exists(text):
        raise DatabaseError(f"no database at {text}")
    if os.path.exists(text + ".wal"):
        raise DatabaseError(f"{text} has a write-ahead log beside it: open it read-write once to checkpoint it first")
    target = runtime.STORAGE_VERSION + "+"
    con = duckdb.connect()  # an instance of its own: the copy's settings touch nothing else
    folder, name = os.path.split(os.path.abspath(text))
    tmp = os.path.join(folder, f".{name}.{os.getpid()}.{os.urandom(4).hex()}.rewriting")
    try:
        try:
            con.execute(f"ATTACH {quote_literal(text)} AS src (READ_ONLY)")
        except duckdb.IOException as e:
            raise _refusal(text, e, True) from None
        before = storage_version(con, "src")
        if before == target:
            return {"path": text, "from_storage": before, "to_storage": before, "rewritten": False}
        con.execute(
            f"ATTACH {quote_literal(tmp)} AS dst (ROW_GROUP_SIZE {runtime.ROW_GROUP_ROWS}, "
            f"BLOCK_SIZE {runtime.BLOCK_SIZE}{runtime.creation_options(tmp)})"
        )
        con.execute("COPY FROM DATABASE src TO dst")
        after = storage_version(con, "dst")
        con.execute("DETACH dst")  # checkpointed: the file is whole, no WAL
        os.chmod(tmp, os.stat(text).st_mode & 0o7777)
        publish.sync_file(Path(tmp))
        os.replace(tmp, text)  # while src is still held: no writer got in between
        publish.sync_dir(Path(folder))
        return {"path": text, "from_storage": before, "to_storage": after, "rewritten": True}
    finally:
        con.close()
        for leftover in (tmp, tmp + ".wal"):
            if os.path.lexists(leftover):
                os.unlink(leftover)


def _refusal(path: str, error: duckdb.IOException, read_only: bool) -> DatabaseError:
    """DuckDB's lock conflict as one line: the file, the holder (what it runs, when it can
    be told), what to do."""
    found = _LOCK.search(str(error))
    if found is None:
        return DatabaseError(f"{path}: {error}")
    pid = int(found["pid"])
    command = holder_command(pid)
    holder = f"PID {pid}, {_shortened(command) if command else found['program']}"
    if read_only:
        what = f"{path} is open for writing in another process ({holder}): {_what_to_do(command)}"
    else:
        what = (
            f"{path} is open in another process ({holder}), so it cannot be opened for "
            "writing here: stop that process, or open the file read-only"
        )
    return DatabaseLocked(what, pid)


def holder_command(pid: int) -> str | None:
    """The command line of process ``pid`` (``tracedb ingest --follow ...``), from
    ``/proc``; None where it cannot be read (another OS, another user's process)."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").split(b"\0")
    except OSError:
        return None
    words = [os.fsdecode(a) for a in argv if a]
    for i, word in enumerate(words):  # python -m tracedb ... / .venv/bin/tracedb ...
        if os.path.basename(word) == "tracedb" or (word == "-m" and words[i + 1 : i + 2] == ["tracedb"]):
            start = i + 1 if word != "-m" else i + 2
            return _one_line(["tracedb", *words[start:]])
    return _one_line(words) or None


def _one_line(words: list[str]) -> str:
    """A command line on one line (an argument holding line breaks, a ``python -c``
    program, is folded)."""
    return " ".join(" ".join(word.split()) for word in words)


def _shortened(command: str, limit: int = 600) -> str:
    """A holder's command line as an error shows it: whole unless it is very long (a
    ``python -c`` program); what to do is decided from the whole line, not this."""
    return command if len(command) <= limit else command[: limit - 1] + "…"


def _what_to_do(command: str | None) -> str:
    """What a reader can do about a file another process writes, by what that process is."""
    words = (command or "").split()
    if words[:2] == ["tracedb", "serve"]:
        return "read it through that server (--url, or its REST API)"
    if words[:2] == ["tracedb", "ingest"] and "--follow" in words:
        return (
            "a follower holds the file while it runs; to read a run while it is followed, follow it with "
            "`tracedb serve --follow RUN --db FILE` instead and read through the server (--url), "
            "or stop the follower (Ctrl-C) and read the file"
        )
    return "stop it (or let it finish), then read the file"
