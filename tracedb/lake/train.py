"""What a trainer takes from a lake: micro-batch plans of a selection.

The plan is the file store's own: the driver selects the visible traces (the lake's
``seq`` for ``after`` / ``through``), pulls them into an in-memory tracedb
(:func:`tracedb.lake.move.write_into`) and calls :meth:`tracedb.Database.micro_batches`
there, so the samples, the packing and the report are computed by the same code. The
plan's ``arguments`` are the caller's selection and ``report.watermark`` the lake's
watermark the selection was read at (the ``after`` of the next step).
"""

from __future__ import annotations

from typing import Any

from tracedb.batches import Plan
from tracedb.database import connect
from tracedb.lake import catalog, move, read
from tracedb.lake.select import resolve_lake
from tracedb.selection import Selection


def micro_batches(lake: catalog.Opened, seq_len: int, selection: Selection, **options: Any) -> Plan:
    """See :meth:`tracedb.lake.Lake.micro_batches`; ``options`` are
    :meth:`tracedb.Database.micro_batches`' packing arguments."""
    ids, mark = resolve_lake(lake, selection)
    with connect(":memory:") as db:
        move.write_into(db, read.visible(lake, trace_ids=ids))
        plan = db.micro_batches(seq_len, **options)
    plan.arguments.update(selection.manifest())
    plan.report.watermark = mark
    return plan


__all__ = ["micro_batches"]
