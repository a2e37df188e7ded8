"""Redistribution of a trajectory advantage over its turns (DRACO, VICT, IAPO, TASPO) and
the controls a targeting claim is compared against.

A *base* set that is constant per trace (``grpo``, ``rloo``, ``cec-B``) gives each trace
its advantage ``A_tau``. The trace's turns are its nodes with sampled tokens that the base
assigns (each node once, however many branches pass it; without a base set, every sampled
node of a trace GRPO assigns). Each turn has a weight ``w_t >= 0``, the node field
``weight_field``, and::

    w~_t = (1 - epsilon) * w_t / sum(w) + epsilon / T      (T turns of the trace)
    A_t  = A_tau * T * w~_t

broadcast over the turn's sampled tokens. So ``sum_t A_t = T * A_tau`` in every trace (a
sum over turns, each counted once): the mass GRPO puts on the trace's turns, moved
between them. A trace whose weights sum to 0 abstains: uniform, ``A_t = A_tau``.

- ``epsilon = 1`` is the **uniform control** (every turn ``A_tau``).
- ``shuffle_seed`` permutes the weights among each trace's turns before normalizing: the
  **matched-concentration shuffled control** (the same weights, hence the same per-trace
  spread of credit, on turns the weights did not pick). The permutation is a seeded sort
  of random keys within each trace, over the turns in (trace id, node index) order, so
  the same seed on the same rollouts gives the same permutation.
- DRACO, VICT and IAPO are this algorithm with the weights their harness writes on the
  nodes (rubric links, proof edges, influence scores); TASPO's turn-level shares likewise.

Weights: a node without the field, or with a null or non-numeric one, weighs 0; a
negative or non-finite weight is refused, naming the node. A ``weight_field`` no node has
is refused (a typo reads as "no weights" otherwise). Traces the base leaves unassigned
stay unassigned (None, not zeros); a base that varies within a trace is refused, naming
a trace where it does.
"""

from __future__ import annotations

import warnings

import numpy as np
import pyarrow as pa

from tracedb import credit_sets
from tracedb.credit.layouts import NODE_CREDIT, broadcast
from tracedb.credit.outcome import grpo
from tracedb.credit.returns import field_exists, node_field
from tracedb.errors import CreditWarning, NotFound
from tracedb.handle import HandleOf, handle_of

_BASE = "_tdb_redistribute_base"


