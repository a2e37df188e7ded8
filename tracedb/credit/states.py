"""State keys and the state-keyed turn table of ``anchor`` (GiGPO, TIGPO) and ``potential`` (PGPO).

**Turns** are those of :mod:`tracedb.credit.returns`: the nodes with sampled tokens on each
branch's path, in path order, one value per node from its first trainable branch. A turn's
return is ``G_t = sum_{j>=t} gamma^(j-t) r_j`` along that branch, ``r_j`` the node field
``reward_field`` (None: 0.0) plus the trace's outcome reward R on the branch's last turn.

**State key.** A turn acted on a state; two turns share a key when they acted on the same one:

- the node field ``key_field`` (default ``state_key``) of the turn's node, when it has one: a
  ``nodes`` column of that name, else a key of the node's record kept in ``nodes.extra``,
  compared as its JSON text (``1`` and ``"1"`` differ; a JSON null counts as absent);
- else the exact history the turn acted on: the content addresses (``segment_id``) of every
  node on its path above it, root first (the turn's own node, its scaffold and completion,
  is the action, not the state). Lists are compared whole, so two turns that read the same
  tool output after different earlier turns get different keys; the last observation alone
  never decides.

Keys are global: the same prompt in two groups is one key. The algorithms compare keys
within a group (and, with TIGPO's history, with the same task's earlier groups).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa

from tracedb.credit.outcome import trace_rewards
from tracedb.credit.returns import branch_turns, check_unit, field_exists, node_values, reverse_scan
from tracedb.handle import Handle
from tracedb.sqltext import quote_identifier

DEFAULT_KEY_FIELD = "state_key"
"""The node field a harness writes a state key into; where no node has it, every turn is
keyed by its history."""

_TRACES = "_tdb_state_traces"


@dataclass(frozen=True)
class StateTurns:
    """The branch/turn table (:func:`~tracedb.credit.returns.branch_turns`) with returns and
    state keys."""

    turns: dict[str, Any]
    """The table itself: one entry per (branch, turn)."""
    key: np.ndarray
    """The state key of each entry (dense int64 ids, equal for equal states)."""
    nodes: pl.DataFrame
    """One row per turn node (its entry from the owning branch): ``entry``, ``trace_id``,
    ``group``, ``key``, ``G`` (the return), ``R`` (the trace's outcome reward)."""
    traces: pl.DataFrame
    """The valid traces: ``trace_id``, ``group`` (a trace without one is its own), ``R``."""

    def credit(self, nodes: pl.DataFrame) -> pa.Table:
        """The node credit table of ``nodes`` (rows of :attr:`nodes` with an advantage ``A``):
        each turn node's ``A`` broadcast over its sampled tokens."""
        advantage = np.zeros(len(self.key))
        advantage[nodes.get_column("entry").to_numpy()] = nodes.get_column("A").to_numpy()
        return node_values(self.turns, advantage)


def check_finite(name: str, x: Any, *, minimum: float | None = None) -> float:
    """``x`` as a float; ValueError naming parameter ``name`` when it is not a finite number
    (or is below ``minimum``)."""
    if isinstance(x, bool) or not isinstance(x, int | float) or not math.isfinite(x):
        raise ValueError(f"{name} must be a finite number, got {x!r}")
    if minimum is not None and x < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {x!r}")
    return float(x)


def key_sql(db: Handle, key_field: str | None) -> tuple[str, list[Any]]:
    """SQL reading the state key field of ``n`` (a nodes row) as VARCHAR (NULL when absent),
    and its parameters. ``key_field`` None reads nothing (every key is a history). A name
    that is not a nodes column, that no node's record holds and that is not the default
    :data:`DEFAULT_KEY_FIELD` is refused (ValueError naming ``key_field``)."""
    if key_field is None:
        return "NULL::VARCHAR", []
    if not isinstance(key_field, str) or not key_field:
        raise ValueError(f"key_field must be a node field name or None, got {key_field!r}")
    columns = db.columns("nodes")
    if key_field in columns:
        return f"n.{quote_identifier(key_field)}::VARCHAR", []
    if key_field != DEFAULT_KEY_FIELD and not field_exists(db, key_field):
        raise ValueError(
            f"key_field {key_field!r}: no node has that field (neither a nodes column, {columns}, "
            "nor a key of any node's record)"
        )
    value = "json_extract(n.extra, '$.' || to_json(?::VARCHAR))"
    return f"CASE WHEN json_type({value}) = 'NULL' THEN NULL ELSE {value}::VARCHAR END", [key_field, key_field]


def state_turns(
    db: Handle,
    *,
    gamma: float,
    key_field: str | None,
    group_by: str,
    reward: str | None,
    reward_field: str | None,
    include_failed: bool,
) -> StateTurns | None:
    """The turns of the valid traces with their returns, groups and state keys (None when
    there is no turn). Checks ``gamma``, ``key_field`` and ``reward_field`` (a name no node
    has is refused, not read as 0.0)."""
    check_unit("gamma", gamma)
    field, params = key_sql(db, key_field)
    if reward_field is not None and not field_exists(db, reward_field):
        raise ValueError(f"reward_field {reward_field!r}: no node has that field (a nodes column or record key)")
    rewards = trace_rewards(db, reward=reward, group_by=group_by, include_failed=include_failed)
    traces = rewards.filter(pl.col("valid")).select(
        "trace_id",
        group=pl.coalesce(pl.col("group"), pl.lit("trace:") + pl.col("trace_id")),
        R=pl.col("reward").cast(pl.Float64),
    )
    turns = branch_turns(db, reward, reward_field, None, None, True, include_failed)
    if turns is None:
        return None
    with db.registered(_TRACES, traces.select("trace_id").to_arrow()):
        keys = pl.from_arrow(db.sql(_KEYS.format(traces=_TRACES, field=field), params))
    entries = pl.DataFrame(
        {"trace_id": pl.Series(turns["trace_id"]).cast(pl.String), "node_index": turns["node_index"]}
    ).with_row_index("entry")
    entries = entries.join(keys, on=["trace_id", "node_index"], how="left").sort("entry")
    key = entries.get_column("key").to_numpy()
    # No bootstrap (no value field): G is the discounted sum of the branch's rewards.
    ret = reverse_scan(turns["r"], turns["end"], gamma)
    keep = turns["keep"]
    nodes = pl.DataFrame(
        {
            "entry": keep,
            "trace_id": entries.get_column("trace_id").gather(keep),
            "key": key[keep],
            "G": ret[keep],
        }
    ).join(traces, on="trace_id", how="left")
    return StateTurns(turns=turns, key=key, nodes=nodes, traces=traces)


def standardized(x: pl.Expr, mean: pl.Expr, std: pl.Expr, flat: pl.Expr, scale_std: bool, eps: float) -> pl.Expr:
    """``x - mean`` (``/ (std + eps)`` with ``scale_std``), exactly 0 where ``flat`` (fewer
    than two members or all equal: no gradient, as grpo zeroes a flat group)."""
    centered = x - mean
    if scale_std:
        centered = centered / (std.fill_null(0.0).fill_nan(0.0) + eps)
    return pl.when(flat).then(pl.lit(0.0)).otherwise(centered)


# One row per turn node of the traces in {traces}: its key. A node's history is the same on
# every branch through it (its ancestors), so any one of its branches serves (the first).
_KEYS = """
WITH entry AS (
    SELECT b.trace_id, b.branch_index, unnest(b.path) AS node_index, generate_subscripts(b.path, 1) AS pos
    FROM branches b JOIN {traces} USING (trace_id)
), node AS (
    SELECT e.trace_id, e.branch_index, e.node_index, e.pos, n.segment_id, n.n_sampled, {field} AS field
    FROM entry e JOIN nodes n USING (trace_id, node_index)
), branch AS (
    SELECT trace_id, branch_index, list(segment_id ORDER BY pos) AS segments FROM node GROUP BY ALL
), turn AS (
    SELECT trace_id, node_index, min(branch_index) AS branch_index, arg_min(pos, branch_index) AS pos,
           any_value(field) AS field
    FROM node WHERE n_sampled > 0 GROUP BY ALL
)
SELECT t.trace_id, t.node_index,
       dense_rank() OVER (
           ORDER BY t.field NULLS LAST, CASE WHEN t.field IS NULL THEN list_slice(b.segments, 1, t.pos - 1) END
       ) AS key
FROM turn t JOIN branch b USING (trace_id, branch_index)
"""
