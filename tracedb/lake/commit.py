"""Data files written by tracedb, and the commits that add or replace them.

:func:`data_files` writes Arrow rows of a table as Parquet data files, one per bucket of
its partition key, each sorted by its key (so that bounds and row-group statistics prune
reads of a few keys). The rows are sorted by (bucket, key) once and cut into slices:
pyiceberg's own partitioned append filters the whole table once per bucket instead
(about a third of a write's time with 16 buckets). The files are written by pyiceberg's
``write_file`` (its Parquet settings, statistics and field ids), several at once.

:func:`append_files` commits files as one fast append (pyiceberg's own retries, per the
table's ``commit.retry.num-retries``, reuse them); :func:`replace_files` replaces files by
others in one overwrite whose manifests are merged into one per partition spec (a
compaction's commit: each append adds a manifest, and planning a scan reads all of them).
Files a compaction writes are named ``compacted-...`` (:func:`compacted`): what
incremental compaction leaves alone.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.io.pyarrow import pyarrow_to_schema, write_file
from pyiceberg.manifest import DataFile, ManifestContent
from pyiceberg.partitioning import PartitionFieldValue, PartitionKey
from pyiceberg.table import WriteTask
from pyiceberg.table.snapshots import Operation
from pyiceberg.table.update.snapshot import _ManifestMergeManager, _OverwriteFiles

from tracedb.lake.catalog import SEGMENT_HOME

COMPACTED = "compacted-"
"""How the names of the files a compaction writes start."""
SORT_KEYS = {
    "nodes": ("trace_id", "node_index"),
    "branches": ("trace_id", "branch_index"),
    "segments": (SEGMENT_HOME, "segment_id"),
    "credit": ("trace_id", "node_index"),
}
"""How a table's files are sorted (default: by the partition key): a trace's nodes and
branches in their order, so that a read of them needs no sort."""


@dataclass(frozen=True)
class _Task(WriteTask):
    """A pyiceberg write task naming its file after tracedb's ``prefix``."""

    prefix: str = "data-"

    def generate_data_file_filename(self, extension: str) -> str:
        return f"{self.prefix}{self.task_id:05d}-{self.write_uuid}.{extension}"


def compacted(path: str) -> bool:
    """Whether the data file at ``path`` was written by a compaction."""
    return path.rsplit("/", 1)[-1].startswith(COMPACTED)


def data_files(table: Any, rows: pa.Table, *, compaction: bool = False) -> list[DataFile]:
    """``rows`` (in ``table``'s lake schema) written as data files of ``table``: one per
    partition (bucket) of its rows, each sorted by the table's sort key; none for no rows.
    ``compaction``: the files are named as a compaction's (:func:`compacted`)."""
    if rows.num_rows == 0:
        return []
    metadata = table.metadata
    spec = table.spec()
    schema = table.schema()
    name = table.name()[-1]
    task_schema = pyarrow_to_schema(
        rows.schema, name_mapping=schema.name_mapping, format_version=metadata.format_version
    )
    write_uuid = uuid.uuid4()
    prefix = COMPACTED if compaction else "data-"
    fields = list(spec.fields)
    sort = [c for c in SORT_KEYS.get(name, ()) if c in rows.column_names]
    if not fields:
        ordered = rows.sort_by([(c, "ascending") for c in sort]) if sort else rows
        tasks = [_Task(write_uuid, 0, task_schema, ordered.to_batches(), prefix=prefix)]
        return list(write_file(table.io, metadata, iter(tasks)))
    if len(fields) != 1:
        raise ValueError(f"lake table {name}: partitioned by {len(fields)} fields, tracedb writes one")
    part = fields[0]
    source = schema.find_field(part.source_id)
    keys = rows.column(source.name)
    bucket = part.transform.pyarrow_transform(source.field_type)(keys)
    sort = sort or [source.name]
    order = pc.sort_indices(
        pa.table({"_b": bucket, **{c: rows.column(c) for c in sort}}),
        [("_b", "ascending"), *((c, "ascending") for c in sort)],
    )
    ordered = rows.take(order)
    values = pc.take(bucket, order).combine_chunks() if isinstance(bucket, pa.ChunkedArray) else bucket.take(order)
    tasks = [
        _Task(
            write_uuid,
            i,
            task_schema,
            ordered.slice(start, stop - start).to_batches(),
            partition_key=PartitionKey(
                field_values=[PartitionFieldValue(field=part, value=value)], partition_spec=spec, schema=schema
            ),
            prefix=prefix,
        )
        for i, (start, stop, value) in enumerate(_runs(values))
    ]
    return list(write_file(table.io, metadata, iter(tasks)))


def _runs(values: pa.Array) -> Iterable[tuple[int, int, Any]]:
    """(start, stop, value) of each run of equal values of a sorted array (nulls one run)."""
    if not len(values):
        return []
    runs = pc.run_end_encode(values)
    ends = runs.run_ends.to_pylist()
    out = []
    start = 0
    for end, value in zip(ends, runs.values.to_pylist(), strict=True):
        out.append((start, end, value))
        start = end
    return out


def append_files(table: Any, files: Sequence[DataFile], properties: dict[str, str] | None = None) -> None:
    """Commit ``files`` (written for ``table``) as one fast append, with ``properties`` in
    the snapshot's summary (pyiceberg's retries, as the table's properties say, reuse them)."""
    with table.transaction() as tx:
        with tx.update_snapshot(snapshot_properties=properties or {}).fast_append() as append:
            for f in files:
                append.append_data_file(f)


class _MergedOverwrite(_OverwriteFiles):
    """An overwrite snapshot replacing some files by others (a compaction's commit), its
    data manifests merged (per partition spec) into one: each append adds a manifest, and
    planning a scan reads them all.

    Iceberg's rewrite semantics: a commit that lands meanwhile conflicts only when it
    removed one of the replaced files (pyiceberg then finds it missing from the new
    parent: ``ValidationException``); appends of other files do not (an overwrite's own
    validation would refuse any file added meanwhile to the same partitions, which
    writers always do)."""

    def _validate_concurrency(self) -> None:
        return None  # the replaced files are checked to be live in the parent (_deleted_entries)

    def _process_manifests(self, manifests: list[Any]) -> list[Any]:
        merger = _ManifestMergeManager(
            target_size_bytes=1 << 62, min_count_to_merge=2, merge_enabled=True, snapshot_producer=self
        )
        data = [m for m in manifests if m.content == ManifestContent.DATA]
        return merger.merge_manifests(data) + [m for m in manifests if m.content != ManifestContent.DATA]


def replace_files(
    table: Any, removed: Sequence[DataFile], added: Sequence[DataFile], properties: dict[str, str] | None = None
) -> None:
    """Replace ``removed`` (live files of ``table``) by ``added`` in one overwrite commit
    (``properties`` in its summary), every data manifest merged into one per spec; the
    manifests the commit wrote and merged away are deleted (they were never referenced)."""
    with table.transaction() as tx:
        producer = _MergedOverwrite(
            operation=Operation.OVERWRITE,
            transaction=tx,
            io=table.io,
            snapshot_properties=properties or {},
        )
        with producer:
            for f in removed:
                producer.delete_data_file(f)
            for f in added:
                producer.append_data_file(f)
    referenced = {m.manifest_path for m in table.current_snapshot().manifests(table.io)}
    for path in producer._written_manifests:  # noqa: SLF001 - the merge's inputs, written by this commit
        if path not in referenced:
            table.io.delete(path)


__all__ = ["COMPACTED", "SORT_KEYS", "append_files", "compacted", "data_files", "replace_files"]
