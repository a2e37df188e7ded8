"""Truncated importance weights for an off-policy trainer step (``importance="tis"``).

A token sampled by the inference engine (``logprobs``) and scored again by the trainer
(``trainer_logprobs``, written back with ``db.write_nodes(rows,
stream="trainer_logprobs")`` by a recompute pass before packing) gets the weight
``min(exp(trainer - inference), clip)`` (truncated importance sampling: the ratio corrects
for the two policies, the cap bounds its variance). A token *holds both* when it is one of
its node's first ``min(n_sampled, len(logprobs), len(trainer_logprobs))`` sampled tokens,
the rule of :mod:`tracedb.offpolicy` (a None or empty stream holds none; values past the
node's sampled tokens are no tokens).

In a packed micro-batch the column ``importance_weight`` (float32) holds that weight on
every loss token holding both streams and 1.0 on every other token (loss tokens without
them, tokens out of the loss, padding); the plan's report counts the loss tokens of each
kind and those whose ratio the cap cut (:class:`~tracedb.batches.plan.PackReport`). The
ratio is computed in float64 from the stored float32 values, then rounded to float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tracedb.views.nodes import NodeColumns, kernels

IMPORTANCE = ("tis",)
"""The importance corrections ``micro_batches`` knows."""
DEFAULT_CLIP = 2.0
"""The cap on the ratio when ``importance="tis"`` is given without ``clip``."""


def check(importance: str | None, clip: float | None) -> float | None:
    """The cap to apply (None: no importance weights), or ValueError naming the argument:
    ``importance`` must be None or ``"tis"``, ``clip`` a finite number > 0, and ``clip``
    alone (without ``importance``) would do nothing."""
    if importance is None:
        if clip is not None:
            raise ValueError(f"clip={clip!r} needs importance='tis' (without it no importance weight is written)")
        return None
    if importance not in IMPORTANCE:
        raise ValueError(f"importance must be one of {list(IMPORTANCE)} or None, not {importance!r}")
    if clip is None:
        return DEFAULT_CLIP
    if isinstance(clip, bool) or not isinstance(clip, int | float) or not math.isfinite(clip) or clip <= 0:
        raise ValueError(f"clip must be a finite number above 0 (the cap on exp(trainer - inference)), not {clip!r}")
    return float(clip)


@dataclass
class Weights:
    """Per token of a branch view (the samples' ``view``, flat): the truncated weight
    (1.0 where the token does not hold both streams), whether it holds both, and whether
    the cap cut its ratio."""

    weight: np.ndarray  # float32
    held: np.ndarray  # bool
    clipped: np.ndarray  # bool


def view_weights(
    data: NodeColumns, path_off: np.ndarray, path_rows: np.ndarray, view_offsets: np.ndarray, clip: float
) -> Weights:
    """The weights over the tokens of the branches whose node rows are ``path_rows``
    (``path_off``: each branch's entries; ``view_offsets``: each branch's first token),
    spread along the paths by the view kernel as any compact stream is."""
    lp, tr = data.streams["logprobs"], data.streams["trainer_logprobs"]
    take = np.where(lp.has & tr.has, np.minimum(lp.take, tr.take), 0).astype(np.int64)
    offsets = np.zeros(len(take) + 1, np.int64)
    np.cumsum(take, out=offsets[1:])
    within = np.arange(int(offsets[-1]), dtype=np.int64) - np.repeat(offsets[:-1], take)
    rows = np.repeat(np.arange(len(take), dtype=np.int64), take)
    d = tr.values[tr.src[rows] + within].astype(np.float64) - lp.values[lp.src[rows] + within].astype(np.float64)
    with np.errstate(over="ignore"):
        ratio = np.exp(d)
    compact = np.minimum(ratio, clip).astype(np.float32)
    over = (ratio > clip).astype(np.float32)
    total = int(view_offsets[-1])
    n_branches = len(path_off) - 1
    out = []
    for values in (compact, np.ones(len(compact), np.float32), over):
        spread = np.empty(total, np.float32)
        kernels().spread_stream(
            0, n_branches, path_off, path_rows, view_offsets, data.n_tok, data.prefix, data.slot_src, data.slots,
            offsets[:-1], take, values, spread,
        )  # fmt: skip
        out.append(spread)
    held = out[1] > 0.5
    return Weights(weight=np.where(held, out[0], np.float32(1.0)), held=held, clipped=held & (out[2] > 0.5))
