"""Reading Iceberg files of a lake as Arrow: what every reader of a lake starts from.

:func:`scan_traces` gives the ``traces`` rows with their ``seq`` (stored in the row by a
compaction, else the data sequence number of the file that committed it), and
:func:`visible_traces` the visible ones of them (one per trace id: every reader's rule).
:func:`scan_keys` gives the rows of a set of keys (trace ids, segment ids, ...) reading
only the files of the keys' hash buckets: the buckets are computed as Iceberg computes
them (pyiceberg's bucket transform, in Rust, over the whole key array) and the rows
filtered in Arrow. A pyiceberg ``In`` row filter does the same pruning, but binds and
projects every literal in Python, once per manifest entry: seconds for the thousands of segment ids a few traces use.
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Collection, Sequence
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.conversions import from_bytes
from pyiceberg.expressions import (
    AlwaysFalse,
    AlwaysTrue,
    And,
    BooleanExpression,
    Not,
    Or,
    Reference,
    UnboundPredicate,
)
from pyiceberg.io.pyarrow import ArrowScan, schema_to_pyarrow
from pyiceberg.transforms import BucketTransform

from tracedb.lake.catalog import BATCH


def scan_traces(
    table: Any,
    row_filter: BooleanExpression = AlwaysTrue(),
    columns: Sequence[str] | None = None,
    *,
    stored_from: Collection[int] | None = None,
    trace_ids: Sequence[str] | None = None,
) -> pa.Table:
    """The traces rows (with :data:`BATCH`) that ``row_filter`` keeps (and, given
    ``trace_ids``, of those ids: read by key as :func:`scan_keys` reads), with their ``seq``:
    the value stored in the row when there is one (a compaction of ``traces`` writes each
    row's seq into it), else the data sequence number of the file holding the row (the
    commit of a write, whose rows carry no seq); ``columns`` (with ``seq``) reads only
    those. ``stored_from`` (snapshot ids) takes the stored value only in files those
    snapshots added, the file's number in every other (what upgrading a version-1 lake,
    whose writers stored the file store's seq, reads: see :mod:`tracedb.lake.upgrade`)."""
    fields = ("*",) if columns is None else tuple(dict.fromkeys([*columns, "seq"]))
    snapshot = table.current_snapshot()
    if snapshot is None:
        return table.scan(selected_fields=fields).to_arrow()
    files = {
        entry.data_file.file_path: (entry.sequence_number, entry.snapshot_id)
        for manifest in snapshot.manifests(table.io)
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True)
    }
    projected = table.schema() if columns is None else table.schema().select(*fields)
    scan = ArrowScan(table.metadata, table.io, projected, row_filter)
    tasks = list(table.scan(row_filter=row_filter).plan_files())
    wanted = None if trace_ids is None else pa.array(list(dict.fromkeys(trace_ids)), pa.string())
    if wanted is not None:
        tasks = key_tasks(table, "trace_id", wanted, tasks) if len(wanted) else []
    parts = []
    for task in tasks:
        part = scan.to_table([task])
        if wanted is not None:
            part = part.filter(
                pc.is_in(part.column("trace_id"), value_set=wanted.cast(part.schema.field("trace_id").type))
            )
        at = part.schema.get_field_index("seq")
        number, added_by = files[task.file.file_path]
        file_seq = pa.scalar(number, pa.int64())
        if stored_from is None or added_by in stored_from:
            seq = pc.coalesce(part.column(at).cast(pa.int64()), file_seq)
        else:
            seq = pa.repeat(file_seq, part.num_rows)
        parts.append(part.set_column(at, "seq", seq))
    if not parts:
        return table.scan(row_filter=row_filter, selected_fields=fields, limit=0).to_arrow()
    return pa.concat_tables(parts, promote_options="permissive")  # files may differ in string vs large_string


def visible_traces(
    table: Any,
    row_filter: BooleanExpression = AlwaysTrue(),
    columns: Sequence[str] | None = None,
    *,
    stored_from: Collection[int] | None = None,
    trace_ids: Sequence[str] | None = None,
) -> pa.Table:
    """The visible ``traces`` rows among those ``row_filter`` (and ``trace_ids``) keeps:
    one per trace id, the first by ``seq`` then :data:`BATCH` of all its rows (a trace id
    two racing writers committed shows its first commit, whether or not ``row_filter``
    keeps that row), ordered by ``seq`` then trace id; ``columns`` reads only those (with
    ``trace_id``, :data:`BATCH` and ``seq``). ``seq`` and ``stored_from`` are
    :func:`scan_traces`'."""
    picked = None if columns is None else [*columns, "trace_id", BATCH]
    raw = scan_traces(table, row_filter, picked, stored_from=stored_from, trace_ids=trace_ids)
    first = f"QUALIFY row_number() OVER (PARTITION BY trace_id ORDER BY seq, {BATCH}) = 1"
    con = duckdb.connect()
    try:
        con.register("raw_traces", raw)
        if _filtered_columns(row_filter) - {"trace_id"} and raw.num_rows:
            # Which row of a trace id shows is decided over all its rows, not only those the
            # filter keeps (the filter may keep a losing writer's row alone).
            found = pc.unique(raw.column("trace_id")).to_pylist()
            every = scan_traces(table, columns=["trace_id", BATCH], stored_from=stored_from, trace_ids=found)
            con.register("every_traces", every)
            con.register(
                "raw_traces",
                con.sql(
                    f"SELECT r.* FROM raw_traces r SEMI JOIN (SELECT trace_id, {BATCH} FROM every_traces {first}) w "
                    f"ON r.trace_id = w.trace_id AND r.{BATCH} = w.{BATCH}"
                ).to_arrow_table(),
            )
        return con.sql(f"SELECT * FROM raw_traces {first} ORDER BY seq, trace_id").to_arrow_table()
    finally:
        con.close()


