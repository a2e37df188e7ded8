"""Potential-based credit (PGPO; MileGPO-lite): a state's potential is the shrunk mean return
of the group's turns that acted on it, and a turn's advantage its shaped one-step TD error.

For a turn t of group g with state key s_t (turns, returns ``G`` and keys as in
:mod:`tracedb.credit.states`)::

    Phi(s) = (sum of G over the group's turns with key s + kappa * mean_g R) / (n_s + kappa)
    A_t    = r_t + gamma * Phi(s_{t+1}) - Phi(s_t)

``s_{t+1}`` is the key of the next turn on the same branch (the node's owning branch, whose
entry is the node's value), and ``Phi = 0`` after a branch's last turn. ``r_t`` is the
per-turn reward (``reward_field``, else 0.0) with the outcome R added on the last turn;
``mean_g R`` is over the group's valid traces, as grpo counts them. ``kappa`` pulls a rarely
visited state's potential toward the group's mean reward (``kappa = 0``: the plain mean of
its visits). Along one branch the advantages telescope: with ``gamma = 1``, terminal reward
only and ``kappa = 0``, ``sum_t A_t = R - Phi(s_0)``, which is ``R - mean_g R`` when every
trace of the group starts from one shared state visited once per trace.

Excluded traces (failed, timed out, unscored) stay unassigned and enter no potential.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa

from tracedb.credit.layouts import NODE_CREDIT
from tracedb.credit.states import DEFAULT_KEY_FIELD, check_finite, state_turns
from tracedb.handle import HandleOf, handle_of


def potential(
    db: HandleOf,
    *,
    gamma: float = 1.0,
    kappa: float = 1.0,
    key_field: str | None = DEFAULT_KEY_FIELD,
    group_by: str = "group_id",
    reward: str | None = None,
    reward_field: str | None = None,
    include_failed: bool = False,
) -> pa.Table:
    """PGPO credit per turn node: ``trace_id, node_index, values`` (the node's
    ``r_t + gamma Phi(s_{t+1}) - Phi(s_t)`` on each sampled token); see the module docstring.

    ``gamma`` in [0, 1]; ``kappa`` >= 0; ``key_field`` names the state key's node field
    (None: histories only); ``reward``, ``group_by``, ``include_failed`` and
    ``reward_field`` as in :func:`tracedb.credit.anchor.anchor`.
    """
    handle = handle_of(db)
    kappa = check_finite("kappa", kappa, minimum=0.0)
    st = state_turns(
        handle,
        gamma=gamma,
        key_field=key_field,
        group_by=group_by,
        reward=reward,
        reward_field=reward_field,
        include_failed=include_failed,
    )
    if st is None:
        return NODE_CREDIT.empty_table()
    mean_r = st.traces.group_by("group").agg(mean_R=pl.col("R").mean())
    phi = (
        st.nodes.group_by("group", "key")
        .agg(total=pl.col("G").sum(), n=pl.len())
        .join(mean_r, on="group")
        .select("group", "key", phi=(pl.col("total") + kappa * pl.col("mean_R")) / (pl.col("n") + kappa))
    )
    turns = st.turns
    entry = st.nodes.get_column("entry").to_numpy()
    last = turns["last"][entry]
    following = st.key[np.minimum(entry + 1, len(st.key) - 1)]
    nodes = st.nodes.with_columns(
        r=pl.Series(turns["r"][entry]),
        next_key=pl.when(pl.Series(last)).then(None).otherwise(pl.Series(following)),
    )
    nodes = nodes.join(phi, on=["group", "key"], how="left").join(
        phi.select("group", next_key="key", phi_next="phi"), on=["group", "next_key"], how="left"
    )
    nodes = nodes.with_columns(A=pl.col("r") + gamma * pl.col("phi_next").fill_null(0.0) - pl.col("phi"))
    return st.credit(nodes)
