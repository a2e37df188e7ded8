"""Turn-level discounted returns and GAE(gamma, lambda) along each branch.

**Turns.** The turns of a branch are the nodes on its path (root first) that hold sampled
tokens (``n_sampled > 0``), in path order. Each turn ``t`` has a reward ``r_t`` and a value
``V_t``:

- ``r_t`` is the node field ``reward_field`` (None: 0.0 on every turn), plus, with
  ``terminal_reward=True``, the trace's outcome reward (the weighted sum ``traces.reward``,
  or the score of the reward named ``reward``) on the branch's *last* turn. Every branch
  gets it there, a compaction attempt included: it is what the episode that branch was part
  of earned.
- ``V_t`` is the node field ``value_field`` (None: 0.0).

A field name is a ``nodes`` column when one has that name, else a key of the node's record
that tracedb keeps in ``nodes.extra`` (``"value": 0.3``). A node without the field, or with
a null or non-numeric one, reads 0.0; an infinite or NaN one is refused (ValueError).

**Termination** (as in standard GAE, bootstrap only on truncation). A branch is
*truncated* when its trace hit a limit (``stop_condition`` in :data:`LIMITS`, or
``is_timeout``), when it is untrainable (a compaction attempt that was not resumed), or when
its leaf is a compaction attempt that was resumed (the episode went on in another branch).
Otherwise it is *terminated*. After the last turn ``T-1`` the value ``V_T`` is 0 on
termination; on truncation it is ``bootstrap_field`` of the last turn when given, else
``V_{T-1}``.

- ``returns``: ``G_t = r_t + gamma G_{t+1}`` with ``G_T = V_T``; stamps ``G_t`` (``G_t - V_t``
  with ``subtract_values``).
- ``gae``: ``delta_t = r_t + gamma V_{t+1} - V_t``, ``A_t = delta_t + gamma lam A_{t+1}``.

**One value per node.** Branches share nodes; a shared turn takes its value from the first
trainable branch through it (the first branch when none is), the rule ``train_once`` uses in
:mod:`tracedb.views`. The value is broadcast over the node's sampled tokens.

**Excluded traces** (no outcome reward while ``terminal_reward``; failed or timed out unless
``include_failed``) get no rows: their nodes stay unassigned (None, not zeros).

**Computation.** Three small scans (nodes, branches, traces), joined in numpy, flatten
every branch's turns into a single array ordered by branch; the recurrences
``y_t = x_t + c y_{t+1}`` are then solved for all branches at once by a segmented reverse
scan with recursive doubling (``log2`` of the longest branch numpy passes, no loop per
branch or turn). The doubling only ever multiplies by ``c**d <= 1``, so long branches with a
small ``c`` cannot overflow; ``c**d`` underflowing to 0 is the exact limit, unlike rescaling
by ``c**-t``. Sums are float64; the stamped values float32.
"""

from __future__ import annotations

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from tracedb import tables
from tracedb.credit.layouts import NODE_CREDIT, NODE_VALUE
from tracedb.credit.outcome import trace_rewards
from tracedb.graph import owning_branch
from tracedb.handle import Handle, HandleOf, handle_of
from tracedb.sqltext import quote_identifier
from tracedb.views.nodes import node_ordered

LIMITS = (
    "max_turns",
    "max_input_tokens",
    "max_output_tokens",
    "max_total_tokens",
    "max_turn_tokens",
    "compaction_failed",
)
"""Stop conditions that cut an episode short (verifiers ``Trace.is_truncated``;
``max_turn_tokens``, a response cut at the per-turn cap, since verifiers 0.4.1)."""


def returns(
    db: HandleOf,
    *,
    gamma: float = 1.0,
    reward: str | None = None,
    reward_field: str | None = None,
    value_field: str | None = None,
    bootstrap_field: str | None = None,
    terminal_reward: bool = True,
    subtract_values: bool = False,
    include_failed: bool = False,
) -> pa.Table:
    """Discounted return ``G_t`` of every turn (``G_t - V_t`` with ``subtract_values``).

    Returns ``(trace_id, node_index, values)``: each sampled node's value broadcast over its
    sampled tokens. See the module docstring for turns, rewards, values and termination.
    """
    found = _returns(handle_of(db), **_args(locals()))
    return NODE_CREDIT.empty_table() if found is None else node_values(*found)


def returns_per_node(db: HandleOf, **params: object) -> pa.Table:
    """:func:`returns` as one value per node (:func:`node_scalars`): what ``run`` stamps."""
    found = _returns(handle_of(db), **params)
    return NODE_VALUE.empty_table() if found is None else node_scalars(*found)


