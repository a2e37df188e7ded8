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

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.expressions import AlwaysTrue, BooleanExpression, In

from tracedb.lake import catalog, read
from tracedb.lake import files as lake_files
from tracedb.lake.scan import scan_traces, visible_traces
from tracedb.selection import Selected, Selection, completions_at, resolve_at, values_of

TRACE_COLUMNS = [
    *("trace_id", "group_id", "episode_id", "n_tokens", catalog.BATCH),
    *("dropped", "work_type", "policy_min", "policy_max", "policy_unknown"),
]
"""What a selection reads of ``traces`` (with ``seq``): what the file store's resolver
reads of its ``traces`` (the ids, the dropped reason, the work type, the policy bounds)."""
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
    ordered, selected = resolved_rows(lake, selection)
    return ordered.column("trace_id").to_pylist(), selected.watermark


def resolve_rows(lake: catalog.Opened, selection: Selection) -> tuple[pa.Table, int]:
    """:func:`resolve_lake`'s traces as their visible rows (``trace_id`` and
    :data:`~tracedb.lake.catalog.BATCH`, in that order), and the watermark."""
    rows, selected = resolved_rows(lake, selection)
    return rows, selected.watermark


def resolved(lake: catalog.Opened, selection: Selection) -> tuple[list[str], Selected]:
    """:func:`resolve_lake`'s ordered trace ids and the file store's
    :class:`~tracedb.selection.Selected` (its watermark, and what the training rules
    left out and why: dropped and eval traces, stale groups, unknown versions, groups
    past ``max_groups``; each trace's ``policy_min``), from the same resolver."""
    rows, selected = resolved_rows(lake, selection)
    return rows.column("trace_id").to_pylist(), selected


def resolved_rows(lake: catalog.Opened, selection: Selection) -> tuple[pa.Table, Selected]:
    """:func:`resolved` with the traces as their visible rows (:func:`resolve_rows`'s)."""
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
        selected = _whole_writes(con, selection, resolve_at(con, selection, mark), mark)
        con.register("chosen", pa.table({"trace_id": pa.array([t for t, _ in selected.traces], pa.string())}))
        ordered = con.sql(
            f"SELECT trace_id, {catalog.BATCH} FROM traces SEMI JOIN chosen USING (trace_id) "
            "ORDER BY group_id, trace_id"
        ).to_arrow_table()
    finally:
        con.close()
    return ordered, selected


def _whole_writes(con: duckdb.DuckDBPyConnection, selection: Selection, selected: Selected, mark: int) -> Selected:
    """``selected`` with ``max_groups`` never cutting between groups that completed in one
    write: the lake's traces of one write share their ``seq``, so a watermark cannot fall
    between such groups, and a cut there would lose the groups past it (the next call's
    ``after`` is past their completion). Takes fewer groups then (those completed in the
    earlier writes); ValueError when the first write alone completes more than
    ``max_groups``. A group completes as the file store's resolver says: at its
    ``complete_groups``-th member, else at its newest member taken."""
    size = selection.max_groups
    if size is None or not selected.report.get("groups_over"):
        return selected
    every = resolve_at(con, dataclasses.replace(selection, max_groups=None), mark)
    con.register("every_taken", pa.table({"trace_id": pa.array(every.trace_ids, pa.string())}))
    rows = con.execute(
        "SELECT coalesce(group_id, trace_id), group_id IS NULL, max(seq) FROM traces "
        "SEMI JOIN every_taken USING (trace_id) GROUP BY ALL"
    ).fetchall()
    con.unregister("every_taken")
    done = {(unit, alone): seq for unit, alone, seq in rows}
    if selection.complete_groups is not None:
        found = completions_at(con, [u for u, alone in done if not alone], selection.complete_groups, mark)
        done.update({(g, False): seq for g, seq in found.items()})
    cut = selected.watermark
    earlier = sum(1 for seq in done.values() if seq < cut)
    if sum(1 for seq in done.values() if seq <= cut) <= size:
        return selected  # every group completed at the cut is taken
    if earlier == 0:
        raise ValueError(
            f"max_groups={size} would cut between the {sum(1 for q in done.values() if q == cut)} groups that "
            f"completed in one lake write (seq {cut}): a lake numbers a write's traces together, so no "
            "watermark falls between them; take at least that many groups, or write fewer groups per write "
            "(push --batch-traces, smaller ingest files)"
        )
    return resolve_at(con, dataclasses.replace(selection, max_groups=earlier), mark)


def select_ids(lake: catalog.Opened, selection: Selection) -> list[str]:
    """The visible traces ``selection`` takes (``seq`` the lake's), ordered by group then
    trace id; see :func:`resolve_lake`."""
    return resolve_lake(lake, selection)[0]


_PUSHED = ("trace_ids", "group", "after")
"""The fields :func:`tracedb.lake.read.visible` applies itself (in its scans)."""


def visible_tables(lake: catalog.Opened, selection: Selection) -> dict[str, pa.Table]:
    """The visible rows of the traces ``selection`` takes, in every table, by name (see
    :func:`tracedb.lake.read.visible`). A selection of trace ids, groups and ``after``
    alone is pushed into the scans; any other is resolved first (:func:`resolve_lake`)."""
    simple = all(getattr(selection, name) is None for name in Selection.FIELDS if name not in _PUSHED)
    if simple:
        return read.visible(lake, trace_ids=selection.trace_ids, group=selection.group, after=selection.after)
    return read.visible(lake, trace_ids=resolve_lake(lake, selection)[0])


__all__ = ["TRACE_COLUMNS", "resolve_lake", "resolve_rows", "resolved", "resolved_rows", "select_ids", "visible_tables"]
