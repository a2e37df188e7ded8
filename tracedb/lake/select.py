"""Which visible traces a selection of the lake takes: the file store's own selection SQL
(:func:`tracedb.selection.resolve_at`) run over the lake's scanned ``traces`` and ``trace_tags``.

The scans read what the selection can need: ``traces`` by trace id, group and episode
(pushed down as row filters, so other buckets are not read), except that a
``complete_groups`` selection reads every member of the groups it may take (a group's
completeness counts all its members, selected or not); ``trace_tags`` by the filtered
tag names (and the trace ids, when given), only the rows of the write that committed
each trace's row. The scanned rows go into a DuckDB connection of their own as tables
``traces`` (``seq`` the lake's) and ``trace_tags``, and the file store's resolver selects
from them, so ``after`` / ``through`` / ``complete_groups`` / ``tags`` mean exactly what
they mean in the file store, with its errors for bad values.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.expressions import AlwaysTrue, BooleanExpression, In

from tracedb.lake import catalog, read
from tracedb.lake import files as lake_files
from tracedb.lake.scan import scan_traces, visible_traces
from tracedb.selection import Selection, resolve_at, values_of

TRACE_COLUMNS = ["trace_id", "group_id", "episode_id", "n_tokens", catalog.BATCH]
"""What a selection reads of ``traces`` (with ``seq``)."""
TAG_COLUMNS = ["trace_id", "name", "value", "number", "text", catalog.BATCH]


def _filter(
    trace_ids: Sequence[str] | None, group: str | Sequence[str] | None, episode: str | Sequence[str] | None
) -> BooleanExpression:
    """The row filter of ``traces`` rows of these trace ids, groups and episodes."""
    row_filter: BooleanExpression = AlwaysTrue()
    for column, values in (("trace_id", trace_ids), ("group_id", group), ("episode_id", episode)):
        if values is not None:
            row_filter = row_filter & In(column, values_of(values))
    return row_filter


def _traces(table: Any, selection: Selection) -> pa.Table:
    """The visible ``traces`` rows ``selection`` may need (see the module's docstring);
    trace ids are read by key (their buckets' files), not through a row filter."""
    ids = None if selection.trace_ids is None else values_of(selection.trace_ids)
    narrow = _filter(None, selection.group, selection.episode)
    if selection.complete_groups is None:
        return visible_traces(table, narrow, TRACE_COLUMNS, trace_ids=ids)
    if selection.trace_ids is None and selection.episode is None:
        return visible_traces(table, narrow, TRACE_COLUMNS)
    chosen = scan_traces(table, narrow, ["group_id"], trace_ids=ids).column("group_id")  # the groups it may take
    groups = pc.unique(chosen.filter(pc.is_valid(chosen))).to_pylist()
    return visible_traces(table, In("group_id", groups), TRACE_COLUMNS)  # all their members


def _tags(lake: catalog.Opened, selection: Selection) -> pa.Table:
    """The ``trace_tags`` rows of the filtered names (of the selected trace ids, if any)."""
    row_filter: BooleanExpression = AlwaysTrue()
    tags = selection.tags
    if isinstance(tags, Mapping) and all(isinstance(name, str) for name in tags):
        row_filter = In("name", list(tags))
    if selection.trace_ids is not None:
        row_filter = row_filter & In("trace_id", values_of(selection.trace_ids))
    return lake.table("trace_tags").scan(row_filter=row_filter, selected_fields=tuple(TAG_COLUMNS)).to_arrow()


def resolve_lake(lake: catalog.Opened, selection: Selection) -> tuple[list[str], int]:
    """The visible traces ``selection`` takes, ordered by group then trace id (so that
    chunks of it keep groups whole), and the watermark they were selected at (the
    lake's, or ``through`` when lower: the ``after`` of the next call). ValueError
    (the file store's) for a bad ``after``, ``through``, ``complete_groups`` or tag filter."""
    rows, mark = resolve_rows(lake, selection)
    return rows.column("trace_id").to_pylist(), mark


def resolve_rows(lake: catalog.Opened, selection: Selection) -> tuple[pa.Table, int]:
    """:func:`resolve_lake`'s traces as their visible rows (``trace_id`` and
    :data:`~tracedb.lake.catalog.BATCH`, in that order), and the watermark."""
    table = lake.table("traces")
    snapshot = table.current_snapshot()
    mark = 0 if snapshot is None else snapshot.sequence_number
    con = lake_files.duck()
    try:
        con.register("lake_traces", _traces(table, selection).select([*TRACE_COLUMNS, "seq"]))
        con.execute(
            "CREATE TEMP TABLE traces AS SELECT * FROM lake_traces WHERE seq <= ?",
            [mark],
        )
        if selection.tags is not None:
            con.register("lake_tags", _tags(lake, selection))
            con.execute(
                "CREATE TEMP TABLE trace_tags AS SELECT t.trace_id, t.name, t.value::JSON AS value, t.number, t.text "
                f"FROM lake_tags t SEMI JOIN traces v USING (trace_id, {catalog.BATCH})"
            )
        selected = resolve_at(con, selection, mark)
        con.register("chosen", pa.table({"trace_id": pa.array([t for t, _ in selected.traces], pa.string())}))
        ordered = con.sql(
            f"SELECT trace_id, {catalog.BATCH} FROM traces SEMI JOIN chosen USING (trace_id) "
            "ORDER BY group_id, trace_id"
        ).to_arrow_table()
    finally:
        con.close()
    return ordered, selected.watermark


def select_ids(lake: catalog.Opened, selection: Selection) -> list[str]:
    """The visible traces ``selection`` takes (``seq`` the lake's), ordered by group then
    trace id; see :func:`resolve_lake`."""
    return resolve_lake(lake, selection)[0]


def visible_tables(lake: catalog.Opened, selection: Selection) -> dict[str, pa.Table]:
    """The visible rows of the traces ``selection`` takes, in every table, by name (see
    :func:`tracedb.lake.read.visible`). A selection of trace ids, groups and ``after``
    alone is pushed into the scans; any other is resolved first (:func:`resolve_lake`)."""
    simple = selection.episode is None and selection.complete_groups is None and selection.tags is None
    if simple and selection.through is None:
        return read.visible(lake, trace_ids=selection.trace_ids, group=selection.group, after=selection.after)
    return read.visible(lake, trace_ids=resolve_lake(lake, selection)[0])


__all__ = ["resolve_lake", "resolve_rows", "select_ids", "visible_tables"]