def _returns(
    db: Handle,
    *,
    gamma: float = 1.0,
    reward: str | None = None,
    reward_field: str | None = None,
    value_field: str | None = None,
    bootstrap_field: str | None = None,
    terminal_reward: bool = True,
    subtract_values: bool = False,
    include_failed: bool = False,
) -> tuple[dict, np.ndarray] | None:
    check_unit("gamma", gamma)
    turns = branch_turns(db, reward, reward_field, value_field, bootstrap_field, terminal_reward, include_failed)
    if turns is None:
        return None
    r, v, boot, last, end = turns["r"], turns["v"], turns["boot"], turns["last"], turns["end"]
    x = r.copy()
    x[last] += gamma * boot  # G_T folded into the last reward: G_{T-1} = r_{T-1} + gamma G_T
    g = reverse_scan(x, end, gamma)
    return turns, g - v if subtract_values else g


def gae(
    db: HandleOf,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    reward: str | None = None,
    reward_field: str | None = None,
    value_field: str | None = None,
    bootstrap_field: str | None = None,
    terminal_reward: bool = True,
    include_failed: bool = False,
) -> pa.Table:
    """Generalized advantage estimation over each branch's turns.

    ``A_t = sum_k (gamma lam)^k delta_{t+k}`` with ``delta_t = r_t + gamma V_{t+1} - V_t``;
    ``lam=1`` gives ``G_t - V_t``, ``lam=0`` the one-step TD error. Returns
    ``(trace_id, node_index, values)`` like :func:`returns`.
    """
    found = _gae(handle_of(db), **_args(locals()))
    return NODE_CREDIT.empty_table() if found is None else node_values(*found)


def gae_per_node(db: HandleOf, **params: object) -> pa.Table:
    """:func:`gae` as one value per node (:func:`node_scalars`): what ``run`` stamps."""
    found = _gae(handle_of(db), **params)
    return NODE_VALUE.empty_table() if found is None else node_scalars(*found)


def _gae(
    db: Handle,
    *,
    gamma: float = 1.0,
    lam: float = 0.95,
    reward: str | None = None,
    reward_field: str | None = None,
    value_field: str | None = None,
    bootstrap_field: str | None = None,
    terminal_reward: bool = True,
    include_failed: bool = False,
) -> tuple[dict, np.ndarray] | None:
    check_unit("gamma", gamma)
    check_unit("lam", lam)
    turns = branch_turns(db, reward, reward_field, value_field, bootstrap_field, terminal_reward, include_failed)
    if turns is None:
        return None
    r, v, boot, last, end = turns["r"], turns["v"], turns["boot"], turns["last"], turns["end"]
    v_next = np.empty_like(v)
    v_next[:-1] = v[1:]
    v_next[last] = boot  # V_T: the next turn of the branch does not exist, the bootstrap stands in
    delta = r + gamma * v_next - v
    return turns, reverse_scan(delta, end, gamma * lam)


def _args(scope: dict[str, object]) -> dict[str, object]:
    """A public function's keyword parameters, from its ``locals()``."""
    return {k: v for k, v in scope.items() if k != "db"}


def check_unit(name: str, x: float) -> None:
    """Refuse a discount factor ``x`` outside [0, 1] (ValueError naming parameter ``name``)."""
    # Outside [0, 1] the discount no longer shrinks and the scan's factors could overflow.
    if not 0.0 <= float(x) <= 1.0:
        raise ValueError(f"{name} must be within [0, 1], got {x!r}")


def reverse_scan(x: np.ndarray, end: np.ndarray, c: float) -> np.ndarray:
    """``y_t = x_t + c y_{t+1}`` within each segment (``end[t]``: index of t's segment end).

    Recursive doubling: after the pass with stride ``d``, ``y_t`` sums ``c^k x_{t+k}`` for
    ``k < 2d`` inside the segment. ``c**d`` only shrinks (to 0.0 at worst, the true limit).
    """
    y = x.astype(np.float64, copy=True)
    active = np.arange(len(y))
    d = 1
    while True:
        active = active[active + d <= end[active]]  # turns whose partner d ahead is in their branch
        if not len(active):
            break
        # Fancy indexing copies the right-hand side, so every update reads the previous pass.
        y[active] += (c**d) * y[active + d]
        d *= 2
    return y


