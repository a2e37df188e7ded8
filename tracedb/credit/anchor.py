"""Anchor-state grouping (GiGPO; TIGPO's history): an episode advantage plus a step advantage
among the group's turns that acted on the same state.

For a turn t of trace i in group g (turns, returns ``G_t`` and state keys as in
:mod:`tracedb.credit.states`)::

    A^E_i = (R_i - mean_g R) [/ (std_g R + eps)]
    A^S_t = (G_t - mean_K G) [/ (std_K G + eps)]    K: the group's turns with t's state key
    A_t   = A^E_i + omega * A^S_t

``scale_std`` governs both brackets; stds are sample stds (ddof 1); a term over fewer than
two members, or over equal values, is exactly 0 (a singleton K gives ``A^S = 0``).
``episode_stats="trace"`` takes the episode statistics over one value per valid trace (as
grpo), ``"turn"`` over the group's turn rows (each carrying its trace's R, as the reference
GiGPO code does, so longer episodes weigh more).

**History (TIGPO).** ``history=H`` adds to K the turns (same state key) of the last H
earlier groups of the same task: ``task_key`` names the task (a ``$.json.path`` into the
trace record or a ``traces`` column) and ``order_by`` the order (an ingest tag, as in
``trace_tags``, else a ``traces`` column, e.g. the policy step). A group's task is its valid
traces' (a group holding two is refused), its position their least ``order_by`` value;
earlier means a strictly smaller position, and ties among earlier groups go to the group id.
A group without a task or a position takes no history and gives none. History only widens
the step statistics: the earlier groups' turns receive nothing from it and the episode
statistics never see them.

Excluded traces (failed, timed out, unscored) stay unassigned and enter no statistic.
"""

from __future__ import annotations

import warnings

import duckdb
import polars as pl
import pyarrow as pa

from tracedb.credit.layouts import NODE_CREDIT
from tracedb.credit.states import DEFAULT_KEY_FIELD, check_finite, standardized, state_turns
from tracedb.errors import CreditWarning
from tracedb.handle import Handle, HandleOf, handle_of
from tracedb.sqltext import quote_identifier

EPISODE_STATS = ("trace", "turn")


def anchor(
    db: HandleOf,
    *,
    gamma: float = 1.0,
    omega: float = 1.0,
    scale_std: bool = False,
    eps: float = 1e-6,
    key_field: str | None = DEFAULT_KEY_FIELD,
    group_by: str = "group_id",
    episode_stats: str = "trace",
    history: int = 0,
    task_key: str | None = None,
    order_by: str | None = None,
    reward: str | None = None,
    reward_field: str | None = None,
    include_failed: bool = False,
) -> pa.Table:
    """GiGPO credit per turn node: ``trace_id, node_index, values`` (the node's
    ``A^E + omega A^S`` on each sampled token); see the module docstring.

    ``gamma`` in [0, 1] discounts the returns; ``key_field`` names the state key's node
    field (None: histories only); ``reward``, ``group_by`` and ``include_failed`` select
    rewards, groups and valid traces as in :func:`tracedb.credit.outcome.grpo`;
    ``reward_field`` names a per-turn reward node field. ``history`` (>= 0, TIGPO) needs
    ``task_key`` and ``order_by``.
    """
    handle = handle_of(db)
    omega = check_finite("omega", omega)
    eps = check_finite("eps", eps, minimum=0.0)
    if episode_stats not in EPISODE_STATS:
        raise ValueError(f"episode_stats must be one of {list(EPISODE_STATS)}, got {episode_stats!r}")
    if isinstance(history, bool) or not isinstance(history, int) or history < 0:
        raise ValueError(f"history must be a whole number >= 0 (earlier groups), got {history!r}")
    if history and (task_key is None or order_by is None):
        raise ValueError("history > 0 needs task_key (which task) and order_by (which groups came earlier)")
    meta = _task_order(handle, task_key, order_by) if task_key is not None or order_by is not None else None
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
    nodes = st.nodes

    # Episode advantage, over traces or over turn rows.
    stats = st.traces if episode_stats == "trace" else nodes
    r, by = pl.col("R"), "group"
    flat = r.min().over(by) == r.max().over(by)
    episode = stats.select(
        "trace_id", AE=standardized(r, r.mean().over(by), r.std(ddof=1).over(by), flat, scale_std, eps)
    ).unique("trace_id")
    nodes = nodes.join(episode, on="trace_id", how="left")

    # Step advantage over K: this group's turns of the key, plus the history's.
    pooled = nodes.select("group", "key", "G")
    if history:
        pairs = _history_pairs(st.traces, meta, history)
        earlier = nodes.select(source="group", key="key", G="G").join(pairs, on="source")
        pooled = pl.concat([pooled, earlier.select("group", "key", "G")])
    k = pooled.group_by("group", "key").agg(
        n=pl.len(), mean=pl.col("G").mean(), std=pl.col("G").std(ddof=1), lo=pl.col("G").min(), hi=pl.col("G").max()
    )
    nodes = nodes.join(k, on=["group", "key"], how="left")
    flat = (pl.col("n") < 2) | (pl.col("lo") == pl.col("hi"))
    if nodes.height and nodes.select(flat.all()).item():
        shared = nodes.select((pl.col("n") >= 2).any()).item()
        same = "grpo's with the same reward, group_by and scale_std" if episode_stats == "trace" else "A^E alone"
        warnings.warn(
            CreditWarning(
                "anchor: the step term is 0 on every turn ("
                + (
                    "the turns of a group that share a state have equal returns"
                    if shared
                    else "no state is shared by two turns of a group"
                )
                + f"), so the credit is the episode advantage: {same}; check key_field ({key_field!r})"
            ),
            stacklevel=2,
        )
    step = standardized(pl.col("G"), pl.col("mean"), pl.col("std"), flat, scale_std, eps)
    nodes = nodes.with_columns(A=pl.col("AE") + omega * step)

    return st.credit(nodes)


