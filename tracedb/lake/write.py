"""Appending traces to a lake: idempotent by trace id, visible all at once, in few commits.

A write is staged, then committed. :func:`stage` makes the rows of some traces (tables
by name in the stored schemas, as a file store holds them) into data files of the lake's
tables, one per bucket per table (:func:`tracedb.lake.commit.data_files`), all carrying one
:data:`~tracedb.lake.catalog.BATCH` id: nothing of it is visible yet. It leaves out the
traces the lake shows already (one look-up of their ids: their buckets' files whose
bounds admit them) and stores each segment its traces use once in each bucket holding one
of them (:data:`~tracedb.lake.catalog.SEGMENT_HOME`): segments are not looked up in the
lake, so a write reads nothing that grows with the lake but the trace-id check, and a
reader finds a trace's segments in its own bucket.

:func:`commit` commits staged writes together: per table one commit adding every staged
file, ``credit_sets`` after the credit values, ``traces`` last, then ``rejects``. The
traces commit is the visibility marker, and the only one whose check matters: just
before each attempt the trace ids are looked up again in the table as it is then (a
trace id staged twice keeps its first write), the ones another writer made visible
meanwhile are dropped, and the traces rows left are written and appended; on a commit
conflict the table is reloaded and the check made again (pyiceberg's own retries are off
on ``traces``, they would re-apply the append without it). Rows of a trace whose traces
row another writer committed first stay behind with their write's batch id, invisible.
:meth:`tracedb.lake.Lake.append` is one write committed alone; ``lake ingest`` commits
its tasks' staged writes once they hold ``commit_traces`` traces (:mod:`tracedb.lake.ingest`).

The other tables' commits keep pyiceberg's own retries (they reuse the data files
written); when those run out, the commit is made again, up to :data:`TABLE_ATTEMPTS`
times. The report counts the commits made and the conflicted attempts (retries), as the
catalog saw them (:class:`tracedb.lake.catalog.Commits`).
"""

from __future__ import annotations

import random
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.manifest import DataFile

from tracedb.lake import files as lake_files
from tracedb.lake import labels, nulls
from tracedb.lake.catalog import BATCH, SEGMENT_HOME, Commits, batched, lake_schema, lake_tables, per_trace
from tracedb.lake.commit import append_files, data_files
from tracedb.lake.scan import scan_keys

COMMIT_ATTEMPTS = 20
"""How often the traces commit is tried (each time after reloading the table and checking
the trace ids again) before the write gives up."""
TABLE_ATTEMPTS = 10
"""How often the commit to another table is made (each with pyiceberg's own retries)
before the write gives up."""
LAST = ("credit_sets", "traces", "rejects")
"""The tables committed after all others, in this order."""


@dataclass
class AppendReport:
    """What one write (or the writes of one commit, or of an ingest) added to a lake."""

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
    """Table commits made (one per table appended to, ``traces`` included)."""
    retries: int = 0
    """Commit attempts that conflicted with another writer's commit and were made again
    (pyiceberg's own retries and tracedb's)."""

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


@dataclass
class Staged:
    """A write made into data files, not committed yet (what an ingest task hands over)."""

    batch: str
    """The write's :data:`~tracedb.lake.catalog.BATCH` id."""
    files: dict[str, list[DataFile]] = field(default_factory=dict)
    """Data files written, per table (not those of :data:`LAST`)."""
    traces: pa.Table | None = None
    """The ``traces`` rows of its new traces (lake schema), written at the commit."""
    credit_sets: pa.Table | None = None
    rejects: pa.Table | None = None
    rows: dict[str, int] = field(default_factory=dict)
    """Rows staged per table."""
    skipped: int = 0
    """Traces left out: the lake showed them when the write was staged."""

    @property
    def n_traces(self) -> int:
        return 0 if self.traces is None else self.traces.num_rows


def visible_ids(table: object, ids: Sequence[str]) -> set[str]:
    """The ones of ``ids`` that have a traces row in ``table`` (the traces table as loaded):
    the ``trace_id`` column of the files of their buckets whose bounds admit them, only the
    row groups whose statistics do."""
    if not ids:
        return set()
    found = scan_keys(table, "trace_id", ids, columns=["trace_id"])
    return set(found.column("trace_id").to_pylist())


def _in(column: pa.ChunkedArray | pa.Array, values: Sequence[Any] | pa.Array) -> pa.Array:
    return pc.is_in(column, value_set=pa.array(values, column.type) if not isinstance(values, pa.Array) else values)


