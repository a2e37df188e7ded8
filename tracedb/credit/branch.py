"""Branch-variance credit (CBPO) on the group prefix tries of :mod:`tracedb.credit.tree`.

Within a group, rollouts that share exact token prefixes form a trie below the group's
virtual root (:func:`tracedb.credit.tree.prefix_trie`). A *fork* is a trie node with two or
more children (the virtual root included): the rollouts through it went different ways
there. At each fork ``n``, over the distinct valid traces through ``n``::

    V(n)   = mean of R
    CBV_n  = population std of R (ddof 0)

The *segment* of fork ``n`` is every trie node below ``n`` down to and including the next
fork or leaf: each trie node belongs to the segment of its nearest strict fork ancestor.
A trace ``i``'s node in the segment of fork ``n`` gets, on each of its sampled tokens::

    A = (R_i - V(n)) * (1 + beta * CBV_n / mean CBV)

with the mean over the group's forks (a factor of 1 when that mean is 0): forks where the
outcome varies a lot weigh more. Nodes above the group's first fork (no fork above them)
get GRPO credit ``R_i - mean_g R``. Segments are disjoint, so every token is credited once;
a node shared by several branches of a trace is one node. A group whose rewards are all
equal gets zeros, a trace without a group is its own group (zeros), and excluded traces
(failed, timed out, unscored) stay unassigned, as in ``tree``.

Vectorized: means and variances are bincounts over distinct (trie node, trace) pairs, and
the nearest fork ancestor is found by pointer jumping (``log2`` of the trie depth passes).
"""

from __future__ import annotations

import math

import numpy as np
import pyarrow as pa

from tracedb.credit.layouts import NODE_CREDIT
from tracedb.credit.tree import Trie, node_credit, prefix_trie
from tracedb.handle import HandleOf


def branch(
    db: HandleOf,
    *,
    beta: float = 1.0,
    reward: str | None = None,
    group_by: str = "group_id",
    include_failed: bool = False,
) -> pa.Table:
    """CBPO credit per node: ``trace_id, node_index, values`` (the node's value on each of
    its sampled tokens); see the module notes. ``beta`` (a finite number >= 0) scales how
    much a fork's outcome spread raises its segment's credit; ``reward``, ``group_by`` and
    ``include_failed`` select rewards, groups and valid traces as
    :func:`tracedb.credit.outcome.grpo` does."""
    if isinstance(beta, bool) or not isinstance(beta, int | float) or not math.isfinite(beta) or beta < 0:
        raise ValueError(f"beta must be a finite number >= 0, got {beta!r}")
    trie = prefix_trie(db, reward=reward, group_by=group_by, include_failed=include_failed)
    if trie is None:
        return NODE_CREDIT.empty_table()
    pair_trie, pair_trace = trie.members()
    n_trie = trie.n_trie
    count = np.maximum(np.bincount(pair_trie, minlength=n_trie), 1).astype(np.float64)
    r = trie.reward[pair_trace]
    value = np.bincount(pair_trie, weights=r, minlength=n_trie) / count
    cbv = np.sqrt(np.bincount(pair_trie, weights=(r - value[pair_trie]) ** 2, minlength=n_trie) / count)

    children = np.bincount(trie.parent[trie.n_groups :], minlength=n_trie)
    fork = children >= 2
    root = trie.root_of()
    forks = np.bincount(root[fork], minlength=trie.n_groups)
    mean_cbv = np.bincount(root[fork], weights=cbv[fork], minlength=trie.n_groups) / np.maximum(forks, 1)
    mean_at = mean_cbv[root]
    factor = 1.0 + beta * np.divide(cbv, mean_at, out=np.zeros(n_trie), where=mean_at > 0)

    # Each node row is scored against its nearest strict fork ancestor, else its group root
    # (V(root) is the group mean: GRPO credit, factor 1).
    above = _fork_above(trie, fork)[trie.trie]
    group_root = trie.group[trie.trace]
    anchor = np.where(above >= 0, above, group_root)
    scale = np.where(above >= 0, factor[np.maximum(above, 0)], 1.0)
    credit = (trie.reward[trie.trace] - value[anchor]) * scale
    credit[trie.flat_groups()[trie.trace]] = 0.0  # equal rewards carry no gradient: exactly 0
    return node_credit(trie, credit)


def _fork_above(trie: Trie, fork: np.ndarray) -> np.ndarray:
    """Per trie id: its nearest strict ancestor that is a fork, or -1 (roots: -1).

    Pointer jumping: ``up[m]`` starts at m's parent and, while it is not a fork, jumps to
    ``up[up[m]]``; every node skipped is a non-fork, so the first fork reached is the
    nearest."""
    up = trie.parent.copy()
    up[: trie.n_groups] = -1
    while True:
        open_ = np.flatnonzero(up >= 0)
        open_ = open_[~fork[up[open_]]]
        if not len(open_):
            return up
        up[open_] = up[up[open_]]
