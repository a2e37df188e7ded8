"""The two shapes a credit algorithm's output takes (see :mod:`tracedb.credit`), and the
builders of the per-node one."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

TRACE_CREDIT = pa.schema([("trace_id", pa.string()), ("value", pa.float64())])
"""One value per trace, broadcast over its sampled tokens (outcome-level credit)."""
NODE_CREDIT = pa.schema([("trace_id", pa.string()), ("node_index", pa.int32()), ("values", pa.list_(pa.float32()))])
"""Compact values per node, one per sampled token (turn- and token-level credit)."""
NODE_VALUE = pa.schema([("trace_id", pa.string()), ("node_index", pa.int32()), ("value", pa.float64())])
"""One value per node over its sampled tokens: turn-level credit as ``run`` stamps it
(an algorithm registered with ``per_node``), without expanding it to lists and back."""


def node_table(trace_id: pa.Array, node_index: pa.Array, n_sampled: np.ndarray, values: np.ndarray) -> pa.Table:
    """:data:`NODE_CREDIT` from one row per node (``trace_id``, ``node_index``, its sampled
    token count ``n_sampled``) and ``values``: every node's per-token values laid end to end,
    in row order (``n_sampled.sum()`` of them)."""
    sizes = np.asarray(n_sampled, np.int64)
    offsets = np.zeros(len(sizes) + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("more than 2**31 sampled tokens in one credit table: run on fewer traces")
    if len(values) != offsets[-1]:
        raise ValueError(f"{len(values)} values for {offsets[-1]} sampled tokens")
    flat = pa.array(np.asarray(values, np.float64).astype(np.float32), pa.float32())
    lists = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), flat)
    return pa.Table.from_arrays([trace_id.cast(pa.string()), node_index.cast(pa.int32()), lists], schema=NODE_CREDIT)


def broadcast(trace_id: pa.Array, node_index: pa.Array, n_sampled: np.ndarray, value: np.ndarray) -> pa.Table:
    """:data:`NODE_CREDIT` with one ``value`` per node row repeated over its sampled tokens."""
    return node_table(trace_id, node_index, n_sampled, np.repeat(np.asarray(value, np.float64), n_sampled))
