"""Micro-batch plans of a lake: the file store's packing over the lake's visible traces.

The driver resolves the selection (:func:`tracedb.lake.select.resolve_rows`: the lake's
``seq`` for ``after`` / ``through``), reads the selected traces' node columns straight
from the lake's files (:func:`tracedb.lake.columns.visible_columns`) and packs them with
the file store's own code (:func:`tracedb.batches.run.plan_of`), so the samples, the
packing and the report are the same. The plan's ``arguments`` are the caller's selection
and ``report.watermark`` the lake's watermark the selection was read at (the ``after`` of
the next step).
"""

from __future__ import annotations

from typing import Any

from tracedb.batches import Plan, provenance
from tracedb.batches.run import check, plan_of
from tracedb.lake import catalog
from tracedb.lake.columns import resolve_credit, visible_columns
from tracedb.lake.select import resolve_rows
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
    rows, mark = resolve_rows(lake, selection)
    data = visible_columns(lake, rows, list(COMPACT_STREAMS), options["credit"], watermark=mark)
    plan = plan_of(data, seq_len, selection.manifest(), **options)
    plan.report.watermark = mark
    # what the step's manifest records of its inputs, as the file store's (the lake's watermarks)
    plan.record = provenance.record(data, rows.column("trace_id").to_pylist(), mark, mark, options["credit"])
    return plan


__all__ = ["micro_batches"]
