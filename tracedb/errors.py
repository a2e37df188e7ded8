"""Errors tracedb raises, and the policy behind them.

Bad input is reported, never half-written. Every rejection names where the problem
is (file, line, trace id, node, field) and what disagrees (the lengths or the
values); a record that is rejected during ingest is kept, with its reason, in the
``rejects`` table, and the records beside it are still ingested. A write that cannot
be applied whole is not applied at all: the database is left as it was.
"""

from __future__ import annotations

from dataclasses import dataclass


class TraceDBError(Exception):
    """Base class of every error tracedb raises on purpose."""


@dataclass
class Location:
    """Where a problem sits in the input; every part is optional."""

    file: str | None = None
    line: int | None = None
    trace_id: str | None = None
    node: int | None = None
    field: str | None = None

    def __str__(self) -> str:
        parts = []
        if self.file is not None:
            parts.append(f"{self.file}:{self.line}" if self.line is not None else self.file)
        if self.trace_id is not None:
            parts.append(f"trace {self.trace_id}")
        if self.node is not None:
            parts.append(f"node {self.node}")
        if self.field is not None:
            parts.append(f"field {self.field}")
        return ", ".join(parts)


class RecordError(TraceDBError):
    """One input record is invalid. ``location`` says where, ``reason`` what."""

    def __init__(self, reason: str, location: Location | None = None) -> None:
        self.reason = reason
        self.location = location or Location()
        where = str(self.location)
        super().__init__(f"{where}: {reason}" if where else reason)


class IngestAborted(TraceDBError):
    """A strict ingest met a bad record; nothing of that ingest was written."""

    def __init__(self, error: RecordError) -> None:
        self.error = error
        super().__init__(f"ingest aborted, database unchanged: {error}")


class NotFound(TraceDBError, KeyError):
    """A trace, branch or node that the database does not hold."""

    def __str__(self) -> str:  # KeyError would repr() the message
        return str(self.args[0]) if self.args else "not found"


class SchemaVersionError(TraceDBError):
    """The database file was written by an incompatible tracedb schema."""


class WriteError(TraceDBError):
    """A write that cannot be applied; nothing of it was written."""
