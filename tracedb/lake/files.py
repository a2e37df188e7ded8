"""A lake table's data files, and reading them as Arrow: what every read of the lake goes through.

:func:`live_files` lists the data files of a table's current snapshot with what a read
prunes by (partition, rows, data sequence number, key bounds). Manifests never change once
written, so each is read once per process (:data:`MANIFEST_CACHE` of them kept); a
snapshot's own manifest list is pyiceberg's (cached by pyiceberg likewise).
:func:`key_files` keeps the files that may hold one of some keys: those of the keys'
hash buckets (computed as Iceberg computes them, by pyiceberg's bucket transform over the
whole key array, in Rust) whose bounds admit one of the keys. :func:`read` reads files:
only the columns asked for (a column a file lacks, written before the column was added to
the table, reads null), with keys only the row groups whose statistics admit one of them
(the writer sorts each file by its key), the rows filtered to the keys.

Why not pyiceberg's scan: it binds and projects an ``In`` filter literal by literal in
Python, once per manifest entry (seconds for the thousands of segment ids of a few
traces), re-reads every manifest on every scan and reads whole files. Reads here open
each file through the table's own FileIO (local, object storage: whatever the catalog
says) and read it with pyarrow's Parquet reader, several files at once, the footers of
the files read lately kept (:data:`FOOTER_CACHE`). Columns are matched by name, which
for tracedb's tables is the field id's match: the lake never renames or drops a column,
it only adds them. The lake writes no delete files (its rewrites replace whole files),
so a table holding some is refused.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pyiceberg.conversions import from_bytes
from pyiceberg.expressions import (
    AlwaysFalse,
    AlwaysTrue,
    And,
    BooleanExpression,
    EqualTo,
    In,
    Not,
    Or,
    Reference,
    UnboundPredicate,
)
from pyiceberg.expressions.visitors import bind
from pyiceberg.io.pyarrow import expression_to_pyarrow
from pyiceberg.manifest import DataFile, ManifestContent
from pyiceberg.transforms import BucketTransform

from tracedb import tables
from tracedb.lake.catalog import META, LakeError, lake_schema, lake_tables

MANIFEST_CACHE = 4096
"""Manifests whose entries a process keeps (a manifest lists one commit's files)."""
FOOTER_CACHE = 8192
"""Parquet footers a process keeps (of the files it read lately)."""
READ_THREADS = 8
"""Files read at once (pyarrow reads without the GIL)."""


@dataclass(frozen=True, eq=False)
class LiveFile:
    """A data file of a table's current snapshot."""

    data_file: DataFile
    sequence_number: int
    """The data sequence number of the snapshot that added it (a trace's ``seq`` when the
    row stores none)."""
    snapshot_id: int
    """The snapshot that added it."""
    path: str
    partition: tuple[Any, ...]
    spec_id: int

    @classmethod
    def of(cls, data_file: DataFile, sequence_number: int, snapshot_id: int) -> LiveFile:
        return cls(
            data_file, sequence_number, snapshot_id, data_file.file_path, tuple(data_file.partition), data_file.spec_id
        )

    @property
    def records(self) -> int:
        return self.data_file.record_count


class _Lru:
    """A small thread-safe LRU map."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.items: OrderedDict[Any, Any] = OrderedDict()
        self.lock = threading.Lock()

    def get(self, key: Any) -> Any:
        with self.lock:
            value = self.items.get(key)
            if value is not None:
                self.items.move_to_end(key)
            return value

    def put(self, key: Any, value: Any) -> None:
        with self.lock:
            self.items[key] = value
            self.items.move_to_end(key)
            while len(self.items) > self.size:
                self.items.popitem(last=False)


_manifests = _Lru(MANIFEST_CACHE)
_snapshots = _Lru(MANIFEST_CACHE)
_footers = _Lru(FOOTER_CACHE)
_ios = _Lru(64)
_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


_duck: list[duckdb.DuckDBPyConnection] = []
_duck_lock = threading.Lock()


def duck() -> duckdb.DuckDBPyConnection:
    """A DuckDB connection of its own (close it after) on the process's in-memory database
    for the lake's Arrow work: a cursor costs microseconds, a new database ~20 ms; what a
    caller registers, and its temporary tables, are its connection's alone."""
    with _duck_lock:
        if not _duck:
            _duck.append(duckdb.connect())
        return _duck[0].cursor()


def _threads() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="tracedb-lake-read")
        return _pool


