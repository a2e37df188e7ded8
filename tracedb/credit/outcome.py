"""Outcome-level credit: one advantage per trace from its group's rewards (GRPO, RLOO)."""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl
import pyarrow as pa

from tracedb import tables
from tracedb.handle import HandleOf, handle_of
from tracedb.sqltext import quote_identifier


def trace_rewards(
    db: HandleOf,
    *,
    reward: str | None = None,
    group_by: str = "group_id",
    include_failed: bool = False,
    columns: Sequence[str] = (),
    include_dropped: bool = False,
    include_eval: bool = False,
) -> pl.DataFrame:
    """One row per trace, by trace id: ``trace_id``, ``group``, ``reward``, ``valid``, and
    the ``traces`` columns named in ``columns``.

    ``reward`` None takes the weighted sum of the trace's scored rewards, a name takes
    that reward's score. ``group_by`` names a ``traces`` column (default the episode's
    group id) or a JSON path into the trace record (``$.task.data.idx``). A trace is
    invalid (left unassigned, out of every mean) when it has no reward, or, unless
    ``include_failed``, when it is not ok or timed out, or, unless ``include_dropped``,
    when it was dropped (verifiers' ``Trace.dropped``: out of reward means, like a failed
    rollout), or, unless ``include_eval``, when its episode is eval work.
    """
    handle = handle_of(db)
    known = set(tables.TRACES.names)  # the stored layout (an open file always has it)
    reward_params: list = []
    group_params: list = []
    if reward is None:
        reward_sql = "t.reward"
    else:
        reward_sql = (
            "TRY_CAST(json_extract_string(t.record, '$.rewards.' || to_json(?::VARCHAR) || '.score') AS DOUBLE)"
        )
        reward_params = [reward]
    if group_by.startswith("$"):
        group_sql = "json_extract_string(t.record, ?)"
        group_params = [group_by]
    else:
        if group_by not in known:
            raise ValueError(f"cannot group by {group_by!r}: not a traces column ({sorted(known)}) nor a $.json.path")
        group_sql = f"t.{quote_identifier(group_by)}::VARCHAR"
    unknown = [c for c in columns if c not in known]
    if unknown:
        raise ValueError(f"columns {unknown}: not traces columns ({sorted(known)})")
    extra = "".join(f", t.{quote_identifier(c)}" for c in columns)
    failed = "" if include_failed else " AND coalesce(t.ok, false) AND NOT coalesce(t.is_timeout, false)"
    held = set(handle.sql("SELECT * FROM traces LIMIT 0").column_names)  # a lake's rows may predate the columns
    if not include_dropped and "dropped" in held:
        failed += " AND t.dropped IS NULL"
    if not include_eval and "work_type" in held:
        failed += " AND t.work_type IS DISTINCT FROM 'eval'"
    # Sorted here rather than in SQL: an ORDER BY costs DuckDB more than the whole scan.
    table = handle.sql(
        f'SELECT t.trace_id, {group_sql} AS "group", {reward_sql} AS reward, '
        f"({reward_sql} IS NOT NULL{failed}) AS valid{extra} FROM traces t",
        group_params + reward_params + reward_params,
    )
    return pl.from_arrow(table).sort("trace_id")


def _baseline_table(df: pl.DataFrame, advantage: pl.Expr) -> pa.Table:
    valid = df.filter(pl.col("valid"))
    # A trace without a group is its own group.
    valid = valid.with_columns(pl.coalesce(pl.col("group"), pl.lit("trace:") + pl.col("trace_id")).alias("group"))
    # Equal rewards carry no gradient: exactly zero, not the rounding residue of r - mean.
    flat = pl.col("reward").min().over("group") == pl.col("reward").max().over("group")
    advantage = pl.when(flat).then(pl.lit(0.0)).otherwise(advantage)
    out = valid.with_columns(advantage.alias("value")).select("trace_id", "value")
    return out.to_arrow()


def grpo(
    db: HandleOf,
    *,
    reward: str | None = None,
    group_by: str = "group_id",
    scale_std: bool = False,
    eps: float = 1e-6,
    include_failed: bool = False,
    include_dropped: bool = False,
    include_eval: bool = False,
) -> pa.Table:
    """GRPO: A = r - mean(r over the group's valid members), optionally / (std + eps).

    Off by default, as in Dr. GRPO; the std is the sample standard deviation (a group of
    one has none and gets 0). Equal rewards give zeros, not None. Excluded rollouts
    (failed, timed out, unscored, dropped, eval work: see :func:`trace_rewards`) stay
    unassigned and do not enter the mean.
    """
    handle = handle_of(db)
    df = trace_rewards(
        handle,
        reward=reward,
        group_by=group_by,
        include_failed=include_failed,
        include_dropped=include_dropped,
        include_eval=include_eval,
    )
    centered = pl.col("reward") - pl.col("reward").mean().over("group")
    if scale_std:
        std = pl.col("reward").std(ddof=1).over("group").fill_null(0.0).fill_nan(0.0)
        centered = centered / (std + eps)
    return _baseline_table(df, centered)


def rloo(
    db: HandleOf,
    *,
    reward: str | None = None,
    group_by: str = "group_id",
    include_failed: bool = False,
    include_dropped: bool = False,
    include_eval: bool = False,
) -> pa.Table:
    """RLOO: A = r - mean of the other valid members' rewards; a group of one gets 0."""
    handle = handle_of(db)
    df = trace_rewards(
        handle,
        reward=reward,
        group_by=group_by,
        include_failed=include_failed,
        include_dropped=include_dropped,
        include_eval=include_eval,
    )
    n = pl.len().over("group")
    others = (pl.col("reward").sum().over("group") - pl.col("reward")) / (n - 1)
    advantage = pl.when(n > 1).then(pl.col("reward") - others).otherwise(0.0)
    return _baseline_table(df, advantage)
