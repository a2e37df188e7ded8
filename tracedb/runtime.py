"""Everything tracedb keeps per process, in one place, with one fork hook.

- **Settings** (:class:`Settings`): the knobs of ingest, views and the buffer pool.
  :func:`settings` reads them, :func:`configure` changes some for a ``with`` block.
- **The DuckDB instance** (:func:`attach`): every database a process opens is attached
  to one in-memory DuckDB instance (below).
- **The view buffer pool**: idle memory mappings that view columns reuse
  (:mod:`tracedb.views._buffers` hands them out; :func:`idle_mappings` is the pool).
- **The thread pool** that reads segments beside a view's main read (:func:`threads`).
- **The checkpoint threshold** ingest lowers around its COMMIT (:func:`lowered_checkpoint`).

:func:`reset` puts the process back to its first state (settings from the environment,
no pool, no threads; the instance is dropped when no database is attached): tests call
it between cases that turn knobs. A forked child (a DataLoader worker) keeps the
instance it inherited (see below), starts with an empty buffer pool and no threads.

The DuckDB instance in detail.

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

import contextlib
import ctypes
import dataclasses
import itertools
import mmap
import os
import tempfile
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import duckdb

from tracedb.sqltext import quote_identifier, quote_literal

BLOCK_SIZE = 65_536
"""Bytes per block of a file tracedb creates (DuckDB's default is 256 KiB). A table's
last row group, and each small table, fills a block of its own part-way, and a string
spills into whole blocks: at 256 KiB the benchmark files carried ~4 MB of unused block
ends. Not smaller: DuckDB 2.0 writes integers and lists uncompressed in 16 KiB blocks
(token ids 29.8 MB instead of 17.3 on the core workload, measured)."""

ROW_GROUP_ROWS = 2048
"""Rows per row group in files tracedb writes (DuckDB's default is 122,880). A
transaction writes each full row group of a table into the file while it inserts
(DuckDB's optimistic writes); with the default a whole ingest of ~20k nodes is compressed
and written at COMMIT instead: 0.30 s of a 0.84 s benchmark ingest, against 0.035 s with
2,048-row groups, whose compression then overlaps the parse of the next batch. The file
grows ~3% and reads are as fast (measured on the benchmark database). The size belongs to
the attachment: a file written by another client keeps the row groups it has. DuckDB
takes multiples of its vector size (2,048) only."""

STORAGE_VERSION = "v1.5.0"
"""The DuckDB storage format of files tracedb creates: the last stable 1.x line's (DuckDB
1.5 reads it: the ``duckdb`` CLI a user installs, ``pip install duckdb-cli``), where
DuckDB 2.0's own default is a format no 1.x reads. On the core benchmark workload the two
files hold the same bytes and every column segment the same compression (measured,
docs/performance.md), so nothing is paid for it. A file keeps the format it was made with;
``tracedb migrate`` rewrites an older file into this one (:func:`tracedb.dbfile.rewrite_storage`)."""


def creation_options(path: str) -> str:
    """ATTACH options for ``path`` if attaching it creates it (the storage format), else ''."""
    return "" if os.path.exists(path) else f", STORAGE_VERSION {quote_literal(STORAGE_VERSION)}"


def _pool_bytes_from_env() -> int:
    return int(os.environ.get("TRACEDB_BUFFER_POOL_MB", "1024")) << 20


DEFAULT_MEMORY_LIMIT = "1GiB"
DEFAULT_TEMP_LIMIT = "16GiB"


def _temp_limit_from_env() -> str | None:
    value = os.environ.get("TRACEDB_TEMP_LIMIT") or DEFAULT_TEMP_LIMIT
    return None if value.lower() == "none" else value


def _memory_limit_from_env() -> str | None:
    value = os.environ.get("TRACEDB_MEMORY_LIMIT") or DEFAULT_MEMORY_LIMIT
    return None if value.lower() == "none" else value


@dataclass(frozen=True)
class Settings:
    """The knobs of one process. Read with :func:`settings`; change with :func:`configure`."""

    chunk_bytes: int = 4 << 20
    """Ingest reads files in chunks of whole lines of at least this many bytes (a chunk
    grows to hold a longer line)."""
    batch_tokens: int = 1_000_000
    """Ingest writes its buffered rows after this many tokens (checked at chunk ends),
    which bounds its memory whatever the input size."""
    scanner: str = "auto"
    """Which parser ingest reads lines with. The compiled scanner takes every line it can
    vouch for (the parser the rest); it is compiled once per install (~20 s on 2 cores)
    and loaded once per process (numba's import and its cache: ~0.4 s of CPU), after which
    it reads a MB in ~7 ms less than the parser. ``auto`` uses it when this process has
    loaded it already, or when the input is at least ``scanner_load_bytes`` (compiled) or
    ``scanner_min_bytes`` (not compiled yet), so a small ingest neither waits for the
    compile nor pays the load; ``always`` and ``never`` decide for every input (both paths
    store the same; tests compare them line by line)."""
    scanner_min_bytes: int = 50 << 20
    """With ``scanner="auto"``: the input size from which ingest compiles the scanner."""
    scanner_load_bytes: int = 32 << 20
    """With ``scanner="auto"`` and the scanner compiled but not loaded in this process:
    the input size from which loading it pays (measured: docs/performance.md)."""
    scan_ahead: str = "auto"
    """Whether the scanner reads the next chunk on a second thread while this one's lines
    go into the batch. ``auto`` does when the process may run on two CPUs or more
    (:func:`spare_core`): pinned to one, the two threads could only take turns; on a
    loaded machine (load 4-17 on 2 cores, measured) the second thread lost no wall time
    (medians 5-10% lower, within the noise, at the same CPU), so the load does not
    decide. ``always`` and ``never`` decide for every ingest."""
    follow_batch_bytes: int = 64 << 20
    """A follower reads about this many new bytes per transaction at most (more when one
    line is longer), so a backlog is committed in steps."""
    follow_open_files: int = 512
    """A follower keeps a descriptor open on at most this many of its plain files (the
    ones that grew last), so that a file renamed away or deleted is still read to its end;
    past it, a renamed file is found by its inode in its directory."""
    max_line_bytes: int = 128 << 20
    """A line longer than this is rejected without being read into memory."""
    reject_record_bytes: int = 64 << 10
    """A rejected line is kept in ``rejects.record`` up to this many bytes (with its whole
    length and SHA-256 beside it)."""
    write_alignment_rows: int = ROW_GROUP_ROWS
    """Ingest inserts whole multiples of this many rows per table and holds the rest for
    the next batch (see :data:`ROW_GROUP_ROWS`)."""
    checkpoint_at_commit: str = "0b"
    """DuckDB's checkpoint threshold while a large ingest commits (so it writes into the
    file, not the WAL first). Zero: whether the commit is large is judged here
    (``checkpoint_min_tokens``); DuckDB's own estimate counts a transaction's rows at
    their types' fixed widths plus its key indexes, not the bytes of its strings and lists,
    so schema 7's index-free tables estimate a 240k-token ingest under 1 MB (with a
    1 MB threshold it stayed in a 1.5 MB WAL)."""
    checkpoint_min_tokens: int = 1_000_000
    """An ingest adding fewer tokens commits into the WAL, without the lowered threshold
    (a checkpoint rewrites the key indexes whole; a follower's small commits leave it to
    DuckDB's own threshold)."""
    stream_rows: int = 1 << 16
    """Rows per batch of a view's flat reads."""
    segment_lookup: int = 1000
    """A view of a selection looks its segments up by a literal list up to this many
    (through the key's index), else it joins."""
    view_cache_tokens: int = 200_000_000
    """A database keeps the decoded nodes of its last view up to this many tokens."""
    buffer_pool_bytes: int = dataclasses.field(default_factory=_pool_bytes_from_env)
    """Idle view-column mappings kept for reuse, at most (``TRACEDB_BUFFER_POOL_MB``,
    default 1024 MiB; 0 turns the pool off)."""
    buffer_min_bytes: int = 1 << 20
    """View columns under this size come from Arrow's allocator instead of the pool."""
    memory_limit: str | None = dataclasses.field(default_factory=_memory_limit_from_env)
    """DuckDB's memory limit for the process's instance: ``"1GiB"`` by default, or
    ``TRACEDB_MEMORY_LIMIT`` / ``--memory-limit`` (``"512MB"``, ``"4GiB"``; ``none`` is
    DuckDB's own, 80% of RAM). It bounds DuckDB's buffer pool, which keeps the blocks an
    ingest writes cached (about 200 MB per GB ingested) until the limit; past it blocks are
    evicted and large queries spill to the temp directory, so a long-running follower's
    memory levels off instead of growing with the run."""
    temp_limit: str | None = dataclasses.field(default_factory=_temp_limit_from_env)
    """The most a DuckDB instance of the process spills to its temp directory
    (``tracedb-duckdb-<pid>`` under ``TMPDIR``): ``"16GiB"`` by default, or
    ``TRACEDB_TEMP_LIMIT`` (``none``: DuckDB's own, 90% of the free disk, which one
    runaway query can fill). Read when an instance starts; a query past it fails with
    DuckDB's out-of-memory error instead of filling the disk."""


@dataclass
class _Attachment:
    alias: str
    read_only: bool
    users: int
    pid: int  # the process that attached it (and may detach it)
    shared: Shared = dataclasses.field(default_factory=lambda: Shared())


class Shared:
    """What every handle on one open database of this process shares: the write counter
    (a write through any handle makes the views cached on all of them stale), the write
    lock (ingests commit one at a time, so sequence numbers are handed out in commit order)
    and the condition a reader waiting for new traces sleeps on (woken by every write)."""

    def __init__(self) -> None:
        self.generation = 0
        self.writing = threading.RLock()
        """Held by an ingest from its first sequence number to its COMMIT."""
        self.changed = threading.Condition(threading.Lock())

    def bump(self) -> None:
        """A write committed (or rolled back): count it and wake the waiters."""
        with self.changed:
            self.generation += 1
            self.changed.notify_all()

    def wait(self, generation: int, timeout: float) -> bool:
        """Sleep until the counter differs from ``generation`` (True) or ``timeout``
        seconds passed (False)."""
        with self.changed:
            return self.changed.wait_for(lambda: self.generation != generation, timeout)

    def after_fork(self) -> None:
        self.writing = threading.RLock()
        self.changed = threading.Condition(threading.Lock())


def _spill_to(con: duckdb.DuckDBPyConnection, name: str) -> None:
    """Spill to ``name`` in the system's temporary directory, at most ``temp_limit``."""
    con.execute(f"SET temp_directory = {quote_literal(os.path.join(tempfile.gettempdir(), name))}")
    limit = _state.settings.temp_limit
    if limit is not None:
        try:
            con.execute(f"SET max_temp_directory_size = {quote_literal(limit)}")
        except duckdb.Error as e:
            raise ValueError(f"temp limit {limit!r}: expected a size such as 8GiB ({e})") from None


class _Instance:
    def __init__(self) -> None:
        self.root = duckdb.connect(":memory:")
        _spill_to(self.root, f"tracedb-duckdb-{os.getpid()}")
        self.default_memory_limit = self.root.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]
        self.memory_limit: str | None = None
        apply_memory_limit(self, _state.settings.memory_limit)
        self.lock = threading.Lock()
        self.attached: dict[str, _Attachment] = {}
        self.names = itertools.count()
        self.pending: deque[tuple[str | None, _Attachment]] = deque()  # releases left to do


class _Process:
    """The state itself; one object, so that :func:`reset` and the fork hook see all of it."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.settings = Settings()
        self.instance: _Instance | None = None
        self.idle: deque[mmap.mmap] = deque()  # appended to by finalizers (any thread, inside GC too): no lock
        self.threads: ThreadPoolExecutor | None = None
        self.lowered_lock = threading.Lock()
        self.lowered: dict[object, list[Any]] = {}  # DuckDB instance -> [commits under way, its own threshold]


_state = _Process()


def _after_fork_in_child() -> None:
    """The one fork hook: fresh locks (another thread may have held one at the fork), an
    empty buffer pool (a child's views must not write into pages its parent's views use),
    no thread pool (its threads stay in the parent), and the inherited DuckDB instance
    kept alive for good (its destructor would checkpoint the parent's files from the child)."""
    state = _state
    state.lock = threading.Lock()
    state.lowered_lock = threading.Lock()
    state.lowered = {}
    state.idle = deque()
    state.threads = None
    if state.instance is not None:
        state.instance.lock = threading.Lock()
        for attachment in state.instance.attached.values():
            attachment.shared.after_fork()
        ctypes.pythonapi.Py_IncRef(ctypes.py_object(state.instance.root))


os.register_at_fork(after_in_child=_after_fork_in_child)


# --------------------------------------------------------------------------- settings


def settings() -> Settings:
    """The process's current settings."""
    return _state.settings


@contextlib.contextmanager
def configure(**changes: Any) -> Iterator[Settings]:
    """Change some settings for the ``with`` block (process-wide), then put them back::

    with tracedb.runtime.configure(chunk_bytes=1, batch_tokens=1):  # a batch per line
        db.ingest(path)
    """
    unknown = set(changes) - {f.name for f in dataclasses.fields(Settings)}
    if unknown:
        raise TypeError(
            f"unknown setting(s) {sorted(unknown)}; settings are {[f.name for f in dataclasses.fields(Settings)]}"
        )
    before = _state.settings
    after = dataclasses.replace(before, **changes)
    inst = _state.instance
    if inst is not None and after.memory_limit != before.memory_limit:
        apply_memory_limit(inst, after.memory_limit)
    _state.settings = after
    try:
        yield _state.settings
    finally:
        _state.settings = before
        if inst is not None and after.memory_limit != before.memory_limit:
            apply_memory_limit(inst, before.memory_limit)


def apply_memory_limit(inst: _Instance, limit: str | None) -> None:
    """Set the instance's DuckDB memory limit (None: DuckDB's default); a value DuckDB
    cannot read is a ValueError that says what a limit looks like."""
    value = inst.default_memory_limit if limit is None else limit
    try:
        inst.root.execute(f"SET memory_limit = {quote_literal(str(value))}")
    except duckdb.Error as e:
        raise ValueError(f"memory limit {limit!r}: expected a size such as 512MB or 2GiB ({e})") from None
    inst.memory_limit = limit


def set_memory_limit(limit: str | None) -> None:
    """Set the process's DuckDB memory limit from now on (what ``--memory-limit`` does;
    :func:`configure` changes it for a block). ValueError for a size DuckDB cannot read."""
    state = _state
    inst = state.instance
    if inst is not None:
        apply_memory_limit(inst, limit)
    elif limit is not None:
        probe = duckdb.connect(":memory:")  # refuse a bad size now, not at the first open
        try:
            probe.execute(f"SET memory_limit = {quote_literal(limit)}")
        except duckdb.Error as e:
            raise ValueError(f"memory limit {limit!r}: expected a size such as 512MB or 2GiB ({e})") from None
        finally:
            probe.close()
    state.settings = dataclasses.replace(state.settings, memory_limit=limit)


def memory_limit() -> str:
    """The memory limit DuckDB applies now, as it reports it."""
    return _instance().root.execute("SELECT current_setting('memory_limit')").fetchall()[0][0]


def connect_isolated(path: str, *, read_only: bool) -> duckdb.DuckDBPyConnection:
    """A DuckDB instance of its own for ``path`` (``tracedb.connect(isolated=True)``: the
    REST server with user SQL) under the process's limits all the same: the memory limit
    in force (:func:`memory_limit`, ``--memory-limit``), a spill directory of its own in
    the system's temporary directory and ``temp_limit``. Without them it had DuckDB's
    defaults: 80% of the machine's memory and 90% of the free disk."""
    con = duckdb.connect(path, read_only=read_only)
    try:
        limit = _state.settings.memory_limit
        if limit is not None:
            con.execute(f"SET memory_limit = {quote_literal(limit)}")
        _spill_to(con, f"tracedb-duckdb-{os.getpid()}-{next(_isolated)}")
    except BaseException:
        con.close()
        raise
    return con


_isolated = itertools.count()


def rss_bytes() -> int | None:
    """The process's resident memory now (Linux: ``/proc/self/statm``), None elsewhere."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * mmap.PAGESIZE
    except (OSError, ValueError, IndexError):
        return None


_UNITS = {"bytes": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12}
_UNITS.update({"kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40})


def size_bytes(text: str) -> int | None:
    """A size as DuckDB writes one (``1.0 GiB``, ``953.6 MiB``, ``512 bytes``) in bytes;
    None for text that is not one."""
    parts = text.strip().split()
    if len(parts) == 1:
        number = parts[0].rstrip("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")
        parts = [number, parts[0][len(number) :] or "bytes"]
    if len(parts) != 2 or parts[1].lower() not in _UNITS:
        return None
    try:
        return int(float(parts[0]) * _UNITS[parts[1].lower()])
    except ValueError:
        return None


def reset() -> None:
    """Back to a fresh process: settings from the environment, an empty buffer pool, the
    thread pool shut down, and the DuckDB instance dropped if no database is attached to
    it (a database still open keeps it; close it first for a truly fresh instance)."""
    state = _state
    state.settings = Settings()
    state.idle.clear()
    threads, state.threads = state.threads, None
    if threads is not None:
        threads.shutdown(wait=True)
    with state.lock:
        inst = state.instance
        if inst is not None:
            _drain(inst)
            if not inst.attached and not inst.pending:
                state.instance = None
            elif inst.memory_limit != state.settings.memory_limit:
                apply_memory_limit(inst, state.settings.memory_limit)


# --------------------------------------------------------------------------- buffer pool and threads


def idle_mappings() -> deque[mmap.mmap]:
    """The buffer pool: idle anonymous mappings that view columns reuse (see
    :mod:`tracedb.views._buffers`)."""
    return _state.idle


def spare_core() -> bool:
    """Whether this process may run on two CPUs or more (``os.sched_getaffinity``, else
    the machine's count): a second thread of its own can run beside the first."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        cpus = os.cpu_count() or 1
    return cpus >= 2


def threads() -> ThreadPoolExecutor:
    """The process's thread pool for reads that run beside a view's main read."""
    state = _state
    with state.lock:
        if state.threads is None:
            state.threads = ThreadPoolExecutor(max_workers=4, thread_name_prefix="tracedb")
        return state.threads


@contextlib.contextmanager
def lowered_checkpoint(key: object, con: duckdb.DuckDBPyConnection) -> Iterator[None]:
    """DuckDB's checkpoint threshold lowered to ``checkpoint_at_commit`` for the block.

    The setting belongs to the DuckDB instance (``key``), which the databases of the
    process share: the first of concurrent users lowers it, the last one puts back the
    value found before the first (meanwhile other commits of the instance checkpoint at
    the lowered threshold too)."""
    state = _state
    with state.lowered_lock:
        entry = state.lowered.get(key)
        if entry is None:
            own = con.execute("SELECT current_setting('checkpoint_threshold')").fetchall()[0][0]
            con.execute(f"SET checkpoint_threshold = {quote_literal(state.settings.checkpoint_at_commit)}")
            entry = state.lowered[key] = [0, own]
        entry[0] += 1
    try:
        yield
    finally:
        with state.lowered_lock:
            entry[0] -= 1
            if entry[0] == 0:
                del state.lowered[key]
                con.execute(f"SET checkpoint_threshold = {quote_literal(str(entry[1]))}")


# --------------------------------------------------------------------------- the DuckDB instance


def _instance() -> _Instance:
    state = _state
    with state.lock:
        if state.instance is None:
            state.instance = _Instance()
        return state.instance


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


def attach(
    path: str, *, read_only: bool, block_size: int | None = None
) -> tuple[duckdb.DuckDBPyConnection, str, bool, Shared, Callable[[], None]]:
    """Attach ``path`` (``":memory:"``: a new in-memory database) to the process's
    instance; returns a connection using it, its catalog name, whether this call attached
    it (False: it was open already), the state its handles share (:class:`Shared`) and the
    release function (idempotent; the last release of a file DETACHes it). ``block_size``
    is for a file this call creates (:data:`BLOCK_SIZE`); a file keeps the size it was
    made with.

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
                    made = creation_options(target)
                    blocks = f", BLOCK_SIZE {int(block_size)}" if block_size and made else ""
                    options = f" (ROW_GROUP_SIZE {ROW_GROUP_ROWS}{blocks}{made})"
                else:
                    options = ""
                inst.root.execute(f"ATTACH {quote_literal(target)} AS {quote_identifier(alias)}{options}")
                attachment, fresh = _Attachment(alias, read_only, 1, os.getpid()), True
                if key is not None:
                    inst.attached[key] = attachment
    finally:
        _drain(inst)
    try:
        con = inst.root.cursor()
        con.execute(f"USE {quote_identifier(attachment.alias)}")
    except BaseException:
        _release(inst, key, attachment)
        raise
    released = False

    def release() -> None:
        nonlocal released
        if not released:
            released = True
            _release(inst, key, attachment)

    return con, attachment.alias, fresh, attachment.shared, release


def is_attached(path: str) -> bool:
    """Whether a database of this process has ``path`` open (a benchmark reading "from
    the file" checks that it is not)."""
    inst = _state.instance
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
    inst.root.execute(f"DETACH DATABASE IF EXISTS {quote_identifier(attachment.alias)}")
