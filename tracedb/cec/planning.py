"""CEC over the database: the plan (blocks, selection, utilities, coefficients per
trace), the queries a harness runs, and the four stamped arms (see :mod:`tracedb.cec`;
the identity check and the availability report are :mod:`tracedb.cec.audit`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import polars as pl
import pyarrow as pa

from tracedb import tables, writeback
from tracedb.cec.records import ensure_installed
from tracedb.cec.rules import (
    ARMS,
    CREDIT_SETS,
    DEFAULT_CAP,
    DEFAULT_LAM,
    CecError,
    Turn,
    Utility,
    coefficients,
    contrast,
    edit_blocks,
    edit_focus,
    select_block,
    utility_parts,
)
from tracedb.credit.outcome import trace_rewards
from tracedb.handle import Handle, HandleOf, handle_of


def _advantages(
    db: Handle, reward: str | None, group_by: str, include_failed: bool
) -> dict[str, tuple[str | None, float | None, bool, float]]:
    """trace_id -> (group, reward, valid, A) with A = r - mean(valid members' r) and
    0 for an excluded member; a group whose valid rewards are all equal gets exact zeros."""
    df = trace_rewards(db, reward=reward, group_by=group_by, include_failed=include_failed)
    df = df.with_columns(pl.coalesce(pl.col("group"), pl.lit("trace:") + pl.col("trace_id")).alias("group"))
    valid_r = pl.col("reward").filter(pl.col("valid"))
    df = df.with_columns(
        pl.when(~pl.col("valid"))
        .then(0.0)
        .when(valid_r.min().over("group") == valid_r.max().over("group"))
        .then(0.0)
        .otherwise(pl.col("reward") - valid_r.mean().over("group"))
        .alias("advantage")
    )
    return {
        t: (g, r, bool(v), float(a))
        for t, g, r, v, a in df.select("trace_id", "group", "reward", "valid", "advantage").iter_rows()
    }


@dataclass
class _Verification:
    status: str
    resolved: bool | None
    f2p: dict[str, str | None] | None
    p2p: dict[str, str | None] | None

    @property
    def parts(self) -> Utility | None:
        return None if self.status != "ok" else utility_parts(self.resolved, self.f2p, self.p2p)


def _plan_inputs(db: Handle) -> dict[str, Any]:
    """Everything the plan reads, keyed by trace."""
    traces = {
        t: (int(n or 0), calls)
        for t, n, calls in db.con.execute(
            "SELECT trace_id, n_sampled, json_extract(record, '$.calls') FROM traces"
        ).fetchall()
    }
    spans: dict[str, dict[int, tuple[int, int, bool]]] = {}
    for t, n, n_sampled, n_logprobs, trainable in db.con.execute(
        "SELECT n.trace_id, n.node_index, n.n_sampled, coalesce(len(n.logprobs), 0), tb.node_index IS NOT NULL "
        "FROM nodes n LEFT JOIN (SELECT DISTINCT trace_id, unnest(path) AS node_index FROM branches "
        "  WHERE trainable) tb USING (trace_id, node_index) "
        "WHERE n.role = 'assistant' AND n.sampled"
    ).fetchall():
        spans.setdefault(t, {})[n] = (int(n_sampled), int(n_logprobs), bool(trainable))
    records = {
        t: (baseline, instance, rep, salt)
        for t, baseline, instance, rep, salt in db.con.execute(
            "SELECT trace_id, baseline_tree, instance_id, rep, cache_salt FROM cec_traces"
        ).fetchall()
    }
    turns: dict[str, list[Turn]] = {}
    for t, node, tree, paths, fmt in db.con.execute(
        "SELECT trace_id, node_index, tree, changed_paths, format_error FROM cec_turns ORDER BY trace_id, node_index"
    ).fetchall():
        turns.setdefault(t, []).append(Turn(node, tree, tuple(paths), fmt))
    verifications = {}
    for t, role, record in db.con.execute("SELECT trace_id, role, record FROM cec_verifications").fetchall():
        r = json.loads(record)
        verifications[(t, role)] = _Verification(r["status"], r.get("resolved"), r.get("f2p"), r.get("p2p"))
    return {"traces": traces, "spans": spans, "records": records, "turns": turns, "verifications": verifications}


def _clipped_nodes(calls_json: str | None) -> set[int]:
    """Nodes committed by a model call that stopped at the length limit (a clipped span)."""
    if not calls_json:
        return set()
    calls = json.loads(calls_json)
    if not isinstance(calls, list):
        return set()
    return {
        c["node"]
        for c in calls
        if isinstance(c, dict) and type(c.get("node")) is int and c.get("finish_reason") == "length"
    }


def _span_problem(node: int, span: tuple[int, int, bool] | None, clipped: set[int]) -> str | None:
    """Why node's generated span cannot receive credit, or None when present and complete."""
    if span is None:
        return f"node {node} is not a sampled assistant node of the trace"
    n_sampled, n_logprobs, trainable = span
    if n_sampled == 0:
        return f"node {node} has no sampled tokens (masked)"
    if n_logprobs and n_logprobs != n_sampled:
        return f"node {node} has {n_logprobs} logprobs for {n_sampled} sampled tokens (misaligned)"
    if not trainable:
        return f"node {node} is on no trainable branch"
    if node in clipped:
        return f"node {node} was cut at the length limit (clipped)"
    return None


def _snapshot_problem(turns: list[Turn], baseline: str) -> str | None:
    previous = baseline
    for turn in turns:
        if bool(turn.changed_paths) == (turn.tree == previous):
            what = "changed paths but the same tree" if turn.changed_paths else "a new tree but no changed paths"
            return f"node {turn.node}: {what} as the previous snapshot"
        previous = turn.tree
    return None


def _plan_trace(trace_id: str, data: dict[str, Any], adv: tuple, lam: float, cap: float) -> dict[str, Any]:
    group, reward, valid, advantage = adv
    L, calls = data["traces"][trace_id]
    spans = data["spans"].get(trace_id, {})
    record = data["records"].get(trace_id)
    turns = data["turns"].get(trace_id, [])
    row: dict[str, Any] = {
        "trace_id": trace_id,
        "group_key": group,
        "reward": reward,
        "valid": valid,
        "advantage": advantage,
        "format_error": any(t.format_error for t in turns),
        "n_turns": len(turns),
        "blocks": None,
        "eligible": None,
        "selected": None,
        "selection": "selected",
        "selection_detail": None,
        "selected_nodes": None,
        "touched_paths": None,
        "baseline_tree": record[0] if record else None,
        "pre_block_tree": None,
        "final_tree": turns[-1].tree if turns else None,
        "generated_tokens": L,
        "edit_tokens": None,
        "lam": lam,
        "cap": cap,
    }
    # ---- structural selection (never looks at a verdict)
    missing = sorted(set(spans) - {t.node for t in turns})
    if record is None:
        row["selection"] = "no_trace_record"
    elif not turns:
        row["selection"] = "no_snapshots"
    elif missing:
        row["selection"] = "missing_snapshots"
        row["selection_detail"] = f"sampled assistant nodes without a turn record: {missing[:10]}"
    elif (problem := _snapshot_problem(turns, record[0])) is not None:
        row["selection"] = "inconsistent_snapshots"
        row["selection_detail"] = problem
    else:
        blocks = edit_blocks(turns, record[0])
        eligible = [b.index for b in blocks if b.eligible]
        row["blocks"] = json.dumps([b.to_dict() for b in blocks])
        row["eligible"] = eligible
        chosen = select_block(record[1], record[2], record[3], eligible)
        if chosen is None:
            row["selection"] = "no_eligible_block"
        else:
            block = blocks[chosen]
            row.update(
                selected=chosen,
                selected_nodes=list(block.nodes),
                touched_paths=list(block.paths),
                pre_block_tree=block.pre_tree,
                edit_tokens=sum(spans[n][0] for n in block.nodes if n in spans),
            )
            clipped = _clipped_nodes(calls)
            problems = [p for n in block.nodes if (p := _span_problem(n, spans.get(n), clipped)) is not None]
            if problems:
                row["selection"] = "incomplete_span"
                row["selection_detail"] = "; ".join(problems)
    selected = row["selection"] == "selected"
    m = row["edit_tokens"]

    # ---- utilities and the contrast
    original = data["verifications"].get((trace_id, "original"))
    intervention = data["verifications"].get((trace_id, "intervention"))
    u_orig = original.parts if original is not None else None
    u_int = intervention.parts if intervention is not None else None
    for suffix, parts in (("orig", u_orig), ("int", u_int)):
        row[f"y_{suffix}"] = None if parts is None else float(parts.y)
        row[f"f_{suffix}"] = None if parts is None else float(parts.f)
        row[f"g_{suffix}"] = None if parts is None else float(parts.g)
        row[f"u_{suffix}"] = None if parts is None else parts.value
    if row["format_error"]:
        row["query"] = "format_error"
    elif not selected:
        row["query"] = "no_selection"
    elif u_orig is None:
        row["query"] = "original_unavailable"
    else:
        row["query"] = "planned"
    planned = row["query"] == "planned"
    if not planned:
        row["intervention"] = None if intervention is None else "unplanned"
    elif intervention is None:
        row["intervention"] = "pending"
    elif intervention.status != "ok":
        row["intervention"] = intervention.status
    elif set(intervention.f2p or {}) != set(original.f2p or {}) or set(intervention.p2p or {}) != set(
        original.p2p or {}
    ):
        row["intervention"] = "lists_differ"
    elif u_int is None:  # unreachable with equal non-empty lists; kept for safety
        row["intervention"] = "unavailable"
    else:
        row["intervention"] = "usable"
    usable = row["intervention"] == "usable"
    row.update(d=None, d_y=None, d_f=None, d_g=None, s=None, coef_m=None, coef_b=None, coef_e=None)
    if usable:
        d, d_y, d_f, d_g = contrast(u_orig, u_int)
        s, c_m, c_b = coefficients(d, L, m, lam, cap)
        row.update(d=d, d_y=d_y, d_f=d_f, d_g=d_g, s=s, coef_m=c_m, coef_b=c_b)
    if selected and not row["format_error"]:
        row["coef_e"] = edit_focus(advantage, L, m, lam, cap)
    # What is added: an excluded member (A = 0) gets no auxiliary term either.
    row["credit_m"] = row["coef_m"] if usable and valid else 0.0
    row["credit_b"] = row["coef_b"] if usable and valid else 0.0
    row["credit_e"] = row["coef_e"] if row["coef_e"] is not None and valid else 0.0
    return row


_SELECTION_ROWS = tables.inserted(tables.CEC_SELECTION)


def plan(
    db: HandleOf,
    lam: float = DEFAULT_LAM,
    cap: float = DEFAULT_CAP,
    *,
    reward: str | None = None,
    group_by: str = "group_id",
    include_failed: bool = False,
) -> dict[str, Any]:
    """Compute the plan for every trace of the database into ``cec_selection`` (replaced whole).

    Per trace: its blocks and eligibility, the selected block (or why none), L and m,
    whether a counterfactual query is planned, the utilities, D and its parts, s and
    each arm's coefficient. ``reward``, ``group_by`` and ``include_failed`` define the
    terminal group advantage as for ``grpo`` (validity: scored, ok, not timed out).
    Returns counts by selection, query and intervention status.
    """
    handle = handle_of(db)
    if not (lam > 0 and math.isfinite(lam)) or not (cap > 0 and math.isfinite(cap)):
        raise CecError(f"lam and cap must be positive numbers, got lam={lam}, cap={cap}")
    ensure_installed(handle)
    data = _plan_inputs(handle)
    advantages = _advantages(handle, reward, group_by, include_failed)
    rows = [_plan_trace(t, data, advantages[t], lam, cap) for t in sorted(data["traces"])]
    table = pa.Table.from_pylist(rows, schema=_SELECTION_ROWS)
    columns = ", ".join(_SELECTION_ROWS.names)
    with handle.transaction():
        handle.con.execute("DELETE FROM cec_selection")
        with handle.registered("_tdb_cec_plan", table):
            handle.con.execute(f"INSERT INTO cec_selection ({columns}) SELECT {columns} FROM _tdb_cec_plan")
    return _plan_summary(rows, lam, cap)


def counts(values: Iterable[Any]) -> dict[str, int]:
    """How often each value occurs (None left out), by value."""
    out: dict[str, int] = {}
    for v in values:
        if v is not None:
            out[str(v)] = out.get(str(v), 0) + 1
    return dict(sorted(out.items()))


def _plan_summary(rows: list[dict[str, Any]], lam: float, cap: float) -> dict[str, Any]:
    return {
        "traces": len(rows),
        "lam": lam,
        "cap": cap,
        "selection": counts(r["selection"] for r in rows),
        "query": counts(r["query"] for r in rows),
        "intervention": counts(r["intervention"] for r in rows),
    }


def selection(db: Handle) -> pl.DataFrame:
    """The stored plan, one row per trace (CecError when there is none)."""
    ensure_installed(db)
    df = pl.from_arrow(db.sql("SELECT * FROM cec_selection ORDER BY trace_id"))
    if df.is_empty():
        raise CecError("no CEC plan in this database: run `tracedb cec plan` (or cec.plan / cec.stamp) first")
    return df


def queries(db: HandleOf, *, pending_only: bool = False) -> list[dict[str, Any]]:
    """The planned counterfactual queries: what a harness needs to build each
    intervention (:func:`tracedb.cec.git.intervene`) and verify it."""
    handle = handle_of(db)
    df = selection(handle).filter(pl.col("query") == "planned")
    if pending_only:
        df = df.filter(pl.col("intervention") == "pending")
    records = dict(
        handle.con.execute("SELECT trace_id, instance_id || '|' || rep || '|' || cache_salt FROM cec_traces").fetchall()
    )
    return [
        {
            "trace_id": r["trace_id"],
            "key": records.get(r["trace_id"]),
            "block": r["selected"],
            "nodes": r["selected_nodes"],
            "baseline_tree": r["baseline_tree"],
            "final_tree": r["final_tree"],
            "pre_block_tree": r["pre_block_tree"],
            "touched_paths": r["touched_paths"],
            "intervention": r["intervention"],
        }
        for r in df.iter_rows(named=True)
    ]


# =========================================================================== stamp


def stamp(
    db: HandleOf,
    lam: float = DEFAULT_LAM,
    cap: float = DEFAULT_CAP,
    *,
    reward: str | None = None,
    group_by: str = "group_id",
    include_failed: bool = False,
) -> dict[str, Any]:
    """Plan, then write the four arms as credit sets ``cec-O``, ``cec-B``, ``cec-M``,
    ``cec-E`` (replacing them), all in one transaction.

    On every sampled token of every trace: A + C, where C is 0 for O; ``credit_b`` on
    every sampled token for B; ``credit_m`` / ``credit_e`` on the sampled tokens of the
    selected block's turns (0 elsewhere) for M / E. A trace excluded from its group has
    A = 0 and C = 0: it is stamped with zeros, not left unassigned.
    """
    handle = handle_of(db)
    params = {"lam": lam, "cap": cap, "reward": reward, "group_by": group_by, "include_failed": include_failed}
    with handle.transaction():
        summary = plan(handle, lam, cap, reward=reward, group_by=group_by, include_failed=include_failed)
        df = selection(handle)
        nodes = _sampled_nodes(handle)
        nodes_written = {}
        for arm in ARMS:
            name = CREDIT_SETS[arm]
            nodes_written[name] = writeback.stamp(
                handle,
                name,
                _arm_credit(df, nodes, arm),
                algorithm="cec",
                params={**params, "arm": arm},
                description=_ARM_DESCRIPTIONS[arm],
                replace=True,
            )
    return {**summary, "credit_sets": nodes_written}


def _sampled_nodes(db: Handle) -> pl.DataFrame:
    """(trace_id, node_index) of every node with sampled tokens."""
    return pl.from_arrow(db.sql("SELECT trace_id, node_index FROM nodes WHERE n_sampled > 0"))


def _arm_credit(df: pl.DataFrame, nodes: pl.DataFrame, arm: str) -> pa.Table:
    """One arm's credit per sampled node: A + C^B everywhere for B, A elsewhere; A + C on
    the selected block's nodes for M and E (where that C is not 0)."""
    base = pl.col("credit_b") if arm == "B" else pl.lit(0.0)
    per_trace = df.select("trace_id", (pl.col("advantage") + base).alias("value"))
    credit = nodes.join(per_trace, on="trace_id", how="inner")
    if arm in ("M", "E"):
        column = f"credit_{arm.lower()}"
        block = (
            df.filter(pl.col(column) != 0)
            .select(
                "trace_id",
                pl.col("selected_nodes").alias("node_index"),
                (pl.col("advantage") + pl.col(column)).alias("edit"),
            )
            .explode("node_index")
            .with_columns(pl.col("node_index").cast(pl.Int32))
        )
        credit = credit.join(block, on=["trace_id", "node_index"], how="full", coalesce=True).select(
            "trace_id", "node_index", pl.coalesce("edit", "value").alias("value")
        )
    return (
        credit.sort("trace_id", "node_index")
        .to_arrow()
        .cast(pa.schema([("trace_id", pa.string()), ("node_index", pa.int32()), ("value", pa.float64())]))
    )


_ARM_DESCRIPTIONS = {
    "O": "CEC terminal-only: A = r - mean(valid group members)",
    "B": "CEC broadcast: A + lam*D*s on every sampled token",
    "M": "CEC localized: A + lam*D*s*L/m on the selected block's turns",
    "E": "CEC edit focus: A + clip(lam*A*L/m, -c, c) on the selected block's turns",
}
