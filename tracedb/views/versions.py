"""Per-token policy versions of loaded nodes (:mod:`tracedb.policy`'s rule), for the
``policy_version`` column of branch views and for a staleness bound's token mask.

:func:`attach` reads the selected traces' weight-version spans, their episodes' policy
start or step and the label mapping once, and keeps on the :class:`NodeColumns` one
node-flat int32 array: every node's tokens in row order, its sampled tokens holding
their version and every other token :data:`tracedb.policy.UNKNOWN`. The branch view
gathers it along each path with the compiled token kernel (as it gathers token ids).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracedb import policy
from tracedb.handle import Handle
from tracedb.views.nodes import NodeColumns, kernels


def attach(handle: Handle, data: NodeColumns) -> np.ndarray | None:
    """``data.versions`` (read once and kept with the nodes): None when no sampled token
    of the loaded traces has a known version."""
    if data.versions_read:
        return data.versions
    data.versions_read = True
    ids = list(data.base)
    if not ids or not int(data.n_sampled.sum()):
        return None
    table = pa.table({"trace_id": pa.array(ids, pa.string())})
    with handle.registered("_tdb_version_traces", table):
        fallbacks = handle.con.sql(
            "SELECT t.trace_id, coalesce(e.policy_start, e.work_step) AS value FROM traces t "
            "LEFT JOIN episodes e USING (episode_id) WHERE t.trace_id IN (SELECT trace_id FROM _tdb_version_traces) "
            "AND coalesce(e.policy_start, e.work_step) IS NOT NULL"
        ).to_arrow_table()
        spans = handle.con.sql(
            # node_store: the view would also bind every stream's decoding (~8 ms a query)
            "SELECT trace_id, node_index, weight_versions FROM node_store WHERE weight_versions IS NOT NULL "
            "AND len(weight_versions) > 0 AND trace_id IN (SELECT trace_id FROM _tdb_version_traces)"
        ).to_arrow_table()
        mapping = policy.mapping_of(handle.con) if spans.num_rows else {}
    flat = spans.column("weight_versions").combine_chunks()
    parents = pc.list_parent_indices(flat).to_numpy(zero_copy_only=False)
    each = pc.list_flatten(flat)
    return _spread(
        data,
        fallbacks.column("trace_id"),
        fallbacks.column("value"),
        pc.take(spans.column("trace_id"), parents),
        pc.take(spans.column("node_index"), parents),
        pc.struct_field(each, "version"),
        pc.struct_field(each, "start"),
        pc.struct_field(each, "end"),
        mapping,
    )


def attach_rows(
    data: NodeColumns,
    fallbacks: Sequence[tuple[str, int | None]],
    spans: Sequence[tuple[str, int, Sequence[Mapping[str, Any]] | None]],
    mapping: Mapping[str, int],
) -> np.ndarray | None:
    """:func:`attach` from rows read already (by a store of another kind, the lake):
    ``fallbacks`` each loaded trace's episode policy start or work step (trace id,
    value), ``spans`` the nodes' weight-version spans (trace id, node index, spans),
    ``mapping`` the label mapping. Sets ``data.versions`` (and marks them read)."""
    each = [(t, i, span) for t, i, node_spans in spans for span in node_spans or ()]
    return _spread(
        data,
        pa.array([t for t, _ in fallbacks], pa.string()),
        pa.array([v for _, v in fallbacks], pa.int64()),
        pa.array([t for t, _, _ in each], pa.string()),
        pa.array([i for _, i, _ in each], pa.int64()),
        pa.array([span["version"] for _, _, span in each], pa.string()),
        pa.array([span["start"] for _, _, span in each], pa.int64()),
        pa.array([span["end"] for _, _, span in each], pa.int64()),
        mapping,
    )


def _spread(
    data: NodeColumns,
    fallback_ids: pa.Array | pa.ChunkedArray,
    fallback_values: pa.Array | pa.ChunkedArray,
    span_ids: pa.Array | pa.ChunkedArray,
    span_nodes: pa.Array | pa.ChunkedArray,
    labels: pa.Array | pa.ChunkedArray,
    span_starts: pa.Array | pa.ChunkedArray,
    span_ends: pa.Array | pa.ChunkedArray,
    mapping: Mapping[str, int],
) -> np.ndarray | None:
    """The rule of :func:`tracedb.policy.node_versions` over every node at once: each
    loaded trace's sampled tokens take its fallback (trace ids and values), then each
    span (one entry per span, in each node's order: its trace id, node index, label,
    start, end) writes its label's number over tokens ``[start, end)`` of its node's
    sampled tokens (cut to them). Traces not loaded are skipped. Sets ``data.versions``."""
    data.versions_read = True
    if not len(fallback_ids) and not len(span_ids):
        return None
    n_rows = len(data.n_tok)
    loaded = pa.array(list(data.base), pa.string())
    bases = np.fromiter(data.base.values(), np.int64, len(data.base))
    per_trace = np.full(len(bases), policy.UNKNOWN, np.int64)
    if len(fallback_ids):
        at = pc.index_in(fallback_ids, value_set=loaded)
        values = pc.fill_null(fallback_values, policy.UNKNOWN).to_numpy(zero_copy_only=False).astype(np.int64)
        keep = at.is_valid().to_numpy(zero_copy_only=False) & (values > policy.UNKNOWN) & (values <= _INT32_MAX)
        per_trace[pc.fill_null(at, 0).to_numpy(zero_copy_only=False)[keep]] = values[keep]
    per_row = np.full(n_rows, policy.UNKNOWN, np.int32)
    if len(bases):  # each trace's node rows run from its base to the next trace's
        per_row[bases[0] :] = np.repeat(per_trace.astype(np.int32), np.diff(np.append(bases, n_rows)))
    n_sampled = data.n_sampled.astype(np.int64)
    compact = np.repeat(per_row, n_sampled)
    if len(span_ids):
        at = pc.index_in(span_ids, value_set=loaded)
        known = at.is_valid().to_numpy(zero_copy_only=False)
        rows = bases[pc.fill_null(at, 0).to_numpy(zero_copy_only=False)[known]]
        rows += np.asarray(span_nodes, np.int64)[known]
        width = n_sampled[rows]
        lo = np.clip(np.asarray(span_starts, np.int64)[known], 0, width)
        hi = np.clip(np.asarray(span_ends, np.int64)[known], lo, width)
        names = pc.unique(labels)
        numbers = np.array([_number(label, mapping) for label in names.to_pylist()] or [policy.UNKNOWN], np.int32)
        number = numbers[pc.index_in(labels, value_set=names).to_numpy(zero_copy_only=False)[known]]
        offsets = np.zeros(n_rows + 1, np.int64)
        np.cumsum(n_sampled, out=offsets[1:])
        count = hi - lo
        first = offsets[rows] + lo  # each span's first token in the node-flat sampled tokens
        kernels().fill_runs(compact, first, count, number)
    if not (compact != policy.UNKNOWN).any():
        return None
    versions = np.full(int(data.starts[-1]), policy.UNKNOWN, np.int32)
    versions[data.mask] = compact
    data.versions = versions
    return versions


_INT32_MAX = np.iinfo(np.int32).max


def _number(label: str, mapping: Mapping[str, int]) -> int:
    number = policy.number_of(label, mapping)
    return policy.UNKNOWN if number is None else number
