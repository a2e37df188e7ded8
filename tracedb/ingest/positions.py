"""A follower's positions (``follow_positions``), and what it tells about its files.

A :class:`Position` is where a follower is in one file, stored in the same transaction as
the lines read up to there; a :class:`FollowEvent` is something a person running it must
know (a file read again from its start, a rotation followed, bytes lost); a
:class:`FollowReport` sums up a follower's run.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import pyarrow as pa

from tracedb import tables
from tracedb.handle import Handle

COLUMNS = 'path, device, inode, "offset", line, head, tail, rotated_from'
"""The stored columns of a :class:`Position`, in its field order."""


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
    """BLAKE2b of the first ``min(offset, 4096)`` bytes."""
    tail: bytes | None = None
    """BLAKE2b of the (up to) 4096 bytes before ``offset`` (None: not taken yet, a
    position schema 4 wrote)."""
    rotated_from: str | None = None
    """A rotated file still read by its identity: the followed path it was renamed from."""


@dataclass
class FollowEvent:
    """Something a person running the follower must know: a file read again from its
    start (``restart``), a rotation followed (``rotation``), bytes lost (``loss``)."""

    kind: str
    file: str
    """The followed file it is about."""
    message: str
    bytes: int = 0
    """``loss``: bytes known to be in no file and not ingested (at least)."""
    lines: int = 0
    """``loss``: lines they belong to (at least)."""

    def __str__(self) -> str:
        return self.message


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
    rotations: list[str] = field(default_factory=list)
    """Rotations followed (renamed away, copied and truncated, deleted), each saying what was read where."""
    lost: list[FollowEvent] = field(default_factory=list)
    """Bytes in no file that were not ingested (after a copytruncate, a deletion), naming the file."""
    lost_bytes: int = 0
    lost_lines: int = 0
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
        if self.rotations:
            text += f"; {len(self.rotations)} rotation(s) followed"
        if self.lost:
            files = sorted({e.file for e in self.lost})
            lines = f"{self.lost_lines} line" + ("s" if self.lost_lines != 1 else "")
            text += f"; LOST at least {self.lost_bytes} bytes ({lines}) of {', '.join(files)}"
        return text


def load(handle: Handle) -> dict[str, Position]:
    """The stored positions, by path."""
    rows = handle.con.execute(f"SELECT {COLUMNS} FROM follow_positions").fetchall()
    return {r[0]: Position(*r) for r in rows}


def store(handle: Handle, moved: list[Position], drops: set[str]) -> None:
    """Write the new positions and remove the dropped ones (inside the caller's transaction)."""
    gone = sorted({p.path for p in moved} | drops)
    if gone:
        handle.con.execute("DELETE FROM follow_positions WHERE path IN (SELECT unnest(?::VARCHAR[]))", [gone])
    if not moved:
        return
    columns = {
        "path": pa.array([p.path for p in moved], pa.string()),
        "device": pa.array([p.device for p in moved], pa.int64()),
        "inode": pa.array([p.inode for p in moved], pa.int64()),
        "offset": pa.array([p.offset for p in moved], pa.int64()),
        "line": pa.array([p.line for p in moved], pa.int64()),
        "head": pa.array([p.head for p in moved], pa.binary()),
        "tail": pa.array([p.tail for p in moved], pa.binary()),
        "rotated_from": pa.array([p.rotated_from for p in moved], pa.string()),
    }
    rows = tables.table_from(tables.inserted(tables.FOLLOW_POSITIONS), columns)
    with handle.registered("_tdb_positions", rows):
        handle.con.execute(f"INSERT INTO follow_positions ({COLUMNS}) SELECT {COLUMNS} FROM _tdb_positions")


def follow_positions(handle: Handle) -> list[Position]:
    """The stored positions (every file a follower of this database has read)."""
    return sorted(load(handle).values(), key=lambda p: p.path)