def live_files(table: Any) -> list[LiveFile]:
    """The data files of ``table``'s current snapshot (none before its first commit), in
    manifest order. :class:`LakeError` when it holds delete files (the lake writes none)."""
    snapshot = table.current_snapshot()
    if snapshot is None:
        return []
    listed = _snapshots.get(snapshot.manifest_list)  # a snapshot's files never change either
    if listed is not None:
        return list(listed)
    out: list[LiveFile] = []
    for manifest in snapshot.manifests(table.io):
        if manifest.content != ManifestContent.DATA:
            raise LakeError(f"lake table {table.name()[-1]}: holds delete files, which tracedb does not read")
        key = (manifest.manifest_path, manifest.sequence_number)
        entries = _manifests.get(key)
        if entries is None:
            entries = tuple(
                LiveFile.of(e.data_file, e.sequence_number, e.snapshot_id)
                for e in manifest.fetch_manifest_entry(table.io, discard_deleted=True)
            )
            _manifests.put(key, entries)
        out.extend(entries)
    _snapshots.put(snapshot.manifest_list, tuple(out))
    return out


def bucket_of(table: Any, column: str) -> tuple[int, BucketTransform] | None:
    """Where ``column``'s bucket sits in ``table``'s partition (its position in the
    partition record, the transform); None when the table is not bucketed on it."""
    field_id = table.schema().find_field(column).field_id
    for position, part in enumerate(table.spec().fields):
        if part.source_id == field_id and isinstance(part.transform, BucketTransform):
            return position, part.transform
    return None


def buckets(table: Any, column: str, keys: pa.Array) -> pa.Array | None:
    """The bucket of each of ``keys`` of ``column`` in ``table`` (None: not bucketed on it)."""
    where = bucket_of(table, column)
    if where is None:
        return None
    source = table.schema().find_field(column).field_type
    return where[1].pyarrow_transform(source)(keys)


def key_files(table: Any, column: str, keys: pa.Array, files: Sequence[LiveFile] | None = None) -> list[LiveFile]:
    """The files of ``files`` (default: every live file) that may hold one of ``keys`` of
    ``column``: those of the keys' buckets, where the file's partition spec buckets it
    on ``column``, whose bounds of ``column`` admit one of them."""
    chosen = live_files(table) if files is None else list(files)
    if not len(keys):
        return []
    field = table.schema().find_field(column)
    wanted: dict[int, tuple[int, set[Any]] | None] = {}
    for spec_id, spec in table.specs().items():
        wanted[spec_id] = None
        for position, part in enumerate(spec.fields):
            if part.source_id == field.field_id and isinstance(part.transform, BucketTransform):
                hashed = part.transform.pyarrow_transform(field.field_type)(keys)
                wanted[spec_id] = (position, set(pc.unique(hashed).to_pylist()))
    kept = []
    for f in chosen:
        where = wanted.get(f.spec_id)
        if where is None or f.partition[where[0]] in where[1]:
            kept.append(f)
    ordered = sorted(pc.unique(keys).drop_null().to_pylist())
    return [f for f in kept if _may_hold(f.data_file, field.field_id, field.field_type, ordered)]


def pinned(expression: BooleanExpression, column: str) -> set[Any] | None:
    """The values of ``column`` a pyiceberg row filter holds it to (an ``=`` or ``IN`` on
    it, through ``AND`` / ``OR``); None when it does not hold it to a finite set."""
    if isinstance(expression, AlwaysFalse):
        return set()
    if isinstance(expression, EqualTo | In) and isinstance(expression.term, Reference):
        if expression.term.name != column:
            return None
        if isinstance(expression, EqualTo):
            return {expression.literal.value}
        return {literal.value for literal in expression.literals}
    if isinstance(expression, And):
        left, right = pinned(expression.left, column), pinned(expression.right, column)
        if left is None or right is None:
            return left if right is None else right
        return left & right
    if isinstance(expression, Or):
        left, right = pinned(expression.left, column), pinned(expression.right, column)
        return None if left is None or right is None else left | right
    return None


