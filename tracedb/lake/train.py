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
from tracedb.lake.select import resolve_lake
from tracedb.views import Selection


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
    selection = Selection(trace_ids, group, episode, after, complete_groups, tags, through)
    ids, mark = resolve_lake(lake, selection)
    with connect(":memory:") as db:
        move.write_into(db, read.visible(lake, trace_ids=ids))
        plan = db.micro_batches(seq_len, **options)
    plan.arguments.update(
        trace_ids=None if trace_ids is None else list(trace_ids),
        group=group,
        episode=episode,
        after=after,
        complete_groups=complete_groups,
        through=through,
        tags=None if tags is None else {name: list(v) if isinstance(v, tuple) else v for name, v in tags.items()},
    )
    plan.report.watermark = mark
    return plan


__all__ = ["micro_batches"]
