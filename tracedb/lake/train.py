"""What a trainer takes from a lake: micro-batch plans of a selection.

The plan is the file store's own: the driver selects the visible traces (the lake's
``seq`` for ``after`` / ``through``), pulls them into an in-memory tracedb
(:func:`tracedb.lake.move.write_into`) and calls :meth:`tracedb.Database.micro_batches`
there, so the samples, the packing and the report are computed by the same code. The
plan's ``arguments`` are the caller's selection and ``report.watermark`` the lake's
watermark the selection was read at (the ``after`` of the next step).

The selection is a training output's (:meth:`tracedb.selection.Selection.for_training`:
dropped traces and eval episodes out unless asked in) and is resolved over the lake's
rows by the file store's resolver, which applies the staleness bound per group, the
unknown-version rule and ``max_groups`` there; the in-memory tracedb then packs what it
took, under the same staleness bound (so ``stale="mask"`` masks the same tokens), and
the report's counts of what the selection left out are the lake's.
"""

from __future__ import annotations

from typing import Any

from tracedb.batches import Plan
from tracedb.database import connect
from tracedb.lake import catalog, move, read
from tracedb.lake.select import resolved
from tracedb.selection import Selection


def micro_batches(lake: catalog.Opened, seq_len: int, selection: Selection, **options: Any) -> Plan:
    """See :meth:`tracedb.lake.Lake.micro_batches`; ``options`` are
    :meth:`tracedb.Database.micro_batches`' packing arguments."""
    chosen = selection.for_training()
    ids, selected = resolved(lake, chosen)
    bound = {}
    if chosen.bound is not None:  # what was taken is packed under the same bound; nothing more is left out
        bound = dict(policy=chosen.policy, max_staleness=chosen.max_staleness, stale=chosen.stale, unknown="keep")
    with connect(":memory:") as db:
        move.write_into(db, read.visible(lake, trace_ids=ids))
        plan = db.micro_batches(seq_len, include_dropped=True, include_eval=True, **bound, **options)
    plan.arguments.update(selection.manifest())
    report = plan.report
    report.watermark = selected.watermark
    report.dropped = selected.report.get("dropped", 0)
    report.eval = selected.report.get("eval", 0)
    report.groups_over = selected.report.get("groups_over", 0)
    if chosen.bound is not None:
        report.stale_groups = selected.report.get("stale_groups", 0)
        report.stale_traces = selected.report.get("stale_traces", 0)
        report.unknown_dropped = selected.report.get("unknown", 0)
    return plan


__all__ = ["micro_batches"]