def pruned(table: Any, row_filter: BooleanExpression, files: Sequence[LiveFile] | None = None) -> list[LiveFile]:
    """The files of ``files`` (default: every live file) that may hold a row ``row_filter``
    keeps: by key (:func:`key_files`) when it holds the table's bucket column or
    ``trace_id`` to a few values, else by pyiceberg's planning (partitions and column
    bounds), every file for no filter."""
    chosen = live_files(table) if files is None else list(files)
    if isinstance(row_filter, AlwaysTrue):
        return chosen
    columns = [table.schema().find_column_name(f.source_id) for f in table.spec().fields]
    for column in dict.fromkeys([*columns, "trace_id"]):
        if column is None or column not in table.schema().column_names:
            continue
        values = pinned(row_filter, column)
        if values is not None:
            return key_files(table, column, pa.array(sorted(values)), chosen) if values else []
    planned = {task.file.file_path for task in table.scan(row_filter=row_filter).plan_files()}
    return [f for f in chosen if f.path in planned]


def _may_hold(data_file: DataFile, field_id: int, field_type: Any, ordered: list[Any]) -> bool:
    """Whether a data file's bounds of the key column (its manifest metrics: the smallest
    and largest key, truncated outward) admit one of the ``ordered`` keys."""
    low, high = data_file.lower_bounds.get(field_id), data_file.upper_bounds.get(field_id)
    if low is None or high is None:
        return True
    low, high = from_bytes(field_type, low), from_bytes(field_type, high)
    at = bisect_left(ordered, low)
    return at < len(ordered) and ordered[at] <= high


def arrow_schema(table: Any) -> pa.Schema:
    """The Arrow schema tracedb reads ``table`` in: the lake schema of its name."""
    name = table.name()[-1]
    stored = tables.META if name == META else lake_tables().get(name)
    if stored is None:
        return table.schema().as_arrow()
    return lake_schema(name, stored)


def read(
    table: Any,
    files: Sequence[LiveFile],
    columns: Sequence[str] | None = None,
    *,
    key: tuple[str, pa.Array] | None = None,
    row_filter: BooleanExpression = AlwaysTrue(),
    file_index: str | None = None,
) -> pa.Table:
    """The rows of ``files`` (of ``table``), in file order, in the lake schema
    (:func:`arrow_schema`) of ``columns`` (default: all). ``key`` (a column and keys):
    only rows holding one of the keys, reading the row groups whose statistics admit one;
    ``row_filter`` (a pyiceberg expression): only rows it keeps; ``file_index``: a column
    of that name added, each row's file as its position in ``files`` (int32)."""
    schema = arrow_schema(table)
    names = list(schema.names) if columns is None else list(dict.fromkeys(columns))
    unknown = [c for c in names if c not in schema.names]
    if unknown:
        raise LakeError(f"lake table {table.name()[-1]}: no column(s) {unknown}")
    wanted = pa.schema([schema.field(c) for c in names])
    condition = None
    if not isinstance(row_filter, AlwaysTrue):
        condition = expression_to_pyarrow(bind(table.schema(), row_filter, case_sensitive=True))
    needed = list(dict.fromkeys([*names, *([key[0]] if key else []), *_filter_columns(row_filter)]))
    ordered = None
    if key is not None:
        ordered = (key[0], sorted(pc.unique(key[1]).drop_null().to_pylist()), key[1])
    if file_index is not None:
        wanted = wanted.append(pa.field(file_index, pa.int32()))
    if not files:
        return wanted.empty_table()
    reader = _reader(table, schema, needed, ordered)
    parts = list(_threads().map(reader, files)) if len(files) > 1 else [reader(files[0])]
    if file_index is not None:
        parts = [
            p.append_column(file_index, pa.repeat(pa.scalar(i, pa.int32()), p.num_rows)) for i, p in enumerate(parts)
        ]
        names = [*names, file_index]
    out = pa.concat_tables(parts) if len(parts) > 1 else parts[0]
    if condition is not None:
        out = out.filter(condition)
    return out.select(names)


