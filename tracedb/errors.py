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


class DatabaseError(TraceDBError):
    """A path that cannot be opened as a tracedb database (says which and why)."""


class SchemaVersionError(DatabaseError):
    """The database file holds another schema version than this tracedb reads (and cannot
    be upgraded here: it is newer, or opened read-only)."""


class DatabaseLocked(DatabaseError):
    """Another process holds the file (for writing, or read-only while this one wants to
    write); ``pid`` is that process as DuckDB reports it."""

    def __init__(self, message: str, pid: int | None = None) -> None:
        self.pid = pid
        super().__init__(message)


class WriteError(TraceDBError):
    """A write that cannot be applied; nothing of it was written."""


class SqlRefused(TraceDBError):
    """SQL refused where only reads may run (``tracedb sql`` without ``--write``, the
    lake's SQL, ``POST /sql``): nothing of it ran (:mod:`tracedb.sqlcheck`)."""


class InputError(TraceDBError):
    """An input file that cannot be read to its end (corrupt or truncated compression).

    The lines before ``line`` were read whole; ``line`` and what follows it are lost."""

    def __init__(self, file: str, reason: str, line: int | None = None, partial: bytes = b"") -> None:
        self.file = file
        self.reason = reason
        self.line = line
        self.partial = partial
        """The bytes of the line the damage cut, as far as they were read."""
        where = file if line is None else f"{file}:{line}"
        super().__init__(f"{where}: {reason}")


class StepChanged(TraceDBError):
    """A step rebuilt from its manifest would not be the step: the selection, the credit or
    a replayed group differs in the database now (the message names what)."""


class CreditWarning(UserWarning):
    """A credit run whose output is another algorithm's by construction (anchor with no
    state shared by two turns equals grpo, ...): legal, and almost never what was meant.
    :func:`tracedb.credit.run` collects them into its result's ``warnings``."""
