"""V-trace (IMPALA, Espeholt et al. 2018): turn-level off-policy advantages along each branch.

The turns, rewards, values and termination are those of :mod:`tracedb.credit.returns`
(``branch_turns``: the nodes of a branch holding sampled tokens, root first; ``r_s`` from
``reward_field`` plus the outcome reward on the branch's last turn; ``V(x_s)`` from
``value_field``, 0.0 when absent; after the last turn ``V_T`` is 0 on termination and the
bootstrap on truncation). What V-trace adds is the ratio between the policy being trained
and the one that sampled each turn. Per turn ``s``, with ``S_s`` the sum over the turn's
sampled tokens of ``trainer_logprobs - logprobs``:

- ``rho_s = min(rho_bar, exp(S_s))`` and ``c_s = min(c_bar, exp(S_s))``;
- ``delta_s = rho_s (r_s + gamma V(x_{s+1}) - V(x_s))``;
- the V-trace target ``v_s = V(x_s) + delta_s + gamma c_s (v_{s+1} - V(x_{s+1}))``, with
  ``v_T = V_T``;
- each turn's tokens get the policy-gradient advantage ``rho_s (r_s + gamma v_{s+1} - V(x_s))``.

With the two policies equal (``S_s = 0``) and ``rho_bar, c_bar >= 1`` this is
``G_s - V(x_s)``: GAE with ``lam=1``.

**Both streams on every turn.** The traces credited (see ``returns``' exclusions) must hold
``logprobs`` and ``trainer_logprobs`` on every sampled token of every turn (a recompute pass
writes the trainer's with ``db.write_nodes(rows, stream="trainer_logprobs")``); a trace with
none, or with a turn they do not cover, is refused, the traces named, in one ValueError.

**One value per node**, from the branch that owns it (first trainable), as in ``returns``.

**Computation.** ``v_s - V(x_s) = delta_s + gamma c_s (v_{s+1} - V(x_{s+1}))`` is a reverse
recurrence with a coefficient per turn, solved for every branch at once by a segmented scan
with recursive doubling (:func:`weighted_reverse_scan`); float64 throughout, the stamped
values float32.
"""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import pyarrow as pa

from tracedb.credit.layouts import NODE_CREDIT, NODE_VALUE
from tracedb.credit.returns import branch_turns, check_unit, node_scalars, node_values
from tracedb.handle import Handle, HandleOf, handle_of
from tracedb.offpolicy import turn_log_ratios

NAMED = 10
"""The most traces a refusal names (then how many more)."""


def vtrace(
    db: HandleOf,
    *,
    gamma: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    reward: str | None = None,
    reward_field: str | None = None,
    value_field: str | None = None,
    bootstrap_field: str | None = None,
    terminal_reward: bool = True,
    include_failed: bool = False,
) -> pa.Table:
    """V-trace's policy-gradient advantage of every turn (see the module docstring).

    Returns ``(trace_id, node_index, values)``: each sampled node's value broadcast over its
    sampled tokens. ValueError for a ``gamma`` outside [0, 1], a ``rho_bar`` or ``c_bar``
    not above 0, and for credited traces lacking ``trainer_logprobs`` (named).
    """
    found = _vtrace(handle_of(db), **{k: v for k, v in locals().items() if k != "db"})
    return NODE_CREDIT.empty_table() if found is None else node_values(*found)


def vtrace_per_node(db: HandleOf, **params: object) -> pa.Table:
    """:func:`vtrace` as one value per node (``node_scalars``): what ``run`` stamps."""
    found = _vtrace(handle_of(db), **params)
    return NODE_VALUE.empty_table() if found is None else node_scalars(*found)


def _vtrace(
    db: Handle,
    *,
    gamma: float = 1.0,
    rho_bar: float = 1.0,
    c_bar: float = 1.0,
    reward: str | None = None,
    reward_field: str | None = None,
    value_field: str | None = None,
    bootstrap_field: str | None = None,
    terminal_reward: bool = True,
    include_failed: bool = False,
) -> tuple[dict, np.ndarray] | None:
    check_unit("gamma", gamma)
    for name, bar in (("rho_bar", rho_bar), ("c_bar", c_bar)):
        if isinstance(bar, bool) or not isinstance(bar, int | float) or not math.isfinite(bar) or bar <= 0:
            raise ValueError(f"{name} must be a finite number above 0 (a cap on the importance ratio), got {bar!r}")
    turns = branch_turns(db, reward, reward_field, value_field, bootstrap_field, terminal_reward, include_failed)
    if turns is None:
        return None
    log_ratio = _turn_ratios(db, turns)
    with np.errstate(over="ignore"):
        ratio = np.exp(log_ratio)
    rho, c = np.minimum(rho_bar, ratio), np.minimum(c_bar, ratio)
    r, v, boot, last, end = turns["r"], turns["v"], turns["boot"], turns["last"], turns["end"]
    v_next = np.empty_like(v)
    v_next[:-1] = v[1:]
    v_next[last] = boot  # V_T: after the branch's last turn the bootstrap (0 on termination)
    delta = rho * (r + gamma * v_next - v)
    gap = weighted_reverse_scan(delta, end, gamma * c)  # v_s - V(x_s)
    target_next = np.empty_like(v)
    target_next[:-1] = v[1:] + gap[1:]
    target_next[last] = boot  # v_T = V_T
    advantage = rho * (r + gamma * target_next - v)
    if not np.isfinite(advantage).all():
        i = int(np.flatnonzero(~np.isfinite(advantage))[0])
        raise ValueError(
            f"vtrace overflowed at trace {turns['trace_id'][i]}, node {turns['node_index'][i]}: gamma * c_bar "
            f"= {gamma * c_bar} compounds over the branch's turns; use c_bar <= 1 / gamma"
        )
    return turns, advantage


