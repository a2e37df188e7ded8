"""Following a run while it writes: ``tracedb ingest --follow``.

verifiers appends one finished episode per line to ``traces.jsonl`` while a run goes on.
A :class:`Follower` polls its paths (files, and directories in which new ``.jsonl`` /
``.jsonl.zst`` files appear, recursively) and ingests what is new, one transaction per
poll. Rules:

- **Whole lines only.** A line is taken when its line break is there; the bytes after the
  last one wait for the next poll.
- **Exactly once.** Where the follower is in each file (the file's identity, the byte
  offset and line number after the last whole line read, and a hash of its first bytes)
  is written to ``follow_positions`` in the same transaction as the lines read up to
  there, so a follower killed at any moment and started again continues where the last
  commit ended: nothing lost, nothing twice.
- **Files that shrink or are replaced** (smaller than the position, another inode, or
  other first bytes) are reported and read again from their start; ingest being
  idempotent by trace id, the database then holds the union of both contents.
- **Compressed files** (``.jsonl.zst``, ``.json``) are taken whole once they have not
  changed for ``settle`` seconds and (zstd) their last frame is complete; until then
  they are waited for, not rejected. One that grows later is read again, its lines up to
  the position skipped.
- Rejected lines are kept with their reason, as in any ingest, and do not stop it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import pyarrow as pa

from tracedb import runtime, tables
from tracedb.errors import InputError
from tracedb.handle import Handle
from tracedb.ingest.files import SUFFIXES, Appended, Chunk, LongLine, open_input, read_chunks
from tracedb.ingest.run import IngestReport, IngestRun, transaction_for_ingest
from tracedb.ingest.tags import Tag, parse_tags

log = logging.getLogger("tracedb.follow")
HEAD_BYTES = 4096
"""How many of a file's first bytes its position's hash covers."""


@dataclass
class Position:
    """Where the follower is in one file: everything before ``offset`` (``line`` lines)
    is in the database."""

    path: str
    device: int
    inode: int
    offset: int
    line: int
    head: bytes | None


@dataclass
class FollowReport:
    """What a follower did since it started."""

    polls: int = 0
    commits: int = 0
    traces: int = 0
    skipped: int = 0
    lines: int = 0
    rejected: int = 0
    bytes: int = 0
    watermark: int = 0
    files: int = 0
    """Files followed (seen so far)."""
    restarts: list[str] = field(default_factory=list)
    """Files read again from their start, each with the reason (shrunk, replaced, rewritten)."""
    waiting: dict[str, str] = field(default_factory=dict)
    """Compressed files not taken yet, and why."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def __str__(self) -> str:
        text = (
            f"followed {self.files} files: {self.traces} traces in {self.commits} commits "
            f"({self.lines} lines, {self.bytes} bytes), watermark {self.watermark}"
        )
        if self.skipped:
            text += f"; {self.skipped} already present"
        if self.rejected:
            text += f"; {self.rejected} rejected (see `tracedb rejects`)"
        if self.restarts:
            text += f"; {len(self.restarts)} file(s) read again from the start"
        return text


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _head(path: Path, upto: int) -> bytes | None:
    """BLAKE2b of the file's first ``min(upto, HEAD_BYTES)`` bytes (as stored, compressed
    or not); None for an empty prefix."""
    n = min(upto, HEAD_BYTES)
    if n <= 0:
        return None
    with open(path, "rb") as f:
        return hashlib.blake2b(f.read(n), digest_size=16).digest()


def _compressed(path: Path) -> bool:
    return path.name.endswith(".zst") or path.suffix == ".json"


def _skip_lines(chunks: Iterable[Chunk | LongLine], upto: int) -> Iterator[Chunk | LongLine]:
    """The chunks' lines after line ``upto`` (those before were read by an earlier poll)."""
    for chunk in chunks:
        if isinstance(chunk, LongLine):
            if chunk.number > upto:
                yield chunk
            continue
        if not len(chunk.numbers) or chunk.numbers[-1] <= upto:
            continue
        if chunk.numbers[0] > upto:
            yield chunk
            continue
        keep = chunk.numbers > upto
        yield Chunk(chunk.data, chunk.starts[keep], chunk.ends[keep], chunk.numbers[keep])


class _Counted:
    """A compressed file's chunks, counting its lines (the position after a whole read)."""

    def __init__(self, path: Path, skip: int) -> None:
        self.path = path
        self.skip = skip
        self.lines = 0

    def __iter__(self) -> Iterator[Chunk | LongLine]:
        yield from _skip_lines(self._all(), self.skip)

    def _all(self) -> Iterator[Chunk | LongLine]:
        for chunk in read_chunks(self.path):
            if isinstance(chunk, LongLine):
                self.lines = chunk.number
            elif len(chunk.numbers):
                self.lines = int(chunk.numbers[-1])
            yield chunk