def lake_rows(name: str, rows: pa.Table, batch: str) -> pa.Table:
    """``rows`` (stored schema of table ``name``) in the lake's schema, carrying write
    ``batch`` (and a segment's :data:`~tracedb.lake.catalog.SEGMENT_HOME` when ``rows``
    has it); a traces row's ``seq`` is left empty (the file store's numbering means
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
    table = nulls.encode(name, pa.table(columns)).cast(pa.schema([f for f in target if f.name in columns]))
    if batched(name, schema):
        table = table.append_column(pa.field(BATCH, pa.string()), pa.array([batch] * rows.num_rows, pa.string()))
    if SEGMENT_HOME in target.names:
        home = rows.column(SEGMENT_HOME) if SEGMENT_HOME in rows.column_names else pa.nulls(rows.num_rows, pa.string())
        table = table.append_column(pa.field(SEGMENT_HOME, pa.string()), home.cast(pa.string()))
    return table


def append(lake: object, rows: Mapping[str, pa.Table]) -> AppendReport:
    """Append the traces of ``rows`` (tables by name in the stored schemas, as a file
    store holds them: the traces and everything of theirs) that the lake does not show
    yet, as one write committed alone (:func:`stage`, then :func:`commit`). ``seq`` is
    not stored: readers take it from the traces commit (see
    :func:`tracedb.lake.scan.scan_traces`)."""
    staged = stage(lake, rows)
    report = commit(lake, [staged])
    return report


def stage(lake: object, rows: Mapping[str, pa.Table]) -> Staged:
    """The write of the traces of ``rows`` the lake does not show yet (and of the rejects
    of ``rows``), made into data files of every table but those of :data:`LAST` (their
    rows are kept for :func:`commit`). Nothing is visible until it is committed."""
    staged = Staged(uuid.uuid4().hex)
    rejects = rows.get("rejects")
    if rejects is not None and rejects.num_rows:
        staged.rejects = lake_rows("rejects", rejects, staged.batch)
    traces = rows.get("traces")
    if traces is None or traces.num_rows == 0:
        return staged
    ids = traces.column("trace_id").to_pylist()
    shown = visible_ids(lake.table("traces"), ids)  # type: ignore[attr-defined]  # once, not per id
    new = [t for t in dict.fromkeys(ids) if t not in shown]
    staged.skipped = len(ids) - len(new)
    if not new:
        return staged
    schemas = lake_tables()
    keep = traces.filter(_in(traces.column("trace_id"), new))
    episodes = [e for e in keep.column("episode_id").to_pylist() if e is not None]
    for name, schema in schemas.items():
        table = rows.get(name)
        if name in LAST or table is None or table.num_rows == 0:
            continue
        if per_trace(name, schema):
            table = table.filter(_in(table.column("trace_id"), new))
        elif name == "episodes":
            table = table.filter(_in(table.column("episode_id"), episodes))
        elif name == "segments":
            table = _homed(lake.table("segments"), table, rows.get("nodes"), new)  # type: ignore[attr-defined]
        elif name == "policy_labels":
            table = labels.new_rows(lake, table)
        if table.num_rows:
            staged.files[name] = data_files(lake.table(name), lake_rows(name, table, staged.batch))  # type: ignore[attr-defined]
            staged.rows[name] = table.num_rows
    sets = rows.get("credit_sets")
    if sets is not None and sets.num_rows:
        staged.credit_sets = lake_rows("credit_sets", sets, staged.batch)
    staged.traces = lake_rows("traces", keep, staged.batch)
    return staged


def _homed(segments_table: Any, segments: pa.Table, nodes: pa.Table | None, new: Sequence[str]) -> pa.Table:
    """The segment rows to store: each segment once per bucket (of ``segments_table``'s
    partition) holding a new trace whose nodes use it, its
    :data:`~tracedb.lake.catalog.SEGMENT_HOME` the first such trace id of that bucket."""
    if nodes is None or nodes.num_rows == 0:
        return segments.slice(0, 0)
    used = nodes.filter(_in(nodes.column("trace_id"), new)).select(["trace_id", "segment_id"])
    traces = used.column("trace_id").combine_chunks()
    bucket = lake_files.buckets(segments_table, SEGMENT_HOME, traces)
    if bucket is None:  # a segments table bucketed otherwise (an older layout): one copy, homed at a user
        bucket = pa.repeat(pa.scalar(0, pa.int32()), len(traces))
    pairs = pa.table({"b": bucket, "segment_id": used.column("segment_id"), "trace_id": traces})
    homes = pairs.group_by(["b", "segment_id"], use_threads=False).aggregate([("trace_id", "min")])
    at = pc.index_in(homes.column("segment_id"), value_set=segments.column("segment_id").combine_chunks())
    found = pc.is_valid(at)
    homes, at = homes.filter(found), at.filter(found)  # a segment the rows lack: the file store's check reports it
    out = segments.take(at)
    return out.append_column(SEGMENT_HOME, homes.column("trace_id_min"))


def commit(lake: object, staged: Sequence[Staged]) -> AppendReport:
    """Commit the ``staged`` writes together: every table's files in one commit per
    table, the credit sets the lake lacks, ``traces`` last (the trace ids checked again
    just before each attempt, see the module's docstring), then the rejects."""
    counter: Commits = lake.commits  # type: ignore[attr-defined]
    held = Commits(counter.attempts, counter.conflicts)
    report = AppendReport(skipped=sum(s.skipped for s in staged))
    try:
        _commit(lake, staged, report)
    finally:
        report.commits = (counter.attempts - counter.conflicts) - (held.attempts - held.conflicts)
        report.retries = counter.conflicts - held.conflicts
    return report


def _commit(lake: Any, staged: Sequence[Staged], report: AppendReport) -> None:
    for name in lake_tables():
        files = [f for s in staged for f in s.files.get(name, [])]
        if name in LAST or not files:
            continue
        _commit_files(lake, name, files)
        report.rows[name] = sum(s.rows.get(name, 0) for s in staged)
    traces = _concat([s.traces for s in staged])
    sets = _concat([s.credit_sets for s in staged])
    if sets is not None and traces is not None:
        present = set(lake.table("credit_sets").scan(selected_fields=("name",)).to_arrow().column("name").to_pylist())
        sets = sets.filter(pc.invert(_in(sets.column("name"), sorted(present))))
        if sets.num_rows:
            _commit_files(lake, "credit_sets", data_files(lake.table("credit_sets"), sets))
            report.rows["credit_sets"] = sets.num_rows
    if traces is not None:
        _commit_traces(lake, traces, report)
    rejects = _concat([s.rejects for s in staged])
    if rejects is not None:
        _commit_files(lake, "rejects", data_files(lake.table("rejects"), rejects))
        report.rows["rejects"] = rejects.num_rows


def _concat(parts: Sequence[pa.Table | None]) -> pa.Table | None:
    held = [p for p in parts if p is not None and p.num_rows]
    return pa.concat_tables(held) if held else None


def _commit_traces(lake: Any, traces: pa.Table, report: AppendReport) -> None:
    ids = traces.column("trace_id").to_pylist()
    firsts: dict[str, int] = {}
    for i, trace_id in enumerate(ids):
        firsts.setdefault(trace_id, i)
    if len(firsts) < len(ids):  # a trace id staged by two writes of this commit: the first keeps it
        traces = traces.take(pa.array(sorted(firsts.values()), pa.int64()))
        report.skipped += len(ids) - traces.num_rows
        ids = traces.column("trace_id").to_pylist()
    written: tuple[list[str], list[DataFile]] | None = None
    for attempt in range(1, COMMIT_ATTEMPTS + 1):
        table = lake.table("traces")
        taken = visible_ids(table, ids)
        rest = traces.filter(pc.invert(_in(traces.column("trace_id"), sorted(taken)))) if taken else traces
        report.attempts = attempt
        if rest.num_rows == 0:
            report.skipped += traces.num_rows
            return
        kept = rest.column("trace_id").to_pylist()
        if written is None or written[0] != kept:
            written = (kept, data_files(table, rest))
        try:
            append_files(table, written[1])
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


def _commit_files(lake: Any, name: str, files: Sequence[DataFile]) -> None:
    """Commit ``files`` to table ``name`` (not ``traces``), made again after a conflict
    that pyiceberg's own retries did not get past."""
    for attempt in range(1, TABLE_ATTEMPTS + 1):
        try:
            append_files(lake.table(name), files)
            return
        except CommitFailedException:
            if attempt == TABLE_ATTEMPTS:
                raise CommitFailedException(
                    f"{name}: {TABLE_ATTEMPTS} commits conflicted with other writers; nothing of this write is visible"
                ) from None
            _back_off(attempt)


def _back_off(attempt: int) -> None:
    """Wait before attempt ``attempt + 1``: exponential, capped at 2 s, jittered so that
    writers that conflicted do not meet again."""
    time.sleep(min(0.05 * 2**attempt, 2.0) * random.uniform(0.5, 1.0))


__all__ = ["AppendReport", "Staged", "append", "commit", "lake_rows", "stage", "visible_ids"]
