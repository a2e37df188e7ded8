"""One DuckDB instance per process; each database file is attached to it.

Starting a DuckDB instance costs ~12 ms (registering its functions and built-in
extensions) and a fresh instance's first reads take first-touch page faults on every
buffer; a process that opens databases again and again (a trainer reading shard files, a
service, a notebook) would pay both on every open. So :func:`attach` ATTACHes the file to
one in-memory instance kept for the process and hands back a connection whose default
catalog is that file (``USE``). Nothing of a file outlives its DETACH: a file reopened
later is read from disk again (its blocks belong to the attached database, which the
DETACH drops, checkpointing first when it was opened for writing).

The same file opened twice in a process shares one attachment (DuckDB refuses to attach
a file twice), as ``duckdb.connect`` shares one instance per file; opening it read-only
while it is open for writing (or the reverse) is refused, as ``duckdb.connect`` does.

Settings made with ``SET`` apply to the whole instance, i.e. to every database of the
process attached here; ``tracedb.connect(..., isolated=True)`` gives a database its own
instance instead (the REST server does, since it turns external access off). The
instance spills to ``tracedb-duckdb-<pid>`` in the system's temporary directory
(``TMPDIR``), not to a ``.tmp`` in the working directory (an in-memory DuckDB's default).

A forked child (a DataLoader worker) goes on with the instance it inherited, as it did
with the instance ``duckdb.connect`` kept per file: DuckDB's registry of open files is
inherited too, so a file the parent holds can only be reached through that instance.
Attachments the child inherited are never detached by it, and the inherited instance is
never destroyed in the child (its destructor would checkpoint the parent's files): the
parent owns those files. Attachments the child makes itself are detached as usual.

Releases may come from a garbage collector's finalizer, which runs in whatever thread
happens to allocate, possibly one inside this module's lock; a release that cannot take
the lock at once is queued and done by the next caller that leaves it.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import duckdb

ROW_GROUP_ROWS = 2048
"""Rows per row group in files tracedb writes (DuckDB's default is 122,880). A
transaction writes each full row group of a table into the file while it inserts
(DuckDB's optimistic writes); with the default a whole ingest of ~20k nodes is compressed
and written at COMMIT instead: 0.30 s of a 0.84 s benchmark ingest, against 0.035 s with
2,048-row groups, whose compression then overlaps the parse of the next batch. The file
grows ~3% and reads are as fast (measured on the benchmark database). The size belongs to
the attachment: a file written by another client keeps the row groups it has."""


@dataclass
class _Attachment:
    alias: str
    read_only: bool
    users: int
    pid: int  # the process that attached it (and may detach it)


class _Instance:
    def __init__(self) -> None:
        self.root = duckdb.connect(":memory:")
        spill = os.path.join(tempfile.gettempdir(), f"tracedb-duckdb-{os.getpid()}")
        self.root.execute(f"SET temp_directory = {_literal(spill)}")
        self.lock = threading.Lock()
        self.attached: dict[str, _Attachment] = {}
        self.names = itertools.count()
        self.pending: deque[tuple[str | None, _Attachment]] = deque()  # releases left to do


_current: _Instance | None = None
_lock = threading.Lock()


def _instance() -> _Instance:
    global _current
    with _lock:
        if _current is None:
            _current = _Instance()
        return _current


def _after_fork_in_child() -> None:
    global _lock
    _lock = threading.Lock()  # another thread may have held them at the fork
    if _current is not None:
        _current.lock = threading.Lock()
        # Never let the child destroy the inherited instance: its destructor would
        # checkpoint the parent's files from the child when the child exits.
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(_current.root))


os.register_at_fork(after_in_child=_after_fork_in_child)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def _key(path: str) -> str | None:
    """Registry key: None for a fresh in-memory database (``":memory:"`` or ``""``); a
    named one (``":memory:name"``) is shared by name, as ``duckdb.connect`` does."""
    if path in ("", ":memory:"):
        return None
    if path.startswith(":memory:"):
        return path
    return os.path.realpath(path)


def _alias(inst: _Instance, path: str) -> str:
    """A catalog name that says which file it is (it shows in DuckDB's messages)."""
    stem = os.path.basename(path).split(".")[0] if not path.startswith(":memory:") and path else "memory"
    stem = "".join(c if c.isalnum() or c == "_" else "_" for c in stem)[:40] or "db"
    return f"{stem}_{next(inst.names)}"


def attach(path: str, *, read_only: bool) -> tuple[duckdb.DuckDBPyConnection, str, bool, Callable[[], None]]:
    """Attach ``path`` (``":memory:"``: a new in-memory database) to the process's
    instance; returns a connection using it, its catalog name, whether this call attached
    it (False: it was open already) and the release function (idempotent; the last
    release of a file DETACHes it).

    Raises ``duckdb.ResourceInUseException`` when another DuckDB instance of the process
    (a plain ``duckdb.connect``) has the file open."""
    inst = _instance()
    key = _key(path)
    try:
        with inst.lock:
            found = inst.attached.get(key) if key is not None else None
            if found is not None:
                if found.read_only != read_only:
                    mode = "read-only" if found.read_only else "read-write"
                    raise duckdb.ConnectionException(
                        f"{path} is already open {mode} in this process; close it first "
                        "(DuckDB opens a file in one mode per process)"
                    )
                found.users += 1
                attachment, fresh = found, False
            else:
                alias = _alias(inst, path)
                target = path if key is not None and not key.startswith(":memory:") else ":memory:"
                if read_only:
                    options = " (READ_ONLY)"
                elif target != ":memory:":
                    options = f" (ROW_GROUP_SIZE {ROW_GROUP_ROWS})"
                else:
                    options = ""
                inst.root.execute(f"ATTACH {_literal(target)} AS {_identifier(alias)}{options}")
                attachment, fresh = _Attachment(alias, read_only, 1, os.getpid()), True
                if key is not None:
                    inst.attached[key] = attachment
    finally:
        _drain(inst)
    try:
        con = inst.root.cursor()
        con.execute(f"USE {_identifier(attachment.alias)}")
    except BaseException:
        _release(inst, key, attachment)
        raise
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            _release(inst, key, attachment)

    return con, attachment.alias, fresh, release


def is_attached(path: str) -> bool:
    """Whether a database of this process has ``path`` open (a benchmark reading "from
    the file" checks that it is not)."""
    inst = _current
    if inst is None:
        return False
    _drain(inst)
    with inst.lock:
        found = _key(path) in inst.attached
    _drain(inst)
    return found


def _release(inst: _Instance, key: str | None, attachment: _Attachment) -> None:
    inst.pending.append((key, attachment))
    _drain(inst)


def _drain(inst: _Instance) -> None:
    """Do the queued releases, unless another frame (of this thread, under a finalizer,
    or of another thread) holds the lock: that one drains them when it leaves."""
    while inst.pending:
        if not inst.lock.acquire(blocking=False):
            return
        try:
            while inst.pending:
                key, attachment = inst.pending.popleft()
                _drop(inst, key, attachment)
        finally:
            inst.lock.release()


def _drop(inst: _Instance, key: str | None, attachment: _Attachment) -> None:
    """One user fewer; the last one in the process that attached it detaches (called
    with the lock held)."""
    attachment.users -= 1
    if attachment.users > 0 or attachment.pid != os.getpid():
        return  # still used, or inherited over fork: the parent owns the file
    if key is not None and inst.attached.get(key) is attachment:
        del inst.attached[key]
    inst.root.execute(f"DETACH DATABASE IF EXISTS {_identifier(attachment.alias)}")
