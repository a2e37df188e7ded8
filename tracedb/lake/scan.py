"""Reading rows of a lake as Arrow: the traces rows with their ``seq``, the visible ones, rows by key.

:func:`scan_traces` gives the ``traces`` rows with their ``seq`` (stored in the row by a
compaction, else the data sequence number of the file that committed it), and
:func:`visible_traces` the visible ones of them (one per trace id: every reader's rule).
:func:`scan_keys` gives the rows of a set of keys (trace ids, segment ids, ...) reading
only the files of the keys' hash buckets whose bounds admit one, and in them the row
groups that may hold one (:mod:`tracedb.lake.files`).
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.expressions import AlwaysTrue, BooleanExpression

from tracedb.lake import files as lake_files
from tracedb.lake.catalog import BATCH
from tracedb.lake.files import bucket_of, filtered_columns, key_files, live_files

_FILE = "_tdb_file"


def scan_traces(
    table: Any,
    row_filter: BooleanExpression = AlwaysTrue(),
    columns: Sequence[str] | None = None,
    *,
    stored_from: Collection[int] | None = None,
    trace_ids: Sequence[str] | None = None,
    buckets: Collection[int] | None = None,
) -> pa.Table:
    """The traces rows (with :data:`BATCH`) that ``row_filter`` keeps (and, given
    ``trace_ids``, of those ids: read by key as :func:`scan_keys` reads; given ``buckets``,
    of the files of those buckets of ``trace_id`` only), with their ``seq``:
    the value stored in the row when there is one (a compaction of ``traces`` writes each
    row's seq into it), else the data sequence number of the file holding the row (the
    commit of a write, whose rows carry no seq); ``columns`` (with ``seq``) reads only
    those. ``stored_from`` (snapshot ids) takes the stored value only in files those
    snapshots added, the file's number in every other (what upgrading a version-1 lake,
    whose writers stored the file store's seq, reads: see :mod:`tracedb.lake.upgrade`)."""
    names = None if columns is None else list(dict.fromkeys([*columns, "seq"]))
    found = live_files(table)
    if buckets is not None:
        found = in_buckets(table, found, buckets)
    key = None
    if trace_ids is not None:
        wanted = pa.array(list(dict.fromkeys(trace_ids)), pa.string())
        found = key_files(table, "trace_id", wanted, found)
        key = ("trace_id", wanted)
    else:
        found = lake_files.pruned(table, row_filter, found)
    raw = lake_files.read(table, found, names, key=key, row_filter=row_filter, file_index=_FILE)
    index = raw.column(_FILE)
    numbers = pa.array([f.sequence_number for f in found], pa.int64())
    file_seq = pc.take(numbers, index)
    stored = raw.column("seq").cast(pa.int64())
    if stored_from is None:
        seq = pc.coalesce(stored, file_seq)
    else:
        takes = pa.array([f.snapshot_id in stored_from for f in found], pa.bool_())
        seq = pc.if_else(pc.take(takes, index), pc.coalesce(stored, file_seq), file_seq)
    at = raw.schema.get_field_index("seq")
    return raw.set_column(at, pa.field("seq", pa.int64()), seq).drop_columns([_FILE])


def visible_traces(
    table: Any,
    row_filter: BooleanExpression = AlwaysTrue(),
    columns: Sequence[str] | None = None,
    *,
    stored_from: Collection[int] | None = None,
    trace_ids: Sequence[str] | None = None,
    buckets: Collection[int] | None = None,
) -> pa.Table:
    """The visible ``traces`` rows among those ``row_filter`` (and ``trace_ids``, and
    ``buckets`` of ``trace_id``: every row of a trace id is in its bucket) keeps:
    one per trace id, the first by ``seq`` then :data:`BATCH` of all its rows (a trace id
    two racing writers committed shows its first commit, whether or not ``row_filter``
    keeps that row), ordered by ``seq`` then trace id; ``columns`` reads only those (with
    ``trace_id``, :data:`BATCH` and ``seq``). ``seq`` and ``stored_from`` are
    :func:`scan_traces`'."""
    picked = None if columns is None else [*columns, "trace_id", BATCH]
    raw = scan_traces(table, row_filter, picked, stored_from=stored_from, trace_ids=trace_ids, buckets=buckets)
    first = f"QUALIFY row_number() OVER (PARTITION BY trace_id ORDER BY seq, {BATCH}) = 1"
    con = lake_files.duck()
    try:
        con.register("raw_traces", raw)
        if filtered_columns(row_filter) - {"trace_id"} and raw.num_rows:
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


def in_buckets(table: Any, files: Sequence[lake_files.LiveFile], buckets: Collection[int]) -> list[lake_files.LiveFile]:
    """The ``files`` of ``table`` in the given buckets of ``trace_id`` (every file when the
    table is not bucketed on it, or of a partition spec that is not)."""
    where = bucket_of(table, "trace_id")
    if where is None:
        return list(files)
    spec = table.spec().spec_id
    return [f for f in files if f.spec_id != spec or f.partition[where[0]] in buckets]


def bucket_order(table: Any, column: str, keys: Sequence[Any]) -> list[Any]:
    """``keys`` ordered by their bucket of ``column`` in ``table``, then by key, so that
    consecutive chunks of it read few buckets' files and, in those (sorted by the key),
    few row groups; ``keys`` unchanged when the table is not bucketed on ``column``."""
    if not keys:
        return []
    values = pa.array(list(keys))
    buckets = lake_files.buckets(table, column, values)
    if buckets is None:
        return list(keys)
    order = pc.sort_indices(pa.table({"b": buckets, "k": values}), [("b", "ascending"), ("k", "ascending")])
    return values.take(order).to_pylist()


def scan_keys(
    table: Any, column: str, keys: Sequence[Any], columns: Sequence[str] | None = None, files: list[str] | None = None
) -> pa.Table:
    """The rows of ``table`` whose ``column`` is one of ``keys``, reading only the data
    files of the keys' buckets (all files when the table is not bucketed on ``column``)
    whose key bounds (manifest metrics) admit one of the keys, and in those only the row
    groups whose statistics admit one; ``columns`` (with ``column``) reads only those;
    ``files`` (a list) gets the paths of the data files read. Rows keep the files' order."""
    names = None if columns is None else list(dict.fromkeys([*columns, column]))
    wanted = pa.array(list(dict.fromkeys(keys)))
    if not len(wanted):
        return lake_files.read(table, [], names)
    chosen = key_files(table, column, wanted)
    if files is not None:  # the data files read, for a caller's report
        files.extend(f.path for f in chosen)
    return lake_files.read(table, chosen, names, key=(column, wanted))


__all__ = ["bucket_of", "bucket_order", "in_buckets", "scan_keys", "scan_traces", "visible_traces"]
