"""What a trainer takes from a lake: micro-batch plans of a selection.

The plan is the file store's own: the driver selects the visible traces (the lake's
``seq`` for ``after`` / ``through``), pulls them into an in-memory tracedb
(:func:`tracedb.lake.move.write_into`) and calls :meth:`tracedb.Database.micro_batches`
there, so the samples, the packing and the report are computed by the same code. The
plan's ``arguments`` are the caller's selection and ``report.watermark`` the lake's
watermark the selection was read at (the ``after`` of the next step).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tracedb.batches import Plan
from tracedb.database import connect
from tracedb.lake import catalog, move, read
from tracedb.lake.select import select_ids


def unsupported(where: str, complete_groups: int | None, tags: Mapping[str, Any] | None) -> None:
    """Refuse the selections the lake does not have yet, naming the call."""
    if complete_groups is not None or tags is not None:
        raise ValueError(f"{where}: complete_groups= and tags= are not supported on a lake yet (select by ids/group)")


def micro_batches(
    lake: catalog.Opened,
    seq_len: int,
    *,
    trace_ids: Sequence[str] | None = None,
    group: str | Sequence[str] | None = None,
    episode: str | Sequence[str] | None = None,
    after: int | None = None,
    complete_groups: int | None = None,
    tags: Mapping[str, Any] | None = None,
    through: int | None = None,
    **options: Any,
) -> Plan:
    """See :meth:`tracedb.lake.Lake.micro_batches`; ``options`` are
    :meth:`tracedb.Database.micro_batches`' packing arguments."""
    unsupported("lake.micro_batches", complete_groups, tags)
    snapshot = lake.table("traces").current_snapshot()
    mark = 0 if snapshot is None else snapshot.sequence_number
    upto = mark if through is None else min(through, mark)
    ids = select_ids(lake, trace_ids=trace_ids, group=group, episode=episode, after=after, through=upto)
    with connect(":memory:") as db:
        move.write_into(db, read.visible(lake, trace_ids=ids))
        plan = db.micro_batches(seq_len, **options)
    plan.arguments.update(
        trace_ids=None if trace_ids is None else list(trace_ids),
        group=group,
        episode=episode,
        after=after,
        through=through,
    )
    plan.report.watermark = upto
    return plan


__all__ = ["micro_batches", "unsupported"]
