"""Prefix-tree credit: rollouts of a group that share exact token prefixes form a tree.

Within a group, a *trie node* is a root-to-node sequence of token segments: two message
nodes (of the same or of different traces) are the same trie node exactly when the
segment ids (content hashes of their token ids) along their root-to-node paths are equal.
The group's rollouts hang below one virtual root. A trie node's value is the mean reward
of the distinct valid traces passing through it, and its advantage mixes how much better
it is than the group and than its trie parent, shrunk by how many traces support it::

    V(root) = mean reward of the group's valid traces
    V(n)    = mean reward of the valid traces through n
    A(n)    = ((V(n) - V(root)) + (V(n) - V(parent(n)))) / sqrt(traces through n)

with ``V(parent) = V(root)`` on the first level. Every message node of a valid trace gets
its trie node's advantage on each of its sampled tokens, so a prefix shared by several
rollouts (and a node shared by several branches) gets one value. Excluded traces (failed,
timed out, unscored: see :func:`tracedb.credit.outcome.trace_rewards`) neither enter the
means nor receive credit.

Trie nodes are interned exactly, not hashed: level by level (a loop over tree depth, not
over tokens), each node's trie id is the dense id of the pair (parent's trie id, segment
id), starting from the group's virtual root. Means are bincounts over distinct
(trie node, trace) pairs.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import polars as pl
import pyarrow as pa

from tracedb.credit.layouts import NODE_CREDIT, broadcast
from tracedb.credit.outcome import trace_rewards
from tracedb.handle import HandleOf, handle_of


@dataclass(frozen=True)
class Trie:
    """The prefix tries of every group's valid traces, over their message nodes.

    Node rows (every node of a valid trace, by trace id then node index) carry
    ``trace_id``, ``node_index``, ``n_sampled``, ``trace`` (the trace's code) and ``trie``
    (its trie node's id). Trie ids ``0 .. n_groups-1`` are the groups' virtual roots, and a
    trie node's id is larger than its parent's (ids are given level by level). Traces
    (codes ``0 .. n-1``, by trace id) carry ``group`` (a code) and ``reward``.
    """

    trace_id: pa.Array
    node_index: pa.Array
    n_sampled: np.ndarray
    trace: np.ndarray
    trie: np.ndarray
    parent: np.ndarray  # per trie id; a root is its own parent
    group: np.ndarray  # per trace code
    reward: np.ndarray  # per trace code
    n_groups: int

    @property
    def n_trie(self) -> int:
        return len(self.parent)

    def root_of(self) -> np.ndarray:
        """The group code (= root id) of every trie id."""
        root = np.arange(self.n_trie)
        root[self.trie] = self.group[self.trace]
        return root

    def members(self) -> tuple[np.ndarray, np.ndarray]:
        """Distinct (trie id, trace code) pairs: a trace counts once under each trie node it
        passes, however many of its nodes (branches) do; the roots hold every valid trace of
        their group."""
        n = len(self.reward)
        pairs = np.unique(self.trie * n + self.trace)
        roots = np.arange(n, dtype=np.int64)
        return np.concatenate([self.group, pairs // n]), np.concatenate([roots, pairs % n])

    def flat_groups(self) -> np.ndarray:
        """Per trace code: whether every valid trace of its group has the same reward."""
        lo = np.full(self.n_groups, np.inf)
        hi = np.full(self.n_groups, -np.inf)
        np.minimum.at(lo, self.group, self.reward)
        np.maximum.at(hi, self.group, self.reward)
        return (lo == hi)[self.group]


def prefix_trie(
    db: HandleOf, *, reward: str | None = None, group_by: str = "group_id", include_failed: bool = False
) -> Trie | None:
    """The prefix tries of every group (see the module notes); None when no valid trace has
    a node. ``reward``, ``group_by`` and ``include_failed`` select rewards, groups and valid
    traces as :func:`tracedb.credit.outcome.grpo` does; a trace without a group is its own
    group."""
    handle = handle_of(db)
    rewards = trace_rewards(handle, reward=reward, group_by=group_by, include_failed=include_failed)
    valid = rewards.filter(pl.col("valid")).with_columns(
        pl.coalesce(pl.col("group"), pl.lit("trace:") + pl.col("trace_id")).alias("group")
    )
    if valid.height == 0:
        return None
    valid = valid.sort("trace_id")
    trace_codes = valid.with_row_index("trace_code").select("trace_id", "trace_code")
    group_code = valid.get_column("group").rank("dense").cast(pl.Int64).to_numpy() - 1
    reward_arr = valid.get_column("reward").cast(pl.Float64).to_numpy()

    con = handle.con
    with handle.registered("_tdb_tree_traces", trace_codes.to_arrow()):
        nodes = con.sql(
            "WITH n AS ("
            "  SELECT n.trace_id, n.node_index, n.parent, n.n_sampled, t.trace_code, "
            "         dense_rank() OVER (ORDER BY n.segment_id) - 1 AS segment_code, "
            "         row_number() OVER (ORDER BY n.trace_id, n.node_index) - 1 AS row "
            "  FROM nodes n JOIN _tdb_tree_traces t USING (trace_id)) "
            "SELECT n.trace_id, n.node_index, n.n_sampled, n.trace_code, n.segment_code, n.row, "
            "       coalesce(p.row, -1) AS parent_row "
            "FROM n LEFT JOIN n p ON p.trace_id = n.trace_id AND p.node_index = n.parent "
            "ORDER BY n.row"
        ).to_arrow_table()
    if nodes.num_rows == 0:
        return None

    trace_code = nodes.column("trace_code").to_numpy().astype(np.int64)
    segment = nodes.column("segment_code").to_numpy().astype(np.int64)
    parent = nodes.column("parent_row").to_numpy().astype(np.int64)
    n_groups = int(group_code.max()) + 1
    trie, trie_parent = _intern(parent, segment, group_code[trace_code], n_groups)
    return Trie(
        trace_id=nodes.column("trace_id").combine_chunks().cast(pa.string()),
        node_index=nodes.column("node_index").combine_chunks().cast(pa.int32()),
        n_sampled=nodes.column("n_sampled").to_numpy().astype(np.int64),
        trace=trace_code,
        trie=trie,
        parent=trie_parent,
        group=group_code,
        reward=reward_arr,
        n_groups=n_groups,
    )


def node_credit(trie: Trie, value: np.ndarray) -> pa.Table:
    """``NODE_CREDIT`` from one value per node row: every node with sampled tokens, its value
    broadcast over them."""
    keep = trie.n_sampled > 0
    mask = pa.array(keep)
    return broadcast(trie.trace_id.filter(mask), trie.node_index.filter(mask), trie.n_sampled[keep], value[keep])


def tree(
    db: HandleOf,
    *,
    reward: str | None = None,
    group_by: str = "group_id",
    include_failed: bool = False,
) -> pa.Table:
    """Prefix-tree credit per node: ``trace_id, node_index, values`` (one value per
    sampled token, all equal to the node's trie-node advantage).

    ``reward``, ``group_by`` and ``include_failed`` select rewards, groups and valid
    traces as in :func:`tracedb.credit.outcome.grpo`; a trace without a group is its own
    group (and so gets zeros). A group whose rewards are all equal gets zeros.
    """
    trie = prefix_trie(db, reward=reward, group_by=group_by, include_failed=include_failed)
    if trie is None:
        return NODE_CREDIT.empty_table()
    # Means over distinct (trie node, trace) pairs: a trace counts once under each trie node.
    pair_trie, pair_trace = trie.members()
    count = np.bincount(pair_trie, minlength=trie.n_trie).astype(np.float64)
    total = np.bincount(pair_trie, weights=trie.reward[pair_trace], minlength=trie.n_trie)
    value = total / np.maximum(count, 1.0)

    # Every node row of a trie node is in one group: its chain starts at that group's root.
    v_root = value[trie.root_of()]
    v_parent = value[trie.parent]
    advantage = ((value - v_root) + (value - v_parent)) / np.sqrt(np.maximum(count, 1.0))
    advantage[: trie.n_groups] = 0.0
    return node_credit(trie, advantage[trie.trie])


def _depths(parent: np.ndarray) -> np.ndarray:
    """Depth of every node (roots 0) by pointer jumping: log2(max depth) vectorized steps."""
    depth = (parent >= 0).astype(np.int64)
    jump = parent.copy()
    while True:
        live = jump >= 0
        if not live.any():
            return depth
        target = jump[live]
        depth[live] += depth[target]
        jump[live] = jump[target]


def _intern(parent: np.ndarray, segment: np.ndarray, group: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """Trie id per node row and trie parent per trie id; ids ``0 .. n_groups-1`` are the
    groups' virtual roots (their own parents). Level by level, a node's trie id is the
    dense id of (its parent's trie id, its segment)."""
    depth = _depths(parent)
    order = np.argsort(depth, kind="stable")
    bounds = np.flatnonzero(np.diff(depth[order])) + 1
    trie = np.full(len(parent), -1, dtype=np.int64)
    trie_parent = [np.arange(n_groups, dtype=np.int64)]
    next_id = n_groups
    n_segments = int(segment.max()) + 1
    for rows in np.split(order, bounds):
        up = np.where(parent[rows] >= 0, trie[np.maximum(parent[rows], 0)], group[rows])
        keys, inverse = np.unique(up * n_segments + segment[rows], return_inverse=True)
        trie[rows] = next_id + inverse.reshape(-1)
        trie_parent.append(keys // n_segments)
        next_id += len(keys)
    return trie, np.concatenate(trie_parent)
