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
instance instead (the REST server does, since it turns external access off).

A forked child starts a new instance on its first attach: an instance's threads do not
survive ``fork``. Databases it inherited keep working on the old one, and their close
leaves the file alone (the parent owns it).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

import duckdb


@dataclass
class _Attachment:
    alias: str
    read_only: bool
    users: int


class _Instance:
    def __init__(self) -> None:
        self.root = duckdb.connect(":memory:")
        self.pid = os.getpid()
        self.lock = threading.Lock()
        self.attached: dict[str, _Attachment] = {}
        self.names = itertools.count()


_current: _Instance | None = None
_lock = threading.Lock()
_inherited: list[_Instance] = []  # kept alive, never closed: their threads are gone


def _instance() -> _Instance:
    global _current
    with _lock:
        if _current is None:
            _current = _Instance()
        return _current


def _forget_after_fork() -> None:
    global _current, _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _current is not None:
        _inherited.append(_current)
        _current.lock = threading.Lock()
        _current = None


os.register_at_fork(after_in_child=_forget_after_fork)


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _identifier(name: str) -> str:
    return '"' + name.replace('"', '""') + '"'


def attach(path: str, *, read_only: bool) -> tuple[duckdb.DuckDBPyConnection, str, Callable[[], None]]:
    """Attach ``path`` (``":memory:"``: a new in-memory database) to the process's
    instance; returns a connection using it, its catalog name and the release function
    (idempotent; the last release of a file DETACHes it)."""
    inst = _instance()
    key = path if path == ":memory:" else os.path.realpath(path)
    with inst.lock:
        found = inst.attached.get(key) if path != ":memory:" else None
        if found is not None:
            if found.read_only != read_only:
                mode = "read-only" if found.read_only else "read-write"
                raise duckdb.ConnectionException(
                    f"{path} is already open {mode} in this process; close it first "
                    "(DuckDB opens a file in one mode per process)"
                )
            found.users += 1
            attachment = found
        else:
            alias = f"tracedb_{next(inst.names)}"
            options = " (READ_ONLY)" if read_only else ""
            inst.root.execute(f"ATTACH {_literal(path)} AS {_identifier(alias)}{options}")
            attachment = _Attachment(alias, read_only, 1)
            if path != ":memory:":
                inst.attached[key] = attachment
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

    return con, attachment.alias, release


def is_attached(path: str) -> bool:
    """Whether a database of this process has ``path`` open (a benchmark reading "from
    the file" checks that it is not)."""
    inst = _current
    if inst is None:
        return False
    with inst.lock:
        return os.path.realpath(path) in inst.attached


def _release(inst: _Instance, key: str, attachment: _Attachment) -> None:
    if inst.pid != os.getpid():
        return  # inherited over fork: the parent owns the file
    with inst.lock:
        attachment.users -= 1
        if attachment.users > 0:
            return
        if inst.attached.get(key) is attachment:
            del inst.attached[key]
        inst.root.execute(f"DETACH {_identifier(attachment.alias)}")
