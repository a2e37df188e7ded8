"""CEC records: the harness's per-turn snapshots, per-trace keys and verifications as
JSONL, validated and ingested with the rejection rules of trace ingest (see
:mod:`tracedb.cec`), and the ``cec_*`` tables they go into."""

from __future__ import annotations

import json
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import pyarrow as pa
import pydantic
from pydantic import BaseModel, ConfigDict, Field

from tracedb import tables
from tracedb.cec.rules import CEC_SCHEMA_VERSION, CecError
from tracedb.errors import IngestAborted, InputError, Location, RecordError
from tracedb.handle import Handle, HandleOf, handle_of
from tracedb.ingest.files import LongLine, find_files, read_lines
from tracedb.ingest.parse import json_object
from tracedb.ingest.rejects import Raw, Reject, Report, record_rejects
from tracedb.sqltext import load_sql


class _Record(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    trace_id: str = Field(min_length=1)
    info: dict[str, Any] | None = None
    """Free-form harness metadata (kept, not interpreted)."""


class TurnRecord(_Record):
    """One assistant turn: ``{"kind": "turn", "trace_id", "node", "tree", "changed_paths", "format_error"}``."""

    kind: Literal["turn"]
    node: int = Field(ge=0)
    """The sampled assistant node of the trace this turn produced."""
    tree: str = Field(min_length=1)
    """Tree id after the turn's actions finished (opaque; equal content, equal id)."""
    changed_paths: list[str]
    """Repository-relative paths changed since the previous tree (no renames)."""
    format_error: bool
    """The turn was a format error: it executed nothing (its changed paths are empty)."""


class TraceRecord(_Record):
    """Per trace: ``{"kind": "trace", "trace_id", "baseline_tree", "instance_id", "rep", "cache_salt"}``."""

    kind: Literal["trace"]
    baseline_tree: str = Field(min_length=1)
    instance_id: str = Field(min_length=1)
    rep: int | str
    cache_salt: str


class VerificationRecord(_Record):
    """A verification: ``{"kind": "verification", "trace_id", "role", "resolved", "f2p", "p2p"}``
    or ``{"kind": "verification", "trace_id", "role", "status": "missing" | "unparseable"}``."""

    kind: Literal["verification"]
    role: Literal["original", "intervention"]
    status: Literal["ok", "missing", "unparseable"] = "ok"
    resolved: bool | None = None
    f2p: dict[str, str | None] | None = None
    """Expected fail-to-pass test id -> outcome (None: absent from the report)."""
    p2p: dict[str, str | None] | None = None
    """Expected pass-to-pass test id -> outcome."""


AnyRecord = Annotated[TurnRecord | TraceRecord | VerificationRecord, Field(discriminator="kind")]
_ADAPTER: pydantic.TypeAdapter[Any] = pydantic.TypeAdapter(AnyRecord)


def parse_record(raw: bytes | str, where: Location | None = None) -> TurnRecord | TraceRecord | VerificationRecord:
    """Parse and validate one JSONL line; raises :class:`RecordError` naming the field.

    Checks what one line can tell: the pydantic contract (strict: no conversions, no
    unknown fields) and the record's own rules. References to the database are checked
    by :func:`ingest`.
    """
    where = where or Location()
    value = json_object(raw, where)
    loc = Location(where.file, where.line, value.get("trace_id") if isinstance(value.get("trace_id"), str) else None)
    node = value.get("node")
    if value.get("kind") == "turn" and type(node) is int:
        loc.node = node
    try:
        record = _ADAPTER.validate_python(value)
    except pydantic.ValidationError as e:
        first = e.errors()[0]
        path = [str(p) for p in first["loc"]]
        if first["type"] in ("union_tag_not_found", "union_tag_invalid"):
            loc.field = "kind"
            raise RecordError("kind must be one of 'turn', 'trace', 'verification'", loc) from None
        path = path[1:]  # the first element is the kind tag
        message = first["msg"]
        if path[:1] == ["rep"]:  # the int | str union names its members in the location
            path, message = ["rep"], "Input should be an integer or a string"
        loc.field = ".".join(path) or None
        if first["type"] != "missing" and "input" in first:
            shown = json.dumps(first["input"], default=str)
            message += f" (got {shown if len(shown) <= 80 else shown[:77] + '...'})"
        raise RecordError(message, loc) from None
    problem = _record_problem(record)
    if problem is not None:
        loc.field, reason = problem
        raise RecordError(reason, loc)
    return record


def _record_problem(record: Any) -> tuple[str, str] | None:
    if isinstance(record, TurnRecord):
        seen = set()
        for path in record.changed_paths:
            if not path or path.startswith("/") or "\0" in path:
                return "changed_paths", f"{path!r} is not a repository-relative path"
            if path in seen:
                return "changed_paths", f"{path!r} is listed twice"
            seen.add(path)
        if record.format_error and record.changed_paths:
            return (
                "changed_paths",
                f"a format-error turn executes nothing, yet {len(record.changed_paths)} paths changed",
            )
    if isinstance(record, VerificationRecord):
        fields = {"resolved": record.resolved, "f2p": record.f2p, "p2p": record.p2p}
        if record.status == "ok":
            for name, value in fields.items():
                if value is None:
                    return name, f"a verification with a report needs {name} (or status 'missing'/'unparseable')"
        else:
            for name, value in fields.items():
                if value is not None:
                    return name, f"a {record.status} report has no {name}"
    return None


def _canonical(record: Any) -> str:
    return json.dumps(record.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def _key(record: Any) -> tuple[str, Any]:
    if isinstance(record, TurnRecord):
        return ("turn", (record.trace_id, record.node))
    if isinstance(record, TraceRecord):
        return ("trace", record.trace_id)
    return ("verification", (record.trace_id, record.role))


# =========================================================================== schema


def install(db: HandleOf) -> None:
    """Create the ``cec_*`` tables when missing (``schema/cec.sql``; idempotent)."""
    handle = handle_of(db)
    found = handle.scalar("SELECT value FROM tracedb_meta WHERE key = 'cec_schema_version'")
    if found is not None:
        if int(found) != CEC_SCHEMA_VERSION:
            raise CecError(f"{handle.path}: cec schema version {found}, this tracedb reads {CEC_SCHEMA_VERSION}")
        return
    with handle.transaction():
        handle.con.execute(load_sql("cec.sql"))
        handle.con.execute(
            "INSERT OR REPLACE INTO tracedb_meta VALUES ('cec_schema_version', ?)", [str(CEC_SCHEMA_VERSION)]
        )


def ensure_installed(db: HandleOf) -> None:
    """Install when writable; a read-only file without the tables is an error, not a crash."""
    handle = handle_of(db)
    try:
        install(handle)
    except Exception as e:  # DuckDB refuses DDL on a read-only file
        if "read-only" in str(e).lower() or "read only" in str(e).lower():
            raise CecError(f"{handle.path} has no cec tables yet: ingest cec records first") from None
        raise


# =========================================================================== ingest


@dataclass
class CecIngestReport(Report):
    """What one :func:`ingest_records` call did, per record kind."""

    files: int = 0
    lines: int = 0
    added: dict[str, int] = field(default_factory=lambda: {"trace": 0, "turn": 0, "verification": 0})
    skipped: int = 0
    """Records already stored (or earlier in this ingest) with the same content: not added again."""
    rejected: list[Reject] = field(default_factory=list)
    seconds: float = 0.0

    def __str__(self) -> str:
        a = self.added
        return (
            f"ingested {a['trace']} trace, {a['turn']} turn and {a['verification']} verification records "
            f"from {self.files} files in {self.seconds:.2f}s"
        ) + self.notes()


def ingest_records(db: HandleOf, paths: str | Path | Iterable[str | Path], *, strict: bool = False) -> CecIngestReport:
    """Ingest CEC records (JSONL, one object per line with ``kind``) into ``cec_*`` tables.

    The rules of trace ingest: a bad line is rejected with its file, line, trace id,
    node, field and reason, kept in ``rejects`` with the raw line, and its neighbours are
    ingested; ``strict=True`` raises :class:`IngestAborted` on the first bad line and
    leaves the database unchanged; one call is one transaction. A record must refer to
    a trace in the database, and a turn to a sampled assistant node of it. Re-ingesting
    is idempotent: a record whose key (trace; trace and node; trace and role) is stored
    with the same content is skipped, with different content it is rejected.
    """
    handle = handle_of(db)
    started = time.perf_counter()
    ensure_installed(handle)
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = find_files(paths)
    report = CecIngestReport(files=len(files))
    rejects: list[tuple[Reject, bytes | Raw]] = []

    def reject(error: RecordError, raw: bytes | Raw) -> None:
        if strict:
            raise IngestAborted(error)
        item = Reject.of(error)
        rejects.append((item, raw))
        report.rejected.append(item)

    parsed: list[tuple[Any, str, int, bytes | Raw]] = []  # (record or RecordError, file, line, raw), in line order
    for path in files:
        try:
            for number, raw in read_lines(path):
                report.lines += 1
                if isinstance(raw, LongLine):
                    error = RecordError(raw.reason, Location(str(path), number))
                    parsed.append((error, str(path), number, Raw(raw.prefix, raw.size)))
                    continue
                try:
                    parsed.append((parse_record(raw, Location(str(path), number)), str(path), number, raw))
                except RecordError as e:
                    parsed.append((e, str(path), number, raw))
        except InputError as e:  # a file cut short: the lines before the damage stay, the damage is a reject
            parsed.append((RecordError(e.reason, Location(e.file, e.line)), e.file, e.line or 0, Raw(e.partial, None)))

    good = [item[0] for item in parsed if not isinstance(item[0], RecordError)]
    trace_ids = sorted({r.trace_id for r in good})
    known_traces = handle.existing("traces", "trace_id", trace_ids)
    nodes = _node_roles(handle, trace_ids)
    stored = _stored_records(handle, trace_ids)
    rows: dict[str, list[dict[str, Any]]] = {"trace": [], "turn": [], "verification": []}
    for record, source, number, raw in parsed:
        if isinstance(record, RecordError):
            reject(record, raw)
            continue
        node = record.node if isinstance(record, TurnRecord) else None
        where = Location(source, number, record.trace_id, node)
        problem = None
        if record.trace_id not in known_traces:
            problem = "trace_id", f"trace {record.trace_id!r} is not in the database (ingest its traces first)"
        elif isinstance(record, TurnRecord):
            role = nodes.get((record.trace_id, record.node))
            if role is None:
                problem = "node", f"the trace has no node {record.node}"
            elif role != ("assistant", True):
                problem = (
                    "node",
                    (
                        f"node {record.node} is a {'sampled ' if role[1] else ''}{role[0] or 'message'} node; "
                        "turns are sampled assistant nodes"
                    ),
                )
        if problem is None:
            kind, key = _key(record)
            canonical = _canonical(record)
            prior = stored.get((kind, key))
            if prior is not None:
                if prior[0] == canonical:
                    report.skipped += 1
                    continue
                problem = None, f"conflicts with the {kind} record already stored from {prior[1]}"
            else:
                stored[(kind, key)] = (canonical, f"{source}:{number}")
                rows[kind].append(_row(record, canonical, source, number))
                report.added[kind] += 1
                continue
        where.field, reason = problem
        reject(RecordError(reason, where), raw)

    with handle.transaction():
        _insert(handle, rows)
        record_rejects(handle, rejects)
    report.seconds = time.perf_counter() - started
    return report


def _node_roles(db: Handle, trace_ids: list[str]) -> dict[tuple[str, int], tuple[str | None, bool]]:
    if not trace_ids:
        return {}
    rows = db.con.execute(
        "SELECT trace_id, node_index, role, coalesce(sampled, false) FROM nodes "
        "WHERE trace_id IN (SELECT unnest(?::VARCHAR[]))",
        [trace_ids],
    ).fetchall()
    return {(t, n): (role, sampled) for t, n, role, sampled in rows}


def _stored_records(db: Handle, trace_ids: list[str]) -> dict[tuple[str, Any], tuple[str, str]]:
    """(kind, key) -> (canonical record, where it came from) for records already stored."""
    out: dict[tuple[str, Any], tuple[str, str]] = {}
    if not trace_ids:
        return out
    queries = {
        "trace": "SELECT trace_id, NULL, record, source, line FROM cec_traces",
        "turn": "SELECT trace_id, node_index, record, source, line FROM cec_turns",
        "verification": "SELECT trace_id, role, record, source, line FROM cec_verifications",
    }
    for kind, query in queries.items():
        rows = db.con.execute(f"{query} WHERE trace_id IN (SELECT unnest(?::VARCHAR[]))", [trace_ids]).fetchall()
        for trace_id, second, record, source, line in rows:
            key = trace_id if kind == "trace" else (trace_id, second)
            canonical = json.dumps(json.loads(record), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
            out[(kind, key)] = (canonical, f"{source}:{line}")
    return out


def _row(record: Any, canonical: str, source: str, line: int) -> dict[str, Any]:
    common = {
        "trace_id": record.trace_id,
        "info": None if record.info is None else json.dumps(record.info),
        "record": canonical,
        "source": source,
        "line": line,
    }
    if isinstance(record, TurnRecord):
        return {
            **common,
            "node_index": record.node,
            "tree": record.tree,
            "changed_paths": list(record.changed_paths),
            "format_error": record.format_error,
        }
    if isinstance(record, TraceRecord):
        return {
            **common,
            "baseline_tree": record.baseline_tree,
            "instance_id": record.instance_id,
            "rep": str(record.rep),
            "cache_salt": record.cache_salt,
        }
    as_map = lambda d: None if d is None else list(d.items())  # noqa: E731
    return {
        **common,
        "role": record.role,
        "status": record.status,
        "resolved": record.resolved,
        "f2p": as_map(record.f2p),
        "p2p": as_map(record.p2p),
    }


_TABLES = {"trace": tables.CEC_TRACES, "turn": tables.CEC_TURNS, "verification": tables.CEC_VERIFICATIONS}
_NAMES = {"trace": "cec_traces", "turn": "cec_turns", "verification": "cec_verifications"}


def _insert(db: Handle, rows: dict[str, list[dict[str, Any]]]) -> None:
    for kind, items in rows.items():
        if not items:
            continue
        schema = tables.inserted(_TABLES[kind])
        table = pa.Table.from_pylist(items, schema=schema)
        columns = ", ".join(schema.names)
        with db.registered("_tdb_cec_in", table):
            db.con.execute(f"INSERT INTO {_NAMES[kind]} ({columns}) SELECT {columns} FROM _tdb_cec_in")
