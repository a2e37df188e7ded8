"""The graph rules of the verifiers v1 contract, on plain arrays.

- :func:`branch_paths`: a trace's branches (leaves in node order, root-to-leaf paths) and
  which are trainable, as ingest stores them in ``branches``.
- :func:`owning_branch`: which branch a node shared by several branches belongs to, for
  everything that must count a node once: ``train_once`` views, the trainer feed's
  train-once rule, and turn-level credit (one node, one value). It is the first
  trainable branch that holds the node, or the first branch when none of them is
  trainable. The ``branch_nodes()`` SQL macro states the same rule (``first_branch``);
  ``tests/views/test_graph_rules.py`` asserts the two agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def branch_paths(
    parents: Sequence[int | None], links: Sequence[Sequence[dict[str, Any]] | None]
) -> list[tuple[int, bool, list[int]]]:
    """(leaf, trainable, root-to-leaf path) per branch, in verifiers' leaf order.

    Leaves are the nodes nobody names as parent, in node order. A leaf with a
    ``compaction_attempt`` link is trainable only if some node holds a ``compaction``
    link to it (the harness resumed from that attempt).
    """
    has_child = {p for p in parents if p is not None}
    accepted = {link["node"] for ls in links if ls for link in ls if link["type"] == "compaction"}
    out = []
    for leaf in range(len(parents)):
        if leaf in has_child:
            continue
        path = []
        nid: int | None = leaf
        while nid is not None:
            path.append(nid)
            nid = parents[nid]
        path.reverse()
        attempt = any(link["type"] == "compaction_attempt" for link in links[leaf] or [])
        out.append((leaf, not attempt or leaf in accepted, path))
    return out


def owning_branch(entry_node: np.ndarray, entry_branch: np.ndarray, trainable: np.ndarray, n_nodes: int) -> np.ndarray:
    """Per node row, the branch that owns it: the first trainable branch holding it, else
    the first branch holding it; -1 for a node on no branch.

    ``entry_node`` / ``entry_branch`` list the path entries (node row, branch) of every
    branch of the traces concerned; branches are numbered in view order (by trace, then
    ``branch_index``) and ``trainable`` is per branch. Only the order of a trace's own
    branches matters, so any selection of whole traces gives the same owners.
    """
    n_branches = len(trainable)
    rank = np.arange(n_branches, dtype=np.int64) + np.where(np.asarray(trainable, bool), 0, n_branches)
    best = np.full(n_nodes, 2 * n_branches, np.int64)
    np.minimum.at(best, np.asarray(entry_node, np.int64), rank[np.asarray(entry_branch, np.int64)])
    return np.where(best < 2 * n_branches, best % max(n_branches, 1), -1)
