"""What changed in a follower's files since its last poll, and what to read where.

A :class:`Planner` lists the followed files, checks each against its position (the
identity rule of :mod:`tracedb.ingest.rotation`), follows a rotation to the file that was
renamed away or to the copy a ``copytruncate`` left, and returns a :class:`Plan`: the
files to read, in order (an old file before the one that took its name), the positions
that move or go, and the events to report once the poll has committed. It reads at most a
few KiB per file (the hashes); the lines themselves are read by the follower.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

from tracedb.errors import InputError
from tracedb.ingest.files import SUFFIXES, open_input
from tracedb.ingest.positions import FollowEvent, Position
from tracedb.ingest.rotation import (
    OpenFiles,
    changed,
    compressed_copies,
    find_inode,
    identity,
    rotated_names,
    tail_of,
)

log = logging.getLogger("tracedb.follow")


@dataclass
class Loss:
    """What one rotation is known to have lost, gathered while its files are read."""

    file: str
    bytes: int = 0
    notes: list[str] = field(default_factory=list)

    def add(self, n: int, note: str) -> None:
        self.bytes += n
        self.notes.append(note)


@dataclass
class Read:
    """One file to read in a poll."""

    source: Path
    """The file read (its lines are stored and rejected under this name)."""
    fd: int | None
    """A descriptor on it (None: a compressed file, read by name)."""
    start: Position
    followed: str
    """The followed path it belongs to (named in reports)."""
    key: str | None
    """The position after is stored under this path (None: not stored, a copy or a deleted file)."""
    rotated_from: str | None = None
    final: bool = False
    """It cannot grow any more: read to its end now, its unfinished last line taken if it
    is a JSON object, else counted as lost."""
    store: bool = False
    """Store the position even when no whole line was read (it replaces a stale one)."""
    compressed: bool = False
    cut_first: bool = False
    """Its first line may be the end of a line cut by a truncation: lost if it is not JSON."""
    loss: Loss | None = None
    """Where what it is known to lose is counted (a final or cut-first read has one)."""
    notice: str | None = None
    """A rotation message, given when the read found something (or lost something)."""


@dataclass
class Plan:
    """One poll's work, and what it found."""

    reads: list[Read] = field(default_factory=list)
    touched: dict[str, Position] = field(default_factory=dict)
    """Positions stored without a read (a tail hash taken, a compressed file renamed)."""
    drops: set[str] = field(default_factory=set)
    """Positions removed (their file moved under another name, or is gone)."""
    forget: set[tuple[int, int]] = field(default_factory=set)
    """Files whose descriptor is closed after the poll."""
    events: list[FollowEvent] = field(default_factory=list)
    losses: list[Loss] = field(default_factory=list)
    files: int = 0
    """Files followed (listed now, or with a position)."""

    def note(self, kind: str, file: str, message: str) -> None:
        self.events.append(FollowEvent(kind, file, message))


def compressed(path: Path) -> bool:
    """Whether the file is read whole when it has settled (``.jsonl.zst``, ``.json``), not line by line."""
    return path.name.endswith(".zst") or path.suffix == ".json"


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


def _stat(path: str) -> os.stat_result | None:
    try:
        return os.stat(path)
    except OSError:
        return None


def _whole_line(fd: int, offset: int, size: int) -> bool:
    """Whether the file has a line break between ``offset`` and ``size`` (looked for from
    the end: the bytes after the last one are a line still being written)."""
    end = size
    while end > offset:
        start = max(offset, end - (1 << 16))
        if b"\n" in os.pread(fd, end - start, start):
            return True
        end = start
    return False