def node_field(name: str | None, columns: set[str], key: str, params: dict[str, object]) -> str:
    """SQL reading node field ``name`` as DOUBLE (0.0 when absent) from ``n`` (a nodes row):
    the ``nodes`` column of that name, else that key of ``nodes.extra``; a null or
    non-numeric value reads 0.0. ``key`` names the bound parameter it adds to ``params``."""
    if name is None:
        return "0.0::DOUBLE"
    if name in columns:
        return f"coalesce(TRY_CAST(n.{quote_identifier(name)} AS DOUBLE), 0.0)"
    params[key] = name
    return f"coalesce(TRY_CAST(json_extract_string(n.extra, '$.' || to_json(${key}::VARCHAR)) AS DOUBLE), 0.0)"


def field_exists(db: Handle, name: str) -> bool:
    """Whether ``name`` is a ``nodes`` column or a key some node's ``extra`` holds (a
    parameter naming a field no node has is a typo, not a field that reads 0.0)."""
    if name in NODE_COLUMNS:
        return True
    query = "SELECT EXISTS (SELECT 1 FROM nodes WHERE json_exists(extra, '$.' || to_json(?::VARCHAR)))"
    return bool(db.scalar(query, [name]))


NODE_COLUMNS = frozenset(tables.NODES.names)
"""The ``nodes`` columns (the stored layout: an open file always has it)."""


def branch_turns(
    db: Handle,
    reward: str | None,
    reward_field: str | None,
    value_field: str | None,
    bootstrap_field: str | None,
    terminal_reward: bool,
    include_failed: bool,
) -> dict[str, np.ndarray | pa.Array] | None:
    """Every turn of every branch of the assigned traces, ordered by trace id, branch, then path
    position (None when there is none): the branch/turn table the turn-level algorithms share.

    Numpy columns, one entry per (branch, turn): ``r`` (the terminal reward added on each
    branch's last turn), ``v``, ``last`` (the branch's last turn), ``end`` (index of the
    branch's last turn), ``n_sampled``, ``node_index``, and ``trace_id`` (Arrow); ``boot``:
    ``V_T`` of each branch, in branch order. ``keep``: one entry index per node, from the
    branch that owns it (first trainable), in (trace id, node index) order;
    :func:`node_values` stamps those.

    Three plain scans (traces, nodes, branches; a filter, join or ORDER BY costs DuckDB
    several times the scan) joined in numpy."""
    # The outcome reward and which traces are assigned come from the same rule as GRPO/RLOO.
    traces = trace_rewards(
        db, reward=reward, include_failed=include_failed, columns=("ok", "is_timeout", "stop_condition")
    )
    timeout = pl.col("is_timeout").fill_null(False)
    if terminal_reward:
        assigned, outcome = pl.col("valid"), pl.col("reward")
    else:
        # Without an outcome reward a missing one excludes nothing; failed runs still do.
        assigned = pl.lit(True) if include_failed else pl.col("ok").fill_null(False) & ~timeout
        outcome = pl.lit(0.0)
    limited = pl.col("stop_condition").is_in(LIMITS).fill_null(False) | timeout
    traces = traces.filter(assigned).select("trace_id", outcome=outcome, limited=limited)
    if traces.height == 0:
        return None
    fields = {"r": reward_field, "v": value_field, "b": bootstrap_field}
    params: dict[str, object] = {}
    reads = "".join(
        f", {node_field(name, NODE_COLUMNS, f'{key}_field', params)} AS {key}" for key, name in fields.items() if name
    )
    nodes = db.sql(
        f"SELECT n.trace_id, n.node_index, n.n_sampled, n.semantic_parents{reads} FROM nodes n", params or None
    )
    if not node_ordered(nodes):
        nodes = nodes.take(pc.sort_indices(nodes, [("trace_id", "ascending"), ("node_index", "ascending")]))
    branches = db.sql("SELECT trace_id, branch_index, trainable, leaf, path FROM branches")
    # The assigned traces' branches, by trace id then branch index.
    of = pc.index_in(branches.column("trace_id"), value_set=traces["trace_id"].to_arrow().cast(pa.string()))
    branches = branches.append_column("t", of).filter(pc.is_valid(of))
    branches = branches.take(pc.sort_indices(branches, [("trace_id", "ascending"), ("branch_index", "ascending")]))
    if branches.num_rows == 0:
        return None
    t = branches.column("t").to_numpy().astype(np.int64)
    # Node rows are (trace, node) ordered and a trace's nodes are 0..n-1 (ingest writes
    # every node; nothing deletes one), so a trace's node i sits at its first row + i.
    node_tid = nodes.column("trace_id").combine_chunks()
    codes = pc.dictionary_encode(node_tid).indices.to_numpy()
    starts = np.flatnonzero(np.concatenate([[True], codes[1:] != codes[:-1]]))
    at = pc.index_in(branches.column("trace_id"), value_set=node_tid.take(pa.array(starts, pa.int64())))
    first = starts[at.to_numpy().astype(np.int64)]
    path = branches.column("path").combine_chunks()
    path_off = path.offsets.to_numpy().astype(np.int64)
    sizes = np.diff(path_off)
    entry_row = path.values.to_numpy().astype(np.int64)[path_off[0] : path_off[-1]] + np.repeat(first, sizes)
    entry_branch = np.repeat(np.arange(branches.num_rows), sizes)
    n_sampled = nodes.column("n_sampled").to_numpy().astype(np.int64)
    turn = n_sampled[entry_row] > 0
    row, branch = entry_row[turn], entry_branch[turn]
    if not len(row):
        return None
    trainable = branches.column("trainable").to_numpy(zero_copy_only=False).astype(bool)
    owner = owning_branch(row, branch, trainable, len(n_sampled))[row] == branch
    truncated = (
        traces["limited"].to_numpy()[t]
        | ~trainable
        | _attempts(nodes.column("semantic_parents"))[first + branches.column("leaf").to_numpy().astype(np.int64)]
    )
    read = {key: nodes.column(key).to_numpy()[row] if name else np.zeros(len(row)) for key, name in fields.items()}
    r, v = read["r"].astype(np.float64), read["v"].astype(np.float64)
    b = read["b"] if bootstrap_field else v
    node = nodes.column("node_index").to_numpy()[row]
    tid = branches.column("trace_id").combine_chunks().take(pa.array(branch, pa.int64()))
    last = np.append(branch[1:] != branch[:-1], True)
    # A node's row from the branch that owns it is the one kept, by trace id (the branches'
    # order; node rows follow the ingest order) then node index.
    keep = np.flatnonzero(owner)
    keep = keep[np.lexsort((node[keep], t[branch[keep]]))]

    r[last] += traces["outcome"].to_numpy()[t[branch[last]]]
    boot = np.where(truncated[branch[last]], b[last], 0.0)
    bad = ~(np.isfinite(r) & np.isfinite(v) & np.isfinite(b))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"trace {tid[i]}, node {node[i]}: reward, value or bootstrap is NaN or infinite")
    # Index of each turn's branch end: the turns are grouped by branch, the last flags close them.
    last_idx = np.flatnonzero(last)
    end = last_idx[np.concatenate([[0], np.cumsum(last[:-1])])]
    return {
        "r": r,
        "v": v,
        "boot": boot,
        "last": last,
        "end": end,
        "keep": keep,  # one row per node, by trace id then node index
        "n_sampled": n_sampled[row],
        "trace_id": tid,
        "node_index": node,
    }


