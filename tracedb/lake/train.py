"""Micro-batch plans of a lake: the file store's packing over the lake's visible traces.

The driver resolves the selection (:func:`tracedb.lake.select.resolved_rows`: the lake's
``seq`` for ``after`` / ``through``), reads the selected traces' node columns straight
from the lake's files (:func:`tracedb.lake.columns.visible_columns`) with their tokens'
policy versions (:func:`tracedb.lake.versions.attach`) and packs them with the file
store's own code (:func:`tracedb.batches.run.plan_of`), so the samples, the packing and
the report are the same. The plan's ``arguments`` are the caller's selection and
``report.watermark`` the lake's watermark the selection was read at (the ``after`` of
the next step).

The selection is a training output's (:meth:`tracedb.selection.Selection.for_training`:
dropped traces and eval episodes out unless asked in) and is resolved over the lake's
rows by the file store's resolver, which applies the staleness bound per group, the
unknown-version rule and ``max_groups`` there; the plan masks stale tokens under the same
bound (``stale="mask"``) and the report's counts of what the selection left out are the
lake's.
"""

from __future__ import annotations

from typing import Any

from tracedb.batches import Plan, provenance
from tracedb.batches.run import check, plan_of
from tracedb.lake import catalog, versions
from tracedb.lake.columns import resolve_credit, visible_columns
from tracedb.lake.select import resolved_rows
from tracedb.records import COMPACT_STREAMS
from tracedb.selection import Selection


def micro_batches(lake: catalog.Opened, seq_len: int, selection: Selection, **options: Any) -> Plan:
    """See :meth:`tracedb.lake.Lake.micro_batches`; ``options`` are
    :meth:`tracedb.Database.micro_batches`' packing arguments."""
    options["clip"] = check(
        seq_len,
        options["ranks"],
        options["pad_to_multiple_of"],
        options["overflow"],
        options["cost"],
        options["share_prefixes"],
        options["train_once"],
        options["importance"],
        options["clip"],
    )
    options["credit"] = resolve_credit(lake, options["credit"])
    chosen = selection.for_training()
    rows, selected = resolved_rows(lake, chosen)
    data = visible_columns(lake, rows, list(COMPACT_STREAMS), options["credit"], watermark=selected.watermark)
    versions.attach(lake, rows, data)
    plan = plan_of(data, seq_len, selection.manifest(), **options, chosen=chosen, selected=selected)
    plan.report.watermark = selected.watermark
    plan.record = provenance.record(data, selected.trace_ids, selected.watermark, selected.watermark, options["credit"])
    return plan


__all__ = ["micro_batches"]