def _filtered_columns(expression: BooleanExpression) -> set[str]:
    """The columns a pyiceberg row filter tests (a filter of trace ids alone keeps every
    row of the ids it keeps); ``"?"`` for a term this does not read."""
    if isinstance(expression, AlwaysTrue | AlwaysFalse):
        return set()
    if isinstance(expression, UnboundPredicate) and isinstance(expression.term, Reference):
        return {expression.term.name}
    if isinstance(expression, And | Or):
        return _filtered_columns(expression.left) | _filtered_columns(expression.right)
    if isinstance(expression, Not):
        return _filtered_columns(expression.child)
    return {"?"}


def bucket_of(table: Any, column: str) -> tuple[int, BucketTransform] | None:
    """Where ``column``'s bucket sits in ``table``'s partition (its position in the
    partition record, the transform); None when the table is not bucketed on it."""
    field_id = table.schema().find_field(column).field_id
    for position, part in enumerate(table.spec().fields):
        if part.source_id == field_id and isinstance(part.transform, BucketTransform):
            return position, part.transform
    return None


def bucket_order(table: Any, column: str, keys: Sequence[Any]) -> list[Any]:
    """``keys`` ordered by their bucket of ``column`` in ``table`` (stable: keys of one
    bucket keep their order), so that consecutive chunks of it read few buckets' files;
    ``keys`` unchanged when the table is not bucketed on ``column``."""
    where = bucket_of(table, column)
    if where is None or not keys:
        return list(keys)
    source = table.schema().find_field(column).field_type
    values = pa.array(list(keys))
    buckets = where[1].pyarrow_transform(source)(values)
    order = pc.sort_indices(
        pa.table({"b": buckets, "i": pa.array(range(len(values)))}), [("b", "ascending"), ("i", "ascending")]
    )
    return values.take(order).to_pylist()


def key_tasks(table: Any, column: str, wanted: pa.Array, tasks: list[Any]) -> list[Any]:
    """The scan tasks (data files) of ``tasks`` that may hold one of the keys ``wanted``
    of ``column``: those of the keys' buckets (when the table is bucketed on it) whose
    manifest bounds of ``column`` admit one of them."""
    field = table.schema().find_field(column)
    where = bucket_of(table, column)
    if where is not None:
        position, transform = where
        buckets = set(pc.unique(transform.pyarrow_transform(field.field_type)(wanted)).to_pylist())
        spec = table.spec().spec_id  # files of another (older) spec are not pruned by bucket
        tasks = [t for t in tasks if t.file.spec_id != spec or t.file.partition[position] in buckets]
    ordered = sorted(wanted.to_pylist())
    return [t for t in tasks if _may_hold(t.file, field.field_id, field.field_type, ordered)]


def _may_hold(data_file: Any, field_id: int, field_type: Any, ordered: list[Any]) -> bool:
    """Whether a data file's bounds of the key column (its manifest metrics: the
    smallest and largest key, truncated outward) admit one of the ``ordered`` keys."""
    low, high = data_file.lower_bounds.get(field_id), data_file.upper_bounds.get(field_id)
    if low is None or high is None:
        return True
    low, high = from_bytes(field_type, low), from_bytes(field_type, high)
    at = bisect_left(ordered, low)
    return at < len(ordered) and ordered[at] <= high


def scan_keys(
    table: Any, column: str, keys: Sequence[Any], columns: Sequence[str] | None = None, files: list[str] | None = None
) -> pa.Table:
    """The rows of ``table`` whose ``column`` is one of ``keys``, reading only the data
    files of the keys' buckets (all files when the table is not bucketed on ``column``);
    ``columns`` (with ``column``) reads only those. Files whose key bounds (manifest
    metrics) admit none of the keys are skipped too; ``files`` (a list) gets the paths of
    the data files read. Rows keep the files' order."""
    schema = table.schema()
    projected = schema if columns is None else schema.select(*dict.fromkeys([*columns, column]))
    wanted = pa.array(list(dict.fromkeys(keys)))
    if not len(wanted) or table.current_snapshot() is None:
        return schema_to_pyarrow(projected).empty_table()
    tasks = key_tasks(table, column, wanted, list(table.scan().plan_files()))
    if files is not None:  # the data files read, for a caller's report
        files.extend(t.file.file_path for t in tasks)
    scan = ArrowScan(table.metadata, table.io, projected, AlwaysTrue())
    parts = [
        pa.Table.from_batches(
            [batch.filter(pc.is_in(batch.column(column), value_set=wanted.cast(batch.schema.field(column).type)))]
        )
        for batch in scan.to_record_batches(tasks)
    ]
    if not parts:
        return schema_to_pyarrow(projected).empty_table()
    return pa.concat_tables(parts, promote_options="permissive")


__all__ = ["bucket_of", "bucket_order", "key_tasks", "scan_keys", "scan_traces", "visible_traces"]