def _attempts(links: pa.ChunkedArray) -> np.ndarray:
    """Per node row: whether its semantic links hold a ``compaction_attempt``."""
    links = links.combine_chunks()
    out = np.zeros(len(links), bool)
    if len(links) and links.null_count < len(links):
        hit = pc.fill_null(pc.equal(pc.list_flatten(links).field("type"), "compaction_attempt"), False)
        out[pc.list_parent_indices(links).to_numpy()[hit.to_numpy(zero_copy_only=False)]] = True
    return out


def node_scalars(turns: dict, advantage: np.ndarray) -> pa.Table:
    """The credit :func:`node_values` gives, as one ``value`` per node
    (:data:`~tracedb.credit.layouts.NODE_VALUE`), in the same order."""
    keep = turns["keep"]
    return pa.Table.from_arrays(
        [
            turns["trace_id"].take(pa.array(keep)).cast(pa.string()),
            pa.array(turns["node_index"][keep].astype(np.int32)),
            pa.array(advantage[keep].astype(np.float32).astype(np.float64)),
        ],
        schema=NODE_VALUE,
    )


def node_values(turns: dict, advantage: np.ndarray) -> pa.Table:
    """Credit per node from ``advantage`` (one float per entry of :func:`branch_turns`): each
    node's entry from its first trainable branch, broadcast over its sampled tokens, ordered
    by trace id then node index."""
    keep = turns["keep"]
    counts = turns["n_sampled"][keep]
    offsets = np.zeros(len(keep) + 1, np.int64)
    np.cumsum(counts, out=offsets[1:])
    if offsets[-1] >= 2**31:
        raise ValueError("more than 2**31 sampled tokens in one credit table: run on fewer traces")
    flat = np.repeat(advantage[keep].astype(np.float32), counts)
    values = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), pa.array(flat, pa.float32()))
    trace_id = turns["trace_id"].take(pa.array(keep)).cast(pa.string())
    node_index = pa.array(turns["node_index"][keep].astype(np.int32))
    return pa.Table.from_arrays([trace_id, node_index, values], schema=NODE_CREDIT)
