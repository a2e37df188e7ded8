"""The node columns of visible traces, read straight from the lake's files.

What a view task (:mod:`tracedb.lake.views`) and ``lake.micro_batches``
(:mod:`tracedb.lake.train`) compute on, without pulling the traces into a tracedb first:
given the visible ``traces`` rows (trace id and :data:`~tracedb.lake.catalog.BATCH`) of a
selection, the ``nodes`` and ``branches`` rows written with them (read by key: the files
of the traces' buckets whose bounds admit them, the row groups that may hold them), the
segments their nodes use (from the same buckets: a write stores them beside its traces)
and, for a named credit set, its values, decoded into
:class:`tracedb.views.nodes.NodeColumns` by the file store's own decoding
(:func:`tracedb.views.nodes.node_columns`). The file store's kernels then make the views
and the plans: they are the file store's, column for column.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from tracedb import credit_sets
from tracedb.errors import NotFound
from tracedb.lake import files as lake_files
from tracedb.lake.catalog import BATCH
from tracedb.lake.read import trace_segments
from tracedb.lake.scan import scan_keys
from tracedb.views.nodes import NodeColumns, node_columns

NODE_COLUMNS = (
    "trace_id",
    "node_index",
    "n_tokens",
    "n_sampled",
    "mask_prefix",
    "mask_slots",
    "loss_weights",
    "segment_id",
)
"""What the views read of ``nodes`` besides the per-token streams."""
BRANCH_COLUMNS = ("trace_id", "branch_index", "trainable", "path")


def resolve_credit(lake: Any, credit: str | None) -> str | None:
    """The credit set ``credit`` names, as :func:`tracedb.credit_sets.resolve` gives it
    (None: the ingested set), checked to be a set the lake shows (:class:`NotFound`
    naming the sets it has, the file store's message)."""
    name = credit_sets.stored_name(credit)
    if name is None:
        return None
    table = lake.table("credit_sets")
    held = lake_files.read(table, lake_files.live_files(table), ["name", "created_at"])
    names = [r["name"] for r in held.sort_by([("created_at", "ascending"), ("name", "ascending")]).to_pylist()]
    if name not in names:
        known = [credit_sets.DEFAULT_SET, *dict.fromkeys(names)]
        raise NotFound(f"credit set {credit!r} does not exist; known sets: {known}")
    return name


def written_with(rows: pa.Table, traces: pa.Table) -> pa.Table:
    """The rows of ``rows`` (with ``trace_id`` and :data:`BATCH`) written with the visible
    traces rows ``traces`` (the same trace id and batch), in their order."""
    at = pc.index_in(rows.column("trace_id"), value_set=traces.column("trace_id").combine_chunks())
    batch = pc.take(traces.column(BATCH).combine_chunks(), at)
    return rows.filter(pc.fill_null(pc.equal(rows.column(BATCH), batch), False))


def visible_columns(
    lake: Any,
    traces: pa.Table,
    streams: Sequence[str],
    credit: str | None = None,
    *,
    watermark: int = 0,
) -> NodeColumns:
    """The :class:`~tracedb.views.nodes.NodeColumns` of the visible traces rows ``traces``
    (``trace_id``, :data:`BATCH`), with the per-token ``streams`` asked for; ``credit``
    (a set :func:`resolve_credit` gave, None: the ingested) gives the advantages."""
    ids = traces.column("trace_id").combine_chunks()
    own = [s for s in streams if not (s == "advantages" and credit is not None)]
    nodes = scan_keys(lake.table("nodes"), "trace_id", ids, columns=[*NODE_COLUMNS, *own, BATCH])
    nodes = written_with(nodes, traces)
    branches = written_with(scan_keys(lake.table("branches"), "trace_id", ids, [*BRANCH_COLUMNS, BATCH]), traces)
    segments = trace_segments(
        lake.table("segments"),
        nodes.column("trace_id"),
        nodes.column("segment_id"),
        ["segment_id", "token_ids"],
        batches=nodes.column(BATCH),
    )
    credit_rows = None
    if credit is not None and "advantages" in streams:
        credit_rows = _credit_rows(lake, traces, ids, credit)
    return node_columns(nodes, segments, branches, streams, credit_rows, watermark=watermark)


def _credit_rows(lake: Any, traces: pa.Table, ids: pa.Array, credit: str) -> pa.Table:
    """The values of credit set ``credit`` for the visible ``traces``, as
    :func:`tracedb.views.nodes.node_columns` takes them (a per-trace value's ``node_index`` null)."""
    per_node = scan_keys(
        lake.table("credit"), "trace_id", ids, ["trace_id", "credit_set", "node_index", "value", "advantages", BATCH]
    )
    per_trace = scan_keys(lake.table("trace_credit"), "trace_id", ids, ["trace_id", "credit_set", "value", BATCH])
    per_node = written_with(per_node.filter(pc.equal(per_node.column("credit_set"), credit)), traces)
    per_trace = written_with(per_trace.filter(pc.equal(per_trace.column("credit_set"), credit)), traces)
    listed = pa.list_(pa.float32())
    return pa.concat_tables(
        [
            pa.table(
                {
                    "trace_id": per_node.column("trace_id"),
                    "node_index": per_node.column("node_index").cast(pa.int32()),
                    "value": per_node.column("value").cast(pa.float32()),
                    "advantages": per_node.column("advantages").cast(listed),
                }
            ),
            pa.table(
                {
                    "trace_id": per_trace.column("trace_id"),
                    "node_index": pa.nulls(per_trace.num_rows, pa.int32()),
                    "value": per_trace.column("value").cast(pa.float32()),
                    "advantages": pa.nulls(per_trace.num_rows, listed),
                }
            ),
        ]
    )


__all__ = ["BRANCH_COLUMNS", "NODE_COLUMNS", "resolve_credit", "visible_columns", "written_with"]
