"""Mean-preserving token reweighting of an existing credit set.

Each sampled token of an assigned node gets a weight ``w`` from a per-token stream,
clipped to ``[min_weight, max_weight]`` and normalized per trace to mean 1 over the
trace's assigned sampled tokens (``w' = w * L / sum(w)``, ``L`` their count); the new
advantage is ``A' = A * w'``. So ``sum(w') = L`` in every trace, and an outcome-level set
(one constant advantage per trace, like GRPO or RLOO) keeps each trace's advantage mass:
``sum(A') = A * L = sum(A)``. Credit moves between tokens of a trace, never between
traces.

Weight streams:

- ``"entropies"``: the stamped per-token entropies, used as given.
- ``"logprobs"``, ``"trainer_logprobs"``, ``"reference_logprobs"``: a logprob is <= 0, so
  it is turned into the token's surprisal ``|logprob|`` (= -logprob, a one-sample entropy
  estimate): surprising tokens weigh more. For another transform (``exp``, a ratio of
  two streams, ...) compute the weights yourself, stamp them as a ``loss_weights`` stream
  and reweight by that.
- ``"loss_weights"`` with ``weight_name``: that named full-layout stream, read on the
  node's sampled positions.

Positions a weight stream does not cover weigh 1 before clipping: a node whose stream is
None (or an empty list, as verifiers writes unknown logprobs), a node without that
``loss_weights`` name, and the tail of a compact stream shorter than the node's sampled
tokens (values past them are dropped). Nodes unassigned in the source stay unassigned.
The source's advantages are read as spreading reads them: a compact list is cut or
zero-padded to the node's sampled tokens.
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from tracedb import credit_sets
from tracedb.credit.layouts import NODE_CREDIT
from tracedb.handle import HandleOf, handle_of
from tracedb.sqltext import quote_identifier

LOGPROB_STREAMS = ("logprobs", "trainer_logprobs", "reference_logprobs")
WEIGHT_STREAMS = ("entropies", *LOGPROB_STREAMS, "loss_weights")


def reweight(
    db: HandleOf,
    *,
    source: str | None = None,
    weights: str = "entropies",
    weight_name: str | None = None,
    min_weight: float = 0.5,
    max_weight: float = 2.0,
) -> pa.Table:
    """Reweighted credit per node: ``trace_id, node_index, values`` (compact, one value
    per sampled token) for every node that ``source`` (None or ``'default'``: the ingested
    advantages; else a named set) assigns.

    ``weights`` names the weight stream (see the module notes), ``weight_name`` the
    ``loss_weights`` entry. ``min_weight`` (>= 0) and ``max_weight`` clip the raw weights
    before the per-trace normalization. A trace whose clipped weights sum to 0 (possible
    only with ``min_weight=0``) keeps its advantages unchanged.
    """
    handle = handle_of(db)
    if weights not in WEIGHT_STREAMS:
        raise ValueError(f"unknown weight stream {weights!r}; choose one of {list(WEIGHT_STREAMS)}")
    if weights == "loss_weights" and not weight_name:
        raise ValueError("weights='loss_weights' needs weight_name (which loss_weights stream)")
    if weights != "loss_weights" and weight_name is not None:
        raise ValueError(f"weight_name is for weights='loss_weights', not {weights!r}")
    if not (
        math.isfinite(min_weight) and math.isfinite(max_weight) and 0 <= min_weight <= max_weight and max_weight > 0
    ):
        raise ValueError(f"need 0 <= min_weight <= max_weight, max_weight > 0; got {min_weight}, {max_weight}")
    credit = credit_sets.resolve(handle, source)  # None for the default set; a missing named set raises NotFound

    params: list = [credit]
    if weights == "loss_weights":
        # The named full-layout stream on the node's sampled positions (NULL without that name).
        raw = "list_where(element_at(n.loss_weights, ?)[1], tdb_mask(n.n_tokens, n.mask_prefix, n.mask_slots))"
        params.append(weight_name)
    else:
        raw = f"n.{quote_identifier(weights)}"
    rows = handle.sql(
        "SELECT a.trace_id, a.node_index, a.n_sampled, "
        "       dense_rank() OVER (ORDER BY a.trace_id) - 1 AS trace_code, "
        "       list_resize(a.advantages, a.n_sampled, 0.0::FLOAT) AS adv, "
        "       list_resize(coalesce(r.raw, []::FLOAT[]), a.n_sampled, 1.0::FLOAT) AS w "
        "FROM credit_advantages(?) a "
        f"JOIN (SELECT n.trace_id, n.node_index, {raw} AS raw FROM nodes n) r USING (trace_id, node_index) "
        "WHERE a.advantages IS NOT NULL ORDER BY a.trace_id, a.node_index",
        params,
    )
    if rows.num_rows == 0:
        return NODE_CREDIT.empty_table()

    n_sampled = rows.column("n_sampled").to_numpy().astype(np.int64)
    adv = _flat(rows.column("adv"))
    w = _flat(rows.column("w"))
    if weights in LOGPROB_STREAMS:
        w = np.abs(w)  # surprisal; the padding of uncovered positions stays 1
    w = np.clip(w, min_weight, max_weight)

    # Per trace: w' = w * L / sum(w) over the trace's assigned sampled tokens.
    token_trace = np.repeat(rows.column("trace_code").to_numpy().astype(np.int64), n_sampled)
    n_traces = int(token_trace.max()) + 1 if len(token_trace) else 0
    length = np.bincount(token_trace, minlength=n_traces).astype(np.float64)
    total = np.bincount(token_trace, weights=w, minlength=n_traces)
    scale = np.divide(length, total, out=np.ones(n_traces), where=total > 0)
    out = (adv * (np.where(total[token_trace] > 0, w, 1.0) * scale[token_trace])).astype(np.float32)

    offsets = np.zeros(len(n_sampled) + 1, dtype=np.int64)
    np.cumsum(n_sampled, out=offsets[1:])
    return pa.table(
        {
            "trace_id": rows.column("trace_id").cast(pa.string()),
            "node_index": rows.column("node_index").cast(pa.int32()),
            "values": pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(out, pa.float32())),
        },
        schema=NODE_CREDIT,
    )


def _flat(column: pa.ChunkedArray) -> np.ndarray:
    """The values of a list column without nulls, concatenated, as float64."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    return np.asarray(array.flatten().to_numpy(zero_copy_only=False), dtype=np.float64)