def _turn_ratios(db: Handle, turns: dict) -> np.ndarray:
    """``S_s`` per turn entry of ``turns``; refuses the credited traces whose turns the two
    streams do not cover (one ValueError naming them)."""
    entries = pl.DataFrame(
        {
            "trace_id": pl.from_arrow(turns["trace_id"].cast(pa.string())),
            "node_index": turns["node_index"].astype(np.int32),
            "entry": np.arange(len(turns["node_index"]), dtype=np.int64),
        }
    )
    ratios = pl.from_arrow(turn_log_ratios(db))
    assert isinstance(ratios, pl.DataFrame)
    joined = entries.join(ratios, on=["trace_id", "node_index"], how="left").sort("entry")
    _refuse_uncovered(joined)
    return joined["log_ratio"].to_numpy().astype(np.float64)


def _refuse_uncovered(joined: pl.DataFrame) -> None:
    """One ValueError naming the traces without trainer_logprobs and those with a turn the
    streams do not cover (trace, node, the counts), at most :data:`NAMED` of each."""
    turns = joined.unique(["trace_id", "node_index"]).sort(["trace_id", "node_index"])
    short = (pl.col("n_logprobs") < pl.col("n_sampled")) | (pl.col("n_trainer_logprobs") < pl.col("n_sampled"))
    per_trace = turns.group_by("trace_id").agg(none=(pl.col("n_trainer_logprobs") == 0).all()).sort("trace_id")
    missing = per_trace.filter(pl.col("none"))["trace_id"].to_list()
    partial = turns.filter(short & ~pl.col("trace_id").is_in(missing)).unique(
        "trace_id", keep="first", maintain_order=True
    )
    if not missing and not partial.height:
        return
    parts = []
    if missing:
        parts.append(f"{_count(len(missing))} hold no trainer_logprobs: {_names(missing)}")
    if partial.height:
        rows = [
            f"trace {r['trace_id']}, node {r['node_index']}: {r['n_sampled']} sampled tokens, "
            f"{r['n_logprobs']} logprobs, {r['n_trainer_logprobs']} trainer_logprobs"
            for r in partial.sort("trace_id").head(NAMED).iter_rows(named=True)
        ]
        more = f" and {partial.height - NAMED} more" if partial.height > NAMED else ""
        parts.append(f"{_count(partial.height)} have a turn the streams do not cover ({'; '.join(rows)}{more})")
    raise ValueError(
        "vtrace needs logprobs and trainer_logprobs on every sampled token of the traces it credits: "
        + "; ".join(parts)
        + ". Write the trainer's back with db.write_nodes(rows, stream='trainer_logprobs') after a recompute pass."
    )


def _count(n: int) -> str:
    return f"{n} trace{'s' if n != 1 else ''}"


def _names(ids: list[str]) -> str:
    shown = ", ".join(ids[:NAMED])
    return shown + (f" and {len(ids) - NAMED} more" if len(ids) > NAMED else "")


def weighted_reverse_scan(x: np.ndarray, end: np.ndarray, coef: np.ndarray) -> np.ndarray:
    """``y_t = x_t + coef_t y_{t+1}`` within each segment (``end[t]``: index of t's segment
    end; nothing follows a segment's end).

    Recursive doubling: after the pass with stride ``d``, ``y_t`` sums
    ``(prod_{j<k} coef_{t+j}) x_{t+k}`` for ``k < 2d`` inside the segment and ``p_t`` holds
    ``prod_{j<2d} coef_{t+j}``; an index whose partner ``d`` ahead lies past its segment's
    end is finished and never read as a multiplier again."""
    y = x.astype(np.float64, copy=True)
    p = np.asarray(coef, np.float64).copy()
    active = np.arange(len(y))
    d = 1
    while True:
        active = active[active + d <= end[active]]
        if not len(active):
            break
        # Fancy indexing copies the right-hand sides: both updates read the previous pass.
        y[active] += p[active] * y[active + d]
        p[active] *= p[active + d]
        d *= 2
    return y