class Planner:
    """Plans a follower's polls over ``paths``; ``positions`` (the follower's, by path) are
    read, never changed here; ``waiting`` is where compressed files not taken yet are said."""

    def __init__(
        self,
        paths: list[Path],
        positions: dict[str, Position],
        *,
        settle: float,
        rotated: tuple[str, ...],
        open_files: OpenFiles,
        waiting: dict[str, str],
    ) -> None:
        self.paths = paths
        self.roots = [p.absolute() for p in paths]
        self.positions = positions
        self.settle = settle
        self.rotated = rotated
        self.open = open_files
        self.waiting = waiting
        self._changes: dict[str, tuple[int, int, float]] = {}  # compressed file -> (size, mtime_ns, since)

    def files(self) -> list[Path]:
        """The files the paths name now (a path that does not exist yet names none)."""
        out: list[Path] = []
        for p in self.paths:
            if p.is_dir():
                out.extend(sorted(q for q in p.rglob("*") if q.is_file() and q.name.endswith(SUFFIXES)))
            elif p.is_file():
                out.append(p)
        return [q.absolute() for q in out]

    def _covers(self, position: Position) -> bool:
        """Whether the position is this follower's: its file, or the followed path it was
        rotated from, is one of the paths or under one of them."""
        for name in (position.path, position.rotated_from):
            if name is not None:
                path = Path(name)
                if any(root == path or root in path.parents for root in self.roots):
                    return True
        return False

    def _ready(self, path: Path, st: os.stat_result, start: Position) -> bool:
        """Whether a compressed file is to be read now: changed since its position, still
        for ``settle`` seconds, its last frame complete."""
        key = str(path)
        if start.offset == st.st_size and start.head is not None:
            self._changes.pop(key, None)
            self.waiting.pop(key, None)
            return False  # read whole already, unchanged
        now = time.monotonic()
        seen = self._changes.get(key)
        if seen is None or seen[:2] != (st.st_size, st.st_mtime_ns):
            self._changes[key] = (st.st_size, st.st_mtime_ns, now)
            if self.settle > 0:
                self.waiting[key] = f"changed; taken once it has not changed for {self.settle:g} s"
                return False
        elif now - seen[2] < self.settle:
            return False
        why = _complete(path)
        if why is not None:
            self.waiting[key] = f"{why}; waiting for the rest"
            return False
        self.waiting.pop(key, None)
        return True

    def plan(self) -> Plan:
        """What to read this poll, from where, in which order (an old file before the one
        that took its name), and what happened to the files since the last poll."""
        plan = Plan()
        listed = self.files()
        stats: dict[str, os.stat_result] = {}
        for path in listed:
            st = _stat(str(path))
            if st is not None:  # else gone between the listing and now
                stats[str(path)] = st
        by_id = {identity(st): key for key, st in stats.items()}
        known = sorted(
            (p for p in self.positions.values() if self._covers(p)), key=lambda p: (p.rotated_from is None, p.path)
        )
        known_ids = {(p.device, p.inode) for p in known}
        claimed: set[str] = set()
        for position in known:
            st = stats.get(position.path) or (None if position.path in stats else _stat(position.path))
            if st is not None and identity(st) == (position.device, position.inode):
                claimed.add(position.path)
                self._plan_same(position, st, plan, stats, claimed, known_ids)
            else:
                self._plan_moved(position, plan, stats, by_id, claimed, known_ids)
        for key, st in stats.items():
            if key not in claimed:
                claimed.add(key)
                self._plan_new(Path(key), st, plan, known_ids)
        plan.files = len({str(p) for p in listed} | set(self.positions))
        return plan

    def _plan_new(self, path: Path, st: os.stat_result, plan: Plan, known_ids: set[tuple[int, int]]) -> None:
        """A file with no position: read from its start."""
        key = str(path)
        fresh = Position(key, st.st_dev, st.st_ino, 0, 0, None)
        if compressed(path):
            if self._ready(path, st, fresh):
                plan.reads.append(Read(path, None, fresh, key, key, compressed=True, store=True))
            return
        opened = self.open.open(path, identity(st))
        if opened is None:
            return
        fd, fst = opened
        self.open.watch(identity(fst)).size = fst.st_size
        if fst.st_size > 0:
            plan.reads.append(Read(path, fd, fresh, key, key))

    def _plan_same(
        self,
        position: Position,
        st: os.stat_result,
        plan: Plan,
        stats: dict[str, os.stat_result],
        claimed: set[str],
        known_ids: set[tuple[int, int]],
    ) -> None:
        """A file found where its position says (same path, same identity)."""
        path = Path(position.path)
        followed = position.rotated_from or position.path
        fresh = replace(position, offset=0, line=0, head=None, tail=None)
        if compressed(path):
            start = position
            why = (
                None if self.open.trusted(identity(st), position.offset, st) else self._changed_by_name(path, position)
            )
            if why is not None:
                start = fresh
                plan.note("restart", followed, f"{path}: {why}; read again from its start")
            else:
                self.open.checked(identity(st), position.offset, st)
                if position.tail is None and position.offset > 0:  # a position schema 4 wrote
                    start = replace(position, tail=self._tail_by_name(path, position.offset))
                    plan.touched[position.path] = start
            if self._ready(path, st, start):
                plan.reads.append(
                    Read(path, None, start, followed, position.path, compressed=True, store=start.offset == 0)
                )
            return
        opened = self.open.open(path, identity(st))
        if opened is None:
            return  # replaced between the stat and now: seen at the next poll
        fd, fst = opened
        key = identity(fst)
        watch = self.open.watch(key)
        seen, watch.size = watch.size, fst.st_size
        if fst.st_size > seen:
            watch.used = time.monotonic()
        trusted = self.open.trusted(key, position.offset, fst)
        why = None if trusted else changed(fd, fst.st_size, position.offset, position.head, position.tail)
        if why is None:
            self.open.checked(key, position.offset, fst)
            if position.tail is None and position.offset > 0:  # a position schema 4 wrote
                position = replace(position, tail=tail_of(fd, position.offset))
                plan.touched[position.path] = position
            if fst.st_size > position.offset and _whole_line(fd, position.offset, fst.st_size):
                read = Read(path, fd, position, followed, position.path, position.rotated_from)
                if watch.cut_first and position.line == 0:  # the first line after a copytruncate, complete now
                    read.cut_first, read.loss = True, Loss(followed)
                    plan.losses.append(read.loss)
                plan.reads.append(read)
            return
        copy = None if position.rotated_from else self._copy_of(position, stats, claimed, known_ids)
        if copy is None:
            note = ""
            if fst.st_size < position.offset and not position.rotated_from:
                packed = compressed_copies(path, self.rotated)
                note = (
                    f"; no rotated copy holds its bytes up to there: if it was copied and truncated, what it got "
                    f"after line {position.line} before the truncation is not read"
                    + (f" ({', '.join(p.name for p in packed)}: compressed, not read)" if packed else "")
                )
            plan.note("restart", followed, f"{path}: {why}; read again from its start{note}")
            plan.reads.append(Read(path, fd, fresh, followed, position.path, position.rotated_from, store=True))
            return
        source, copy_fd, copy_st, copy_key = copy
        loss = Loss(followed)
        plan.losses.append(loss)
        if seen > copy_st.st_size:
            loss.add(
                seen - copy_st.st_size, f"{seen - copy_st.st_size} bytes it held at the last poll, past the copy's end"
            )
        plan.reads.append(
            Read(source, copy_fd, replace(position, path=str(source)), followed, copy_key, final=True, loss=loss)
        )
        plan.forget.add(identity(copy_st))
        middle = self._plan_middle(path, copy_st, plan, stats, claimed, known_ids | {identity(copy_st)}, copies=loss)
        plan.note(
            "rotation",
            followed,
            f"{path}: copied to {source.name} and truncated (copytruncate): lines {position.line + 1}.. read from "
            f"the copy{middle}, then {path.name} from its start; lines written between the copy and the "
            "truncation after the last poll are in neither file and cannot be seen",
        )
        watch.cut_first = True
        plan.reads.append(Read(path, fd, fresh, followed, position.path, store=True, cut_first=True, loss=loss))

    def _tail_by_name(self, path: Path, offset: int) -> bytes | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            return tail_of(fd, offset)
        finally:
            os.close(fd)

    def _changed_by_name(self, path: Path, position: Position) -> str | None:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            return None
        try:
            return changed(fd, os.fstat(fd).st_size, position.offset, position.head, position.tail)
        finally:
            os.close(fd)

    def _copy_of(
        self,
        position: Position,
        stats: dict[str, os.stat_result],
        claimed: set[str],
        known_ids: set[tuple[int, int]],
    ) -> tuple[Path, int, os.stat_result, str | None] | None:
        """The rotated copy of a file cut back under its inode: the first rotated name
        whose bytes up to the position hash to what was read (source, descriptor, stat,
        the path to store its position under when it is followed itself)."""
        for candidate in rotated_names(Path(position.path), self.rotated):
            key = str(candidate)
            if key in claimed:
                continue
            opened = self.open.open(candidate)
            if opened is None:
                continue
            fd, st = opened
            if identity(st) in known_ids or identity(st) == (position.device, position.inode):
                continue
            if changed(fd, st.st_size, position.offset, position.head, position.tail) is None:
                if key in stats:
                    claimed.add(key)
                return candidate, fd, st, key if key in stats else None
            self.open.forget(identity(st))
        return None

    def _plan_moved(
        self,
        position: Position,
        plan: Plan,
        stats: dict[str, os.stat_result],
        by_id: dict[tuple[int, int], str],
        claimed: set[str],
        known_ids: set[tuple[int, int]],
    ) -> None:
        """A position whose path holds another file, or none: its file is found by its
        identity and read to its end, then the file that took the name from its start."""
        old = (position.device, position.inode)
        path = Path(position.path)
        followed = position.rotated_from or position.path
        where = by_id.get(old)
        plan.drops.add(position.path)
        renamed = False
        if where is not None and where != position.path and where not in claimed:
            claimed.add(where)  # renamed to a name that is followed itself: followed there
            self._plan_renamed(position, Path(where), stats[where], plan)
            renamed = True
        elif compressed(path):
            log.info("%s: gone (it was read whole)", path)
        else:
            renamed = self._plan_drain(position, plan, stats, claimed, known_ids)
        st = stats.get(position.path)
        if st is not None and position.path not in claimed and identity(st) not in known_ids:
            claimed.add(position.path)
            if not renamed:
                plan.note(
                    "restart",
                    followed,
                    f"{path}: replaced (another file under the same name); read again from its start",
                )
            self._plan_new(path, st, plan, known_ids)

    def _plan_renamed(self, position: Position, where: Path, st: os.stat_result, plan: Plan) -> None:
        """A followed file renamed to a name that is followed too: its position moves there."""
        followed = position.rotated_from or position.path
        moved = replace(position, path=str(where), rotated_from=None)
        if compressed(where):
            plan.touched[moved.path] = moved
            plan.note("rotation", followed, f"{position.path}: renamed to {where}; followed there")
            return
        opened = self.open.open(where, identity(st))
        if opened is None:
            return
        fd, fst = opened
        why = changed(fd, fst.st_size, position.offset, position.head, position.tail)
        if why is not None:
            moved = replace(moved, offset=0, line=0, head=None, tail=None)
            plan.note("restart", followed, f"{where} (renamed from {position.path}): {why}; read again from its start")
        else:
            plan.note(
                "rotation",
                followed,
                f"{position.path}: renamed to {where}; followed there from line {position.line + 1}",
            )
        self.open.watch(identity(fst)).size = fst.st_size
        plan.reads.append(Read(where, fd, moved, followed, moved.path, store=True))

    def _plan_drain(
        self,
        position: Position,
        plan: Plan,
        stats: dict[str, os.stat_result],
        claimed: set[str],
        known_ids: set[tuple[int, int]],
    ) -> bool:
        """The old file of a position whose path lost it: through the descriptor held on
        it, or found in its directory by its inode; read to its end (and, renamed, followed
        under its new name). Returns whether it was found renamed."""
        old = (position.device, position.inode)
        path = Path(position.path)
        followed = position.rotated_from or position.path
        fd = self.open.held(old)
        location = None
        if fd is None or os.fstat(fd).st_nlink > 0:
            location = find_inode(path.parent, *old)
        if fd is None and location is not None:
            opened = self.open.open(location, old)
            fd = None if opened is None else opened[0]
        watch = self.open.watch(old)
        if fd is None:
            plan.forget.add(old)
            unread = watch.size - position.offset
            if unread > 0:
                loss = Loss(followed)
                loss.add(unread, f"{path}: {unread} bytes it held past line {position.line} at the last poll")
                plan.losses.append(loss)
            message = (
                f"{path}: gone (deleted, or moved out of {path.parent}) while no descriptor was held on it; it was "
                f"read up to byte {position.offset} (line {position.line}): what was appended after that, if "
                "anything, is lost with it and cannot be counted"
            )
            if position.rotated_from is None or unread > 0:
                plan.note("rotation", followed, message)
            else:
                log.info(message)  # a rotated file at the end of its life (logrotate removed it)
            return False
        fst = os.fstat(fd)
        why = changed(fd, fst.st_size, position.offset, position.head, position.tail)
        start = position if why is None else replace(position, offset=0, line=0, head=None, tail=None)
        if why is not None:
            plan.note("restart", followed, f"{location or path}: {why}; read again from its start")
        if location is not None:
            rotated_from = position.rotated_from or position.path
            start = replace(start, path=str(location), rotated_from=rotated_from)
            plan.reads.append(Read(location, fd, start, followed, str(location), rotated_from, store=True))
            if position.rotated_from is not None:
                # A rotated copy renamed again: the copies rotated after it and never
                # followed (the run rotated while no follower ran) are read whole too.
                middle = self._plan_middle(Path(followed), fst, plan, stats, claimed, known_ids | {old}, copies=None)
                log.info("%s: renamed to %s; followed there%s", path, location, middle)
                return True
            middle = self._plan_middle(path, fst, plan, stats, claimed, known_ids | {old}, copies=None)
            plan.note(
                "rotation",
                followed,
                f"{path}: renamed to {location.name} (rotated): read there from line {start.line + 1} to its end, "
                f"and followed there while it grows{middle}; {path.name} is read from its start when it is there",
            )
            return True
        state = "deleted" if fst.st_nlink == 0 else f"moved out of {path.parent}"
        loss = Loss(followed)
        plan.losses.append(loss)
        plan.forget.add(old)
        notice = (
            f"{path}: {state} while followed: read from line {start.line + 1} to its end through the descriptor "
            "held on it (what is written to it after this poll is not seen)"
        )
        plan.reads.append(Read(path, fd, start, followed, None, final=True, loss=loss, notice=notice))
        return False

    def _plan_middle(
        self,
        path: Path,
        old: os.stat_result,
        plan: Plan,
        stats: dict[str, os.stat_result],
        claimed: set[str],
        known_ids: set[tuple[int, int]],
        *,
        copies: Loss | None,
    ) -> str:
        """Files rotated between the old file and the new one (two rotations between
        polls): rotated names not followed yet, changed since the old file last was; read
        whole, oldest first (``copies``: they are copies of a copytruncate, counted in that
        loss). Returns the words for the rotation message."""
        found = []
        for candidate in rotated_names(path, self.rotated):
            st = _stat(str(candidate))
            key = str(candidate)
            if st is None or identity(st) in known_ids or key in claimed or st.st_mtime_ns < old.st_mtime_ns:
                continue
            found.append((st.st_mtime_ns, candidate, st))
        names = []
        for _, candidate, st in sorted(found, key=lambda t: t[0]):
            opened = self.open.open(candidate, identity(st))
            if opened is None:
                continue
            fd, fst = opened
            key = str(candidate)
            claimed.add(key)
            start = Position(key, fst.st_dev, fst.st_ino, 0, 0, None)
            if copies is not None:
                listed = key if key in stats else None
                plan.reads.append(
                    Read(candidate, fd, start, str(path), listed, final=True, cut_first=True, loss=copies)
                )
                plan.forget.add(identity(fst))
            else:
                start = replace(start, rotated_from=str(path))
                plan.reads.append(Read(candidate, fd, start, str(path), key, str(path), store=True))
            names.append(candidate.name)
        return f" ({', '.join(names)}: rotated in between, read whole)" if names else ""