def _complete(path: Path) -> str | None:
    """Why a compressed file cannot be taken yet (None: it can): its last zstd frame is
    cut short. Damage of another kind is for the ingest to reject."""
    if not path.name.endswith(".zst"):
        return None
    try:
        with open_input(path) as f:
            while f.read(1 << 20):
                pass
            f.read(1)  # a damage reads as the end once, and is raised by the read after
    except InputError as e:
        if e.reason.startswith("truncated"):
            return e.reason
    return None


class Follower:
    """Follows ``paths`` into the database of ``handle`` (which it writes through; give it
    a handle of its own when other threads use the database). :meth:`poll` ingests what
    is new once; :meth:`run` polls until stopped."""

    def __init__(
        self,
        handle: Handle,
        paths: Sequence[str | Path],
        *,
        interval: float = 0.25,
        settle: float = 2.0,
        tags: Iterable[str | Tag] = (),
        allow_ragged: bool = False,
        batch_bytes: int | None = None,
        on_commit: Callable[[IngestReport], None] | None = None,
    ) -> None:
        if interval <= 0 or settle < 0:
            raise ValueError(f"interval must be > 0 and settle >= 0 (got {interval}, {settle})")
        self.handle = handle
        self.paths = [Path(p) for p in paths]
        self.interval = interval
        self.settle = settle
        self.tags = parse_tags(tags)
        self.allow_ragged = allow_ragged
        self.batch_bytes = batch_bytes or runtime.settings().follow_batch_bytes
        self.on_commit = on_commit
        self.report = FollowReport(watermark=handle.watermark())
        self.positions = self._load()
        self._changes: dict[str, tuple[int, int, float]] = {}  # compressed file -> (size, mtime_ns, since)
        self.behind = False
        """The last poll stopped at its byte budget with more to read."""

    # ----------------------------------------------------------------- positions

    def _load(self) -> dict[str, Position]:
        rows = self.handle.con.execute(
            'SELECT path, device, inode, "offset", line, head FROM follow_positions'
        ).fetchall()
        return {r[0]: Position(*r) for r in rows}

    def _store(self, moved: list[Position]) -> None:
        """Write the new positions (inside the ingest's transaction)."""
        columns = {
            "path": pa.array([p.path for p in moved], pa.string()),
            "device": pa.array([p.device for p in moved], pa.int64()),
            "inode": pa.array([p.inode for p in moved], pa.int64()),
            "offset": pa.array([p.offset for p in moved], pa.int64()),
            "line": pa.array([p.line for p in moved], pa.int64()),
            "head": pa.array([p.head for p in moved], pa.binary()),
        }
        rows = tables.table_from(tables.inserted(tables.FOLLOW_POSITIONS), columns)
        with self.handle.registered("_tdb_positions", rows):
            self.handle.con.execute("DELETE FROM follow_positions WHERE path IN (SELECT path FROM _tdb_positions)")
            self.handle.con.execute(
                'INSERT INTO follow_positions (path, device, inode, "offset", line, head) '
                'SELECT path, device, inode, "offset", line, head FROM _tdb_positions'
            )

    # ----------------------------------------------------------------- files

    def files(self) -> list[Path]:
        """The files the paths name now (a path that does not exist yet names none)."""
        out: list[Path] = []
        for p in self.paths:
            if p.is_dir():
                out.extend(sorted(q for q in p.rglob("*") if q.is_file() and q.name.endswith(SUFFIXES)))
            elif p.is_file():
                out.append(p)
        return [q.absolute() for q in out]

    def _start_of(self, path: Path, st: os.stat_result) -> Position:
        """Where to read ``path`` from: its stored position, or its start when it is new,
        shrunk, replaced or rewritten (reported)."""
        key = str(path)
        known = self.positions.get(key)
        fresh = Position(key, st.st_dev, st.st_ino, 0, 0, None)
        if known is None:
            return fresh
        why = None
        if (known.device, known.inode) != _identity(st):
            why = "replaced (another file under the same name)"
        elif st.st_size < known.offset:
            why = f"shrunk to {st.st_size} bytes (it was read up to byte {known.offset})"
        elif known.head is not None and _head(path, known.offset) != known.head:
            why = "rewritten (its first bytes changed)"
        if why is None:
            return known
        message = f"{path}: {why}; read again from its start"
        log.warning(message)
        self.report.restarts.append(message)
        return fresh

    def _ready(self, path: Path, st: os.stat_result, start: Position) -> bool:
        """Whether a compressed file is to be read now: changed since its position, still
        for ``settle`` seconds, its last frame complete."""
        key = str(path)
        if start.offset == st.st_size and start.head is not None:
            self._changes.pop(key, None)
            self.report.waiting.pop(key, None)
            return False  # read whole already, unchanged
        now = time.monotonic()
        seen = self._changes.get(key)
        if seen is None or seen[:2] != (st.st_size, st.st_mtime_ns):
            self._changes[key] = (st.st_size, st.st_mtime_ns, now)
            if self.settle > 0:
                self.report.waiting[key] = f"changed; taken once it has not changed for {self.settle:g} s"
                return False
        elif now - seen[2] < self.settle:
            return False
        why = _complete(path)
        if why is not None:
            self.report.waiting[key] = f"{why}; waiting for the rest"
            return False
        self.report.waiting.pop(key, None)
        return True

    # ----------------------------------------------------------------- polling

    def poll(self) -> IngestReport | None:
        """Ingest what is new in the files, in one transaction; None when there was nothing."""
        self.report.polls += 1
        work: list[tuple[Path, os.stat_result, Position]] = []
        listed = self.files()
        for path in listed:
            try:
                st = path.stat()
            except FileNotFoundError:
                continue  # gone between the listing and now
            start = self._start_of(path, st)
            if _compressed(path):
                if self._ready(path, st, start):
                    work.append((path, st, start))
            elif st.st_size > start.offset and (
                start is not self.positions.get(str(path)) or _whole_line(path, start.offset, st.st_size)
            ):
                work.append((path, st, start))
        self.report.files = len({str(p) for p in listed} | set(self.positions))
        if not work:
            return None
        return self._ingest(work)

    def _ingest(self, work: list[tuple[Path, os.stat_result, Position]]) -> IngestReport | None:
        report = IngestReport(files=len(work))
        run = IngestRun(self.handle, report, strict=False, allow_ragged=self.allow_ragged, tags=self.tags)
        moved: list[Position] = []
        budget = self.batch_bytes
        self.behind = False
        with transaction_for_ingest(self.handle):
            try:
                run.start([path for path, _, _ in work], progress=False)
                for path, st, start in work:
                    if budget <= 0:
                        self.behind = True  # the rest at once, in the next poll
                        break
                    position = self._read(run, path, st, start, budget)
                    if position is not None:
                        moved.append(position)
                        budget -= position.offset - start.offset
                # Nothing moved (a writer was mid-line everywhere): an empty commit, no positions.
                run.finish(before_commit=lambda: self._store(moved) if moved else None)
            except BaseException:
                run.abort()
                raise
            finally:
                run.close()
        for position in moved:
            self.positions[position.path] = position
        if not moved:
            return None
        self._count(report, moved, work)
        if self.on_commit is not None:
            self.on_commit(report)
        return report

    def _read(self, run: IngestRun, path: Path, st: os.stat_result, start: Position, budget: int) -> Position | None:
        """Read ``path`` from ``start`` into the ingest; the position after it (None: no
        whole line was there yet)."""
        source = str(path)
        if _compressed(path):
            counted = _Counted(path, start.line)
            try:
                run.read(source, counted)
            except InputError as e:
                run.unreadable(e)  # damaged (not merely unfinished): rejected, and not read again until it changes
            return Position(
                source, st.st_dev, st.st_ino, st.st_size, max(counted.lines, start.line), _head(path, st.st_size)
            )
        appended = Appended(path, start.offset, start.line, budget)
        run.read(source, appended)
        self.behind = self.behind or appended.more
        restarted = source in self.positions and start is not self.positions[source]
        if appended.offset == start.offset and not restarted:
            return None  # no whole line yet (a restart's position is stored all the same)
        head = start.head if start.offset >= HEAD_BYTES and start.head is not None else _head(path, appended.offset)
        return Position(source, st.st_dev, st.st_ino, appended.offset, appended.line, head)

    def _count(
        self, report: IngestReport, moved: list[Position], work: list[tuple[Path, os.stat_result, Position]]
    ) -> None:
        total = self.report
        starts = {str(p): s for p, _, s in work}
        total.commits += 1
        total.traces += report.traces
        total.skipped += report.skipped
        total.lines += report.lines
        total.rejected += len(report.rejected)
        total.bytes += sum(p.offset - starts[p.path].offset for p in moved if p.offset >= starts[p.path].offset)
        if report.watermark is not None:
            total.watermark = report.watermark

    def run(self, stop: threading.Event | None = None, *, until_idle: bool = False) -> FollowReport:
        """Poll every ``interval`` seconds until ``stop`` is set (the poll under way, and
        its transaction, finish first), or, with ``until_idle``, until a poll finds nothing
        and no compressed file is waited for. A poll that stopped at its byte budget is
        followed by the next one at once."""
        stop = stop or threading.Event()
        while not stop.is_set():
            began = time.monotonic()
            result = self.poll()
            if until_idle and result is None and not self.report.waiting:
                break
            if result is None or not self.behind:
                stop.wait(max(0.0, self.interval - (time.monotonic() - began)))
        return self.report


def _whole_line(path: Path, offset: int, size: int) -> bool:
    """Whether ``path`` has a line break between ``offset`` and ``size`` (looked for from
    the end: the bytes after the last one are a line still being written)."""
    with open(path, "rb") as f:
        end = size
        while end > offset:
            start = max(offset, end - (1 << 16))
            f.seek(start)
            if b"\n" in f.read(end - start):
                return True
            end = start
    return False


def follow_positions(handle: Handle) -> list[Position]:
    """The stored positions (every file a follower of this database has read)."""
    rows = handle.con.execute(
        'SELECT path, device, inode, "offset", line, head FROM follow_positions ORDER BY path'
    ).fetchall()
    return [Position(*r) for r in rows]
