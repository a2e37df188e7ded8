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

from tracedb import policy
from tracedb.handle import Handle
from tracedb.views.nodes import NodeColumns


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
        fallbacks = handle.con.execute(
            "SELECT t.trace_id, coalesce(e.policy_start, e.work_step) FROM traces t "
            "LEFT JOIN episodes e USING (episode_id) WHERE t.trace_id IN (SELECT trace_id FROM _tdb_version_traces) "
            "AND coalesce(e.policy_start, e.work_step) IS NOT NULL"
        ).fetchall()
        spans = handle.con.execute(
            "SELECT trace_id, node_index, weight_versions FROM nodes WHERE weight_versions IS NOT NULL "
            "AND len(weight_versions) > 0 AND trace_id IN (SELECT trace_id FROM _tdb_version_traces)"
        ).fetchall()
        mapping = policy.mapping_of(handle.con) if spans else {}
    return attach_rows(data, fallbacks, spans, mapping)


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
    data.versions_read = True
    if not fallbacks and not any(node_spans for _, _, node_spans in spans):
        return None
    n_rows = len(data.n_tok)
    per_row = np.full(n_rows, policy.UNKNOWN, np.int64)
    bases = np.fromiter(data.base.values(), np.int64, len(data.base))
    ends = np.append(bases[1:], n_rows) if len(bases) else bases
    order = {t: i for i, t in enumerate(data.base)}
    for trace_id, value in fallbacks:
        if value is not None and policy.UNKNOWN < value <= np.iinfo(np.int32).max:
            i = order[trace_id]
            per_row[bases[i] : ends[i]] = value
    compact = np.repeat(per_row.astype(np.int32), data.n_sampled.astype(np.int64))
    offsets = np.zeros(n_rows + 1, np.int64)
    np.cumsum(data.n_sampled, out=offsets[1:])
    for trace_id, node_index, node_spans in spans:
        if not node_spans or trace_id not in data.base:
            continue
        row = data.base[trace_id] + node_index
        lo, n = int(offsets[row]), int(data.n_sampled[row])
        compact[lo : lo + n] = policy.node_versions(node_spans, n, mapping, _default(per_row[row]))
    if not (compact != policy.UNKNOWN).any():
        return None
    versions = np.full(int(data.starts[-1]), policy.UNKNOWN, np.int32)
    versions[data.mask] = compact
    data.versions = versions
    return versions


def _default(value: int) -> int | None:
    return None if value == policy.UNKNOWN else int(value)