def filtered_columns(expression: BooleanExpression) -> set[str]:
    """The columns a pyiceberg row filter tests; ``"?"`` for a term this does not read."""
    if isinstance(expression, AlwaysTrue | AlwaysFalse):
        return set()
    if isinstance(expression, UnboundPredicate) and isinstance(expression.term, Reference):
        return {expression.term.name}
    if isinstance(expression, And | Or):
        return filtered_columns(expression.left) | filtered_columns(expression.right)
    if isinstance(expression, Not):
        return filtered_columns(expression.child)
    return {"?"}


def _filter_columns(row_filter: BooleanExpression) -> list[str]:
    return sorted(c for c in filtered_columns(row_filter) if c != "?")


def _io(table: Any) -> Any:
    """The table's FileIO, one per FileIO type and properties in a process (a new one per
    table load would make its file systems again: a millisecond each)."""
    io = table.io
    key = (type(io), tuple(sorted(io.properties.items())))
    held = _ios.get(key)
    if held is None:
        _ios.put(key, io)
        return io
    return held


def _reader(table: Any, schema: pa.Schema, needed: list[str], ordered: tuple[str, list[Any], pa.Array] | None) -> Any:
    target = pa.schema([schema.field(c) for c in needed])
    io = _io(table)

    def read_one(file: LiveFile) -> pa.Table:
        footer = _footers.get(file.path)
        with io.new_input(file.path).open(seekable=True) as handle:
            parquet = pq.ParquetFile(handle, metadata=footer)
            if footer is None:
                _footers.put(file.path, parquet.metadata)
            present = set(parquet.schema_arrow.names)
            groups = _row_groups(parquet.metadata, ordered) if ordered is not None else None
            picked = [c for c in needed if c in present]
            if groups is None:
                part = parquet.read(columns=picked, use_threads=False)
            else:
                part = parquet.read_row_groups(groups, columns=picked, use_threads=False)
        return _finish(part, target, ordered)

    return read_one


def _row_groups(metadata: Any, ordered: tuple[str, list[Any], pa.Array]) -> list[int]:
    """The row groups whose statistics of the key column admit one of the keys."""
    column, keys, _ = ordered
    at = next((i for i in range(metadata.num_columns) if metadata.schema.column(i).path == column), None)
    if at is None:
        return list(range(metadata.num_row_groups))
    out = []
    for g in range(metadata.num_row_groups):
        stats = metadata.row_group(g).column(at).statistics
        if stats is None or not stats.has_min_max:
            out.append(g)
            continue
        i = bisect_left(keys, stats.min)
        if i < len(keys) and keys[i] <= stats.max:
            out.append(g)
    return out


def _finish(part: pa.Table, target: pa.Schema, ordered: tuple[str, list[Any], pa.Array] | None) -> pa.Table:
    """``part`` (columns read of one file) filtered to the keys, in ``target``'s columns
    and types (a column the file lacks: nulls)."""
    if ordered is not None and part.num_rows:
        column, _, keys = ordered
        part = part.filter(pc.is_in(part.column(column), value_set=keys.cast(part.schema.field(column).type)))
    columns = [
        part.column(f.name).cast(f.type) if f.name in part.column_names else pa.nulls(part.num_rows, f.type)
        for f in target
    ]
    return pa.Table.from_arrays(columns, schema=target)


__all__ = [
    "LiveFile",
    "arrow_schema",
    "bucket_of",
    "buckets",
    "duck",
    "filtered_columns",
    "key_files",
    "live_files",
    "pinned",
    "pruned",
    "read",
]