def redistribute(
    db: HandleOf,
    *,
    base: str | None = None,
    weight_field: str | None = None,
    epsilon: float = 0.0,
    shuffle_seed: int | None = None,
) -> pa.Table:
    """``A_tau`` of the ``base`` set (None: GRPO with its defaults, computed here; a name:
    a stored set, ``"default"`` the ingested credit) redistributed over each trace's turns
    by the node weights ``weight_field`` (None: no weights, every trace uniform), mixed with
    ``epsilon`` (within [0, 1]) of uniform, after a seeded in-trace permutation of the
    weights when ``shuffle_seed`` (an integer >= 0) is given. Returns ``trace_id,
    node_index, values``; see the module notes."""
    handle = handle_of(db)
    if isinstance(epsilon, bool) or not isinstance(epsilon, int | float) or not 0.0 <= epsilon <= 1.0:
        raise ValueError(f"epsilon must be a number within [0, 1], got {epsilon!r}")
    if shuffle_seed is not None and (
        isinstance(shuffle_seed, bool) or not isinstance(shuffle_seed, int) or shuffle_seed < 0
    ):
        raise ValueError(f"shuffle_seed must be an integer >= 0 (or None), got {shuffle_seed!r}")
    if weight_field is not None and (not isinstance(weight_field, str) or not field_exists(handle, weight_field)):
        raise ValueError(
            f"weight_field {weight_field!r}: no node has that field (neither a nodes column nor a key of a node record)"
        )
    if base is not None and not isinstance(base, str):
        raise ValueError(f"base must name a credit set, got {base!r}")
    try:
        credit = credit_sets.resolve(handle, base)
    except NotFound as e:
        raise NotFound(f"base: {e}") from None

    params: dict[str, object] = {}
    w_sql = node_field(weight_field, set(handle.columns("nodes")), "weight_field", params)
    weights = f"SELECT n.trace_id, n.node_index, {w_sql} AS w FROM nodes n"
    if base is None:
        # No set named: GRPO as it would be stamped (one value per trace, broadcast).
        source = (
            f"SELECT n.trace_id, n.node_index, n.n_sampled, b.value AS lo, b.value AS hi "
            f"FROM nodes n JOIN {_BASE} b USING (trace_id) WHERE n.n_sampled > 0"
        )
        registered = grpo(handle)
    else:
        # A stored set as spreading reads it: a compact list cut or zero-padded to the node.
        params["base"] = credit
        source = (
            "SELECT trace_id, node_index, n_sampled, "
            "list_min(list_resize(advantages, n_sampled, 0.0::FLOAT))::DOUBLE AS lo, "
            "list_max(list_resize(advantages, n_sampled, 0.0::FLOAT))::DOUBLE AS hi "
            "FROM credit_advantages($base) WHERE advantages IS NOT NULL AND n_sampled > 0"
        )
        registered = pa.table({"trace_id": pa.array([], pa.string())})
    query = (
        f"WITH a AS ({source}) SELECT a.trace_id, a.node_index, a.n_sampled, a.lo, a.hi, w.w, "
        "dense_rank() OVER (ORDER BY a.trace_id) - 1 AS trace_code "
        f"FROM a JOIN ({weights}) w USING (trace_id, node_index) ORDER BY a.trace_id, a.node_index"
    )
    with handle.registered(_BASE, registered):
        rows = handle.sql(query, params or None)
    if rows.num_rows == 0:
        return NODE_CREDIT.empty_table()

    code = rows.column("trace_code").to_numpy().astype(np.int64)
    lo, hi = rows.column("lo").to_numpy(), rows.column("hi").to_numpy()
    n_traces = int(code[-1]) + 1
    first = np.searchsorted(code, np.arange(n_traces))  # rows come grouped by trace
    trace_lo, trace_hi = np.minimum.reduceat(lo, first), np.maximum.reduceat(hi, first)
    varies = np.flatnonzero(trace_lo != trace_hi)
    if len(varies):
        i = first[varies[0]]
        raise ValueError(
            f"base {base!r} is not constant per trace: trace {rows.column('trace_id')[i]} has advantages from "
            f"{trace_lo[varies[0]]} to {trace_hi[varies[0]]}; redistribute needs one advantage per trace "
            "(grpo, rloo, cec-B)"
        )

    w = rows.column("w").to_numpy().astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(w) | (w < 0))
    if len(bad):
        i = int(bad[0])
        raise ValueError(
            f"trace {rows.column('trace_id')[i]}, node {rows.column('node_index')[i]}: weight_field "
            f"{weight_field!r} is {w[i]}; weights must be finite and >= 0"
        )
    if shuffle_seed is not None:
        keys = np.random.default_rng(shuffle_seed).random(len(w))
        w = w[np.lexsort((keys, code))]  # a permutation within each trace's (contiguous) rows

    turns = np.bincount(code, minlength=n_traces).astype(np.float64)
    total = np.bincount(code, weights=w, minlength=n_traces)
    if epsilon == 1.0 or not (total > 0).any():
        why = (
            "epsilon=1"
            if epsilon == 1.0
            else ("no weight_field" if weight_field is None else f"every trace's {weight_field!r} weights sum to 0")
        )
        warnings.warn(
            CreditWarning(
                f"redistribute: {why}, so every turn gets its trace's advantage (the uniform control): the credit "
                f"equals {'grpo' if base is None else repr(base)}'s; pass weight_field=NAME to redistribute"
            ),
            stacklevel=2,
        )
    t, s = turns[code], total[code]
    share = np.where(s > 0, (1.0 - epsilon) * w / np.where(s > 0, s, 1.0) + epsilon / t, 1.0 / t)
    value = trace_lo[code] * t * share
    return broadcast(
        rows.column("trace_id").combine_chunks(),
        rows.column("node_index").combine_chunks(),
        rows.column("n_sampled").to_numpy().astype(np.int64),
        value,
    )
