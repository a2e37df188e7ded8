"""Rejected records: what was wrong and where, kept in the ``rejects`` table.

Trace ingest and counterfactual-edit-credit ingest both record their rejects here, so a
reject reads the same whatever rejected it: its location, its reason, and the raw line.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa

from tracedb import runtime, tables
from tracedb.errors import Location, RecordError
from tracedb.handle import Handle


def storable_text(value: object) -> str | None:
    """``value`` as storable text: a lone surrogate (not Unicode) is written as its escape;
    anything but a string (an id that is a number, say) as its JSON-ish ``repr``."""
    if value is None:
        return None
    if not isinstance(value, str):
        value = repr(value)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return value.encode("utf-8", "backslashreplace").decode("utf-8")
    return value


@dataclass
class Reject:
    """A rejected input record and why."""

    file: str | None
    line: int | None
    trace_id: str | None
    node: int | None
    field: str | None
    reason: str

    @classmethod
    def of(cls, error: RecordError) -> Reject:
        """The reject of ``error``, every text made storable."""
        loc = error.location
        return cls(
            storable_text(loc.file),
            loc.line,
            storable_text(loc.trace_id),
            loc.node,
            storable_text(loc.field),
            storable_text(error.reason) or "",
        )

    def __str__(self) -> str:
        return str(RecordError(self.reason, Location(self.file, self.line, self.trace_id, self.node, self.field)))


@dataclass
class Raw:
    """What is kept of a rejected line that was never held whole (too long, or cut by a
    damaged file): its first bytes and, when known, its whole length."""

    prefix: bytes
    size: int | None


def record_rejects(handle: Handle, rejects: Sequence[tuple[Reject, bytes | Raw]]) -> None:
    """Insert ``(reject, raw line)`` pairs into ``rejects`` (in the caller's transaction):
    the line's first ``reject_record_bytes`` (a setting) as text, its length and SHA-256
    (of the whole line; none for a :class:`Raw` line, which was never read whole)."""
    if not rejects:
        return
    keep = runtime.settings().reject_record_bytes
    lines = [
        (raw, len(raw), hashlib.sha256(raw).hexdigest()) if isinstance(raw, bytes) else (raw.prefix, raw.size, None)
        for _, raw in rejects
    ]
    rows = {
        "source": pa.array([r.file for r, _ in rejects], pa.string()),
        "line": pa.array([r.line for r, _ in rejects], pa.int64()),
        "trace_id": pa.array([r.trace_id for r, _ in rejects], pa.string()),
        "node": pa.array([r.node for r, _ in rejects], pa.int32()),
        "field": pa.array([r.field for r, _ in rejects], pa.string()),
        "reason": pa.array([r.reason for r, _ in rejects], pa.string()),
        "record": pa.array([raw[:keep].decode("utf-8", errors="replace") for raw, _, _ in lines], pa.string()),
        "record_bytes": pa.array([size for _, size, _ in lines], pa.int64()),
        "record_sha256": pa.array([digest for _, _, digest in lines], pa.string()),
    }
    table = tables.table_from(tables.inserted(tables.REJECTS), rows)
    columns = ", ".join(table.column_names)
    with handle.registered("_tdb_rejects", table):
        handle.con.execute(f"INSERT INTO rejects ({columns}) SELECT {columns} FROM _tdb_rejects")


class Report:
    """What an ingest says when it is done: its counts (the dataclass fields of a
    subclass, which has ``skipped``, ``rejected`` and ``seconds``) and its rejects."""

    skipped: int
    rejected: list[Reject]
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.rejected

    def to_dict(self) -> dict[str, Any]:
        """The counts in field order, rejects as dicts, seconds to the millisecond."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.name == "rejected":
                value = [r.__dict__ for r in value]
            elif f.name == "seconds":
                value = round(value, 3)
            elif isinstance(value, dict):
                value = dict(value)
            out[f.name] = value
        return out

    def notes(self, what: str = "") -> str:
        """The tail of the one-line summary: how many ``what`` were already there, how
        many records were rejected."""
        text = ""
        if self.skipped:
            text += f"; {self.skipped} {what + ' ' if what else ''}already present, not added again"
        if self.rejected:
            text += f"; {len(self.rejected)} records rejected"
        return text
