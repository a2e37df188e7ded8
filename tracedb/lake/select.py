"""Which visible traces a selection of the lake takes (ids, group, episode, ``seq``)."""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow.compute as pc
from pyiceberg.expressions import AlwaysTrue, In

from tracedb.lake import catalog
from tracedb.lake.scan import scan_traces


def select_ids(
    lake: catalog.Opened,
    *,
    trace_ids: Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    after: int | None = None,
    through: int | None = None,
) -> list[str]:
    """The visible traces a selection takes, ordered by group then trace id (so that
    chunks of it keep groups whole)."""
    row_filter = AlwaysTrue()
    if trace_ids is not None:
        row_filter = In("trace_id", list(trace_ids)) if trace_ids else None
    if row_filter is None:
        return []
    for column, values in (("group_id", group), ("episode_id", episode)):
        if values is not None:
            row_filter = row_filter & In(column, [values] if isinstance(values, str) else list(values))
    traces = scan_traces(lake.table("traces"), row_filter, ["trace_id", "group_id", catalog.BATCH])
    keep = pc.is_valid(traces.column("seq"))
    if after is not None:
        keep = pc.and_(keep, pc.greater(traces.column("seq"), after))
    if through is not None:
        keep = pc.and_(keep, pc.less_equal(traces.column("seq"), through))
    chosen = traces.filter(keep).group_by(["trace_id", "group_id"]).aggregate([])
    ordered = chosen.sort_by([("group_id", "ascending"), ("trace_id", "ascending")])
    return ordered.column("trace_id").to_pylist()


__all__ = ["select_ids"]