def _task_order(db: Handle, task_key: str | None, order_by: str | None) -> pl.DataFrame:
    """Per trace: ``trace_id``, ``task`` (VARCHAR) and ``order`` (a number, text or column
    value), null where the trace has none. Unknown names are refused (ValueError naming
    the parameter)."""
    columns = db.columns("traces")
    params: list = []
    if task_key is None:
        task = "NULL::VARCHAR"
    elif not isinstance(task_key, str):
        raise ValueError(f"task_key must be a $.json.path or a traces column, got {task_key!r}")
    elif task_key.startswith("$"):
        task = "json_extract_string(t.record, ?)"
        params.append(task_key)
    elif task_key in columns:
        task = f"t.{quote_identifier(task_key)}::VARCHAR"
    else:
        raise ValueError(f"task_key {task_key!r}: neither a $.json.path nor a traces column ({columns})")
    try:
        out = pl.from_arrow(db.sql(f"SELECT t.trace_id, {task} AS task FROM traces t", params))
    except duckdb.Error as e:
        raise ValueError(f"task_key {task_key!r}: not a JSON path DuckDB reads ({e})") from None
    if task_key is not None and task_key.startswith("$") and out.get_column("task").null_count() == out.height:
        raise ValueError(f"task_key {task_key!r}: no trace record has that path")
    if order_by is None:
        return out.with_columns(order=pl.lit(None))
    if not isinstance(order_by, str):
        raise ValueError(f"order_by must be an ingest tag or a traces column, got {order_by!r}")
    tags = db.sql("SELECT trace_id, number, text FROM trace_tags WHERE name = ?", [order_by])
    if tags.num_rows:
        tags = pl.from_arrow(tags)
        numbers, texts = tags.get_column("number").null_count(), tags.get_column("text").null_count()
        if numbers == 0:
            order = tags.select("trace_id", order="number")
        elif texts == 0:
            order = tags.select("trace_id", order="text")
        else:
            raise ValueError(f"order_by {order_by!r}: the tag's values are not all numbers or all strings")
    elif order_by in columns:
        order = pl.from_arrow(db.sql(f'SELECT trace_id, {quote_identifier(order_by)} AS "order" FROM traces'))
    else:
        raise ValueError(f"order_by {order_by!r}: neither an ingest tag (trace_tags) nor a traces column ({columns})")
    return out.join(order, on="trace_id", how="left")


def _history_pairs(traces: pl.DataFrame, meta: pl.DataFrame, k: int) -> pl.DataFrame:
    """``(group, source)``: each group and the last ``k`` earlier groups of its task."""
    groups = (
        traces.join(meta, on="trace_id", how="left")
        .group_by("group")
        .agg(tasks=pl.col("task").drop_nulls().unique(), order=pl.col("order").min())
    )
    mixed = groups.filter(pl.col("tasks").list.len() > 1)
    if mixed.height:
        row = mixed.sort("group").row(0, named=True)
        raise ValueError(f"task_key: group {row['group']!r} holds traces of several tasks {sorted(row['tasks'])}")
    groups = (
        groups.with_columns(task=pl.col("tasks").list.first())
        .drop_nulls(["task", "order"])
        .sort("task", "order", "group")
        .with_columns(
            pos=pl.int_range(pl.len(), dtype=pl.Int64).over("task"),
            before=pl.col("order").rank("min").over("task").cast(pl.Int64) - 1,
        )
    )
    start = pl.max_horizontal(pl.col("before") - k, pl.lit(0, pl.Int64))
    pairs = groups.select("task", "group", pos=pl.int_ranges(start, pl.col("before"))).explode("pos").drop_nulls("pos")
    return pairs.join(groups.select("task", "pos", source="group"), on=["task", "pos"]).select("group", "source")
