"""Appending traces to a lake: idempotent by trace id, visible all at once.

One :func:`append` is one write (one :data:`~tracedb.lake.catalog.BATCH` id): the rows
of its new traces are committed table by table, ``traces`` last. The traces commit is
the visibility marker, and the only one whose check matters: just before each attempt
the trace ids are looked up again in the table as it is then, and the ones another
writer made visible meanwhile are dropped; on a commit conflict the table is reloaded
and the check made again (pyiceberg's own retries are off on ``traces``, they would
re-apply the append without it). Rows of a trace whose traces row another writer
committed first stay behind with this write's batch id, invisible.

The other tables' appends keep pyiceberg's own retries (they reuse the data files
written); when those run out, the append is made again, up to :data:`TABLE_ATTEMPTS`
times. The report counts the write's commits and its conflicted attempts (retries), as
the catalog saw them (:class:`tracedb.lake.catalog.Commits`).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.exceptions import CommitFailedException

from tracedb.lake import labels, nulls
from tracedb.lake.catalog import BATCH, Commits, batched, lake_schema, lake_tables, per_trace
from tracedb.lake.scan import scan_keys

COMMIT_ATTEMPTS = 20
"""How often the traces commit is tried (each time after reloading the table and checking
the trace ids again) before the write gives up."""
TABLE_ATTEMPTS = 10
"""How often the append to another table is made (each with pyiceberg's own retries)
before the write gives up."""


@dataclass
class AppendReport:
    """What one write added to a lake."""

    traces: int = 0
    skipped: int = 0
    """Traces already visible in the lake (or made visible by another writer meanwhile)."""
    rows: dict[str, int] = field(default_factory=dict)
    """Rows appended per table (including rows a concurrent writer made redundant)."""
    attempts: int = 0
    """Commits of ``traces`` tried (1 without a conflict)."""
    sequence_number: int | None = None
    """The sequence number of the snapshot that made this write's traces visible: their ``seq``."""
    commits: int = 0
    """Table commits this write made (one per table it appended to, ``traces`` included)."""
    retries: int = 0
    """Commit attempts of this write that conflicted with another writer's commit and were
    made again (pyiceberg's own retries and tracedb's)."""

    def merge(self, other: AppendReport) -> None:
        self.traces += other.traces
        self.skipped += other.skipped
        self.attempts += other.attempts
        self.commits += other.commits
        self.retries += other.retries
        for name, n in other.rows.items():
            self.rows[name] = self.rows.get(name, 0) + n
        if other.sequence_number is not None:
            self.sequence_number = max(self.sequence_number or 0, other.sequence_number)


def visible_ids(table: object, ids: list[str]) -> set[str]:
    """The ones of ``ids`` that have a traces row in ``table`` (the traces table as loaded)."""
    if not ids:
        return set()
    found = scan_keys(table, "trace_id", ids, columns=["trace_id"])
    return set(found.column("trace_id").to_pylist())


def _in(column: pa.ChunkedArray | pa.Array, values: list) -> pa.Array:
    return pc.is_in(column, value_set=pa.array(values, column.type))


def lake_rows(name: str, rows: pa.Table, batch: str) -> pa.Table:
    """``rows`` (stored schema of table ``name``) in the lake's schema, carrying write
    ``batch``; a traces row's ``seq`` is left empty (the file store's numbering means
    nothing in the lake: readers take the commit's sequence number)."""
    schema = lake_tables()[name]
    target = lake_schema(name, schema)
    blank = {"seq"} if name == "traces" else set()  # a write's seq is its commit (readers take the file's)
    columns = {
        f.name: rows.column(f.name)
        if f.name in rows.column_names and f.name not in blank
        else pa.nulls(rows.num_rows, f.type)
        for f in schema
    }
    table = nulls.encode(name, pa.table(columns)).cast(pa.schema([f for f in target if f.name != BATCH]))
    if batched(name, schema):
        table = table.append_column(pa.field(BATCH, pa.string()), pa.array([batch] * rows.num_rows, pa.string()))
    return table


def append(lake: object, rows: Mapping[str, pa.Table]) -> AppendReport:
    """Append the traces of ``rows`` (tables by name in the stored schemas, as a file
    store holds them: the traces and everything of theirs) that the lake does not show
    yet. ``seq`` is not stored: readers take it from the traces commit (see
    :func:`tracedb.lake.scan.scan_traces`)."""
    counter: Commits = lake.commits  # type: ignore[attr-defined]
    held = Commits(counter.attempts, counter.conflicts)
    report = AppendReport()
    try:
        _append(lake, rows, report)
    finally:
        report.commits = (counter.attempts - counter.conflicts) - (held.attempts - held.conflicts)
        report.retries = counter.conflicts - held.conflicts
    return report


def _append(lake: object, rows: Mapping[str, pa.Table], report: AppendReport) -> None:
    traces = rows.get("traces")
    if traces is None or traces.num_rows == 0:
        _append_rejects(lake, rows, uuid.uuid4().hex, report)
        return
    ids = traces.column("trace_id").to_pylist()
    shown = visible_ids(lake.table("traces"), ids)  # type: ignore[attr-defined]  # once, not per id
    new = [t for t in ids if t not in shown]
    report.skipped = len(ids) - len(new)
    batch = uuid.uuid4().hex
    if not new:
        _append_rejects(lake, rows, batch, report)
        return
    schemas = lake_tables()
    keep = traces.filter(_in(traces.column("trace_id"), new))
    episodes = [e for e in keep.column("episode_id").to_pylist() if e is not None]
    # credit_sets after the values (a reader that sees a set sees its values), traces last.
    order = [n for n in schemas if n not in ("traces", "rejects", "credit_sets")] + ["credit_sets"]
    relied: pa.Table | None = None
    for name in order:
        table = rows.get(name)
        if table is None or table.num_rows == 0:
            continue
        if per_trace(name, schemas[name]):
            table = table.filter(_in(table.column("trace_id"), new))
        elif name == "episodes":
            table = table.filter(_in(table.column("episode_id"), episodes))
        elif name == "segments":
            nodes = rows.get("nodes")
            wanted = nodes.filter(_in(nodes.column("trace_id"), new)).column("segment_id") if nodes is not None else []
            used = pc.unique(pa.chunked_array(wanted, pa.binary()))
            table = table.filter(pc.is_in(table.column("segment_id"), value_set=used))
            present = _in(table.column("segment_id"), _segments_present(lake, table))
            relied = table.filter(present)  # held by the lake already: checked again before traces
            table = table.filter(pc.invert(present))
        elif name == "policy_labels":
            table = labels.new_rows(lake, table)
        elif name == "credit_sets":
            present = set(lake.table(name).scan(selected_fields=("name",)).to_arrow().column("name").to_pylist())  # type: ignore[attr-defined]
            table = table.filter(pc.invert(_in(table.column("name"), sorted(present))))
        if table.num_rows:
            _append_table(lake, name, lake_rows(name, table, batch))
            report.rows[name] = table.num_rows
    if relied is not None and relied.num_rows:
        # A compaction that read the nodes before this write's were committed may have
        # removed segments the check above found (a dead writer's, unused): store those
        # again, now that the nodes using them are committed (a compaction reading the
        # nodes from here on keeps them: young rows are kept).
        gone = relied.filter(pc.invert(_in(relied.column("segment_id"), _segments_present(lake, relied))))
        if gone.num_rows:
            _append_table(lake, "segments", lake_rows("segments", gone, batch))
            report.rows["segments"] = report.rows.get("segments", 0) + gone.num_rows
    _commit_traces(lake, keep, batch, report)
    _append_rejects(lake, rows, batch, report)
    return


def _segments_present(lake: object, segments: pa.Table) -> list[bytes]:
    ids = pc.unique(segments.column("segment_id")).to_pylist()
    if not ids:
        return []
    found = scan_keys(lake.table("segments"), "segment_id", ids, columns=["segment_id"])  # type: ignore[attr-defined]
    return pc.unique(found.column("segment_id")).to_pylist()


def _commit_traces(lake: object, traces: pa.Table, batch: str, report: AppendReport) -> None:
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        table = lake.table("traces")  # type: ignore[attr-defined]
        ids = traces.column("trace_id").to_pylist()
        taken = visible_ids(table, ids)
        rest = traces.filter(pc.invert(_in(traces.column("trace_id"), sorted(taken)))) if taken else traces
        report.attempts = attempt
        if rest.num_rows == 0:
            report.skipped += traces.num_rows
            return
        try:
            table.append(lake_rows("traces", rest, batch))
        except CommitFailedException:
            _back_off(attempt)
            continue
        report.skipped += traces.num_rows - rest.num_rows
        report.traces = rest.num_rows
        report.rows["traces"] = rest.num_rows
        report.sequence_number = table.current_snapshot().sequence_number
        return
    raise CommitFailedException(
        f"traces: {COMMIT_ATTEMPTS} commits conflicted with other writers; nothing of this write is visible"
    )


def _append_table(lake: object, name: str, rows: pa.Table) -> None:
    """Append ``rows`` to table ``name`` (not ``traces``), made again after a conflict
    that pyiceberg's own retries did not get past."""
    for attempt in range(1, TABLE_ATTEMPTS + 1):
        try:
            lake.table(name).append(rows)  # type: ignore[attr-defined]
            return
        except CommitFailedException:
            if attempt == TABLE_ATTEMPTS:
                raise CommitFailedException(
                    f"{name}: {TABLE_ATTEMPTS} appends conflicted with other writers; nothing of this write is visible"
                ) from None
            _back_off(attempt)


def _back_off(attempt: int) -> None:
    """Wait before attempt ``attempt + 1``: exponential, capped at 2 s, jittered so that
    writers that conflicted do not meet again."""
    time.sleep(min(0.05 * 2**attempt, 2.0) * random.uniform(0.5, 1.0))


def _append_rejects(lake: object, rows: Mapping[str, pa.Table], batch: str, report: AppendReport) -> None:
    """Rejects are a log, not trace rows: appended after the traces (readers show each once)."""
    rejects = rows.get("rejects")
    if rejects is not None and rejects.num_rows:
        _append_table(lake, "rejects", lake_rows("rejects", rejects, batch))
        report.rows["rejects"] = rejects.num_rows
