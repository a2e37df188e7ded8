"""CEC over the database: plan (blocks, selection, utilities, coefficients per trace),
queries, the four stamped arms, the identity check and the availability report
(see :mod:`tracedb.cec`)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import polars as pl
import pyarrow as pa

from tracedb import credit_sets, tables, writeback
from tracedb.cec.records import ensure_installed
from tracedb.cec.rules import (
    ARMS,
    CREDIT_SETS,
    DEFAULT_CAP,
    DEFAULT_LAM,
    F32_EPS,
    CecError,
    Turn,
    Utility,
    coefficients,
    contrast,
    edit_blocks,
    edit_focus,
    quantile,
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
    db = handle_of(db)
    if not (lam > 0 and math.isfinite(lam)) or not (cap > 0 and math.isfinite(cap)):
        raise CecError(f"lam and cap must be positive numbers, got lam={lam}, cap={cap}")
    ensure_installed(db)
    data = _plan_inputs(db)
    advantages = _advantages(db, reward, group_by, include_failed)
    rows = [_plan_trace(t, data, advantages[t], lam, cap) for t in sorted(data["traces"])]
    table = pa.Table.from_pylist(rows, schema=_SELECTION_ROWS)
    columns = ", ".join(_SELECTION_ROWS.names)
    with db.transaction():
        db.con.execute("DELETE FROM cec_selection")
        with db.registered("_tdb_cec_plan", table):
            db.con.execute(f"INSERT INTO cec_selection ({columns}) SELECT {columns} FROM _tdb_cec_plan")
    return _plan_summary(rows, lam, cap)


def _counts(values: Iterable[Any]) -> dict[str, int]:
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
        "selection": _counts(r["selection"] for r in rows),
        "query": _counts(r["query"] for r in rows),
        "intervention": _counts(r["intervention"] for r in rows),
    }


def _selection(db: Handle) -> pl.DataFrame:
    ensure_installed(db)
    df = pl.from_arrow(db.sql("SELECT * FROM cec_selection ORDER BY trace_id"))
    if df.is_empty():
        raise CecError("no CEC plan in this database: run `tracedb cec plan` (or cec.plan / cec.stamp) first")
    return df


def queries(db: HandleOf, *, pending_only: bool = False) -> list[dict[str, Any]]:
    """The planned counterfactual queries: what a harness needs to build each
    intervention (:func:`tracedb.credit.cec_git.intervene`) and verify it."""
    db = handle_of(db)
    df = _selection(db).filter(pl.col("query") == "planned")
    if pending_only:
        df = df.filter(pl.col("intervention") == "pending")
    records = dict(
        db.con.execute("SELECT trace_id, instance_id || '|' || rep || '|' || cache_salt FROM cec_traces").fetchall()
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
    db = handle_of(db)
    params = {"lam": lam, "cap": cap, "reward": reward, "group_by": group_by, "include_failed": include_failed}
    with db.transaction():
        summary = plan(db, lam, cap, reward=reward, group_by=group_by, include_failed=include_failed)
        df = _selection(db)
        nodes = _sampled_nodes(db)
        nodes_written = {}
        for arm in ARMS:
            name = CREDIT_SETS[arm]
            nodes_written[name] = writeback.stamp(
                db,
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


# =========================================================================== check


@dataclass
class CheckReport:
    """Result of :func:`check`: traces checked and every identity that failed."""

    checked: int = 0
    failures: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.failures

    def to_dict(self) -> dict[str, Any]:
        return {"checked": self.checked, "ok": self.ok, "failures": self.failures}

    def __str__(self) -> str:
        if self.ok:
            return f"all identities hold on {self.checked} traces with available credit"
        return f"{len(self.failures)} identity failures on {self.checked} traces with available credit"


_SUMS_SQL = """
WITH sel AS (
    SELECT trace_id, advantage FROM cec_selection
    WHERE intervention = 'usable' AND valid
),
nc AS (
    SELECT n.trace_id, n.n_sampled, c.value, c.advantages, s.advantage AS a
    FROM nodes n JOIN sel s USING (trace_id)
    LEFT JOIN credit c ON c.credit_set = ? AND c.trace_id = n.trace_id AND c.node_index = n.node_index
    WHERE n.n_sampled > 0
),
tok AS (
    SELECT trace_id, n_sampled::DOUBLE AS w, value::DOUBLE - a AS c, abs(value::DOUBLE) AS x
    FROM nc WHERE value IS NOT NULL
    UNION ALL
    SELECT trace_id, 1.0 AS w, v::DOUBLE - a AS c, abs(v::DOUBLE) AS x
    FROM (SELECT trace_id, a, unnest(advantages) AS v FROM nc WHERE value IS NULL AND advantages IS NOT NULL)
)
SELECT s.trace_id,
       coalesce(t.tokens, 0), coalesce(t.sum_c, 0), coalesce(t.sum_abs, 0), coalesce(t.sum_sq, 0),
       coalesce(t.err, 0), coalesce(t.err_sq, 0),
       (SELECT count(*) FROM nc WHERE nc.trace_id = s.trace_id AND value IS NULL AND advantages IS NULL)
FROM sel s LEFT JOIN (
    SELECT trace_id, sum(w) AS tokens, sum(w * c) AS sum_c, sum(w * abs(c)) AS sum_abs, sum(w * c * c) AS sum_sq,
           sum(w * x) AS err, sum(w * (2 * abs(c) * x + x * x)) AS err_sq
    FROM tok GROUP BY trace_id
) t USING (trace_id)
ORDER BY s.trace_id
"""


def _sums(db: Handle, credit_set: str) -> dict[str, dict[str, float]]:
    names = ("tokens", "sum", "abs", "sq", "err", "err_sq", "unassigned")
    return {row[0]: dict(zip(names, row[1:])) for row in db.con.execute(_SUMS_SQL, [credit_set]).fetchall()}


def check(db: HandleOf, *, rel_tol: float = 1e-6) -> CheckReport:
    """Verify the coefficient identities on the stored credit of ``cec-M`` and ``cec-B``.

    For every trace with available credit (a usable contrast on a valid group member),
    with C = stored value - A per sampled token recomputed in float64:
    sum C^M = sum C^B = lam*D*s*L, sum |C^M| = sum |C^B| = lam*|D|*s*L, and (D != 0)
    sum (C^M)^2 / sum (C^B)^2 = L/m; also every sampled node is assigned in both sets
    and B covers exactly L tokens. Stored credit is float32: each stored value is within
    2^-24 of itself relatively, so a sum may drift by 2^-24 * sum|stored|. The tolerance
    is ``rel_tol`` relative plus twice that float32 bound.
    """
    db = handle_of(db)
    df = _selection(db)
    missing = [name for name in (CREDIT_SETS["M"], CREDIT_SETS["B"]) if not credit_sets.exists(db, name)]
    if missing:
        raise CecError(f"credit sets {missing} do not exist: run `tracedb cec stamp` first")
    sums_m = _sums(db, CREDIT_SETS["M"])
    sums_b = _sums(db, CREDIT_SETS["B"])
    report = CheckReport()
    rows = df.filter((pl.col("intervention") == "usable") & pl.col("valid")).iter_rows(named=True)
    for row in rows:
        report.checked += 1
        trace_id = row["trace_id"]
        lam, D, s, L, m = row["lam"], row["d"], row["s"], row["generated_tokens"], row["edit_tokens"]
        M, B = sums_m[trace_id], sums_b[trace_id]

        def fail(identity: str, expected: float, got: float, tol: float, trace_id: str = trace_id) -> None:
            report.failures.append(
                {"trace_id": trace_id, "identity": identity, "expected": expected, "got": got, "tolerance": tol}
            )

        def close(identity: str, expected: float, got: float, bound: float) -> None:
            tol = rel_tol * max(abs(expected), abs(got)) + 2 * F32_EPS * bound
            if not abs(got - expected) <= tol:
                fail(identity, expected, got, tol)

        for name, sums in (("M", M), ("B", B)):
            if sums["unassigned"]:
                fail(f"every sampled node assigned in cec-{name}", 0, sums["unassigned"], 0)
        if B["tokens"] != L:
            fail("cec-B covers L sampled tokens", L, B["tokens"], 0)
        mass = lam * D * s * L
        close("sum C^M = lam*D*s*L", mass, M["sum"], M["err"])
        close("sum C^B = lam*D*s*L", mass, B["sum"], B["err"])
        close("sum C^M = sum C^B", B["sum"], M["sum"], M["err"] + B["err"])
        close("sum |C^M| = sum |C^B|", B["abs"], M["abs"], M["err"] + B["err"])
        close("sum |C^M| = lam*|D|*s*L", abs(mass), M["abs"], M["err"])
        if D != 0:
            ratio = M["sq"] / B["sq"] if B["sq"] else math.inf
            expected = L / m
            drift = F32_EPS * (M["err_sq"] / M["sq"] + B["err_sq"] / B["sq"]) if M["sq"] and B["sq"] else math.inf
            tol = expected * (rel_tol + 2 * drift)
            if not abs(ratio - expected) <= tol:
                fail("sum (C^M)^2 / sum (C^B)^2 = L/m", expected, ratio, tol)
    return report


# =========================================================================== report


QUANTILES = {"p05": 0.05, "median": 0.5, "p95": 0.95}


def report(db: HandleOf) -> dict[str, Any]:
    """The signal-availability table of the current plan (see docs/cec.md for each row)."""
    db = handle_of(db)
    df = _selection(db)
    planned = df.filter(pl.col("query") == "planned")
    issued = planned.filter(pl.col("intervention") != "pending")
    usable = planned.filter(pl.col("intervention") == "usable")
    nonzero = usable.filter(pl.col("d") != 0)
    failed_issued = issued.filter(pl.col("y_orig") == 0)
    decomposition = (
        usable.with_columns(
            pl.col("d_y").round(12), pl.col("d_f").round(12), pl.col("d_g").round(12), pl.col("d").round(12)
        )
        .group_by("d_y", "d_f", "d_g", "d")
        .agg(pl.len().alias("count"), (pl.col("y_orig") == 0).sum().alias("failed_originals"))
        .sort(["count", "d", "d_y", "d_f", "d_g"], descending=[True, True, False, False, False])
    )
    distributions = {
        "m_over_L": (nonzero["edit_tokens"] / nonzero["generated_tokens"]).to_list(),
        "s": nonzero["s"].to_list(),
        "M_magnitude": nonzero["coef_m"].abs().to_list(),
        "B_magnitude": nonzero["coef_b"].abs().to_list(),
    }
    return {
        "lam": df["lam"][0],
        "cap": df["cap"][0],
        "planned_trajectories": df.height,
        "unavailable_original_utility": int(df["u_orig"].is_null().sum()),
        "not_queried": _counts(df.filter(pl.col("query") != "planned")["query"].to_list()),
        "selection": _counts(df["selection"].to_list()),
        "queries": {
            "planned": planned.height,
            "issued": issued.height,
            "usable": usable.height,
            "pending": planned.height - issued.height,
            "unusable": _counts(issued.filter(pl.col("intervention") != "usable")["intervention"].to_list()),
        },
        "contrasts": {
            "positive": int((usable["d"] > 0).sum()),
            "negative": int((usable["d"] < 0).sum()),
            "nonzero": nonzero.height,
            "zero": usable.height - nonzero.height,
        },
        "failed_originals": {
            "queried": failed_issued.height,
            "nonzero": int(failed_issued.filter((pl.col("intervention") == "usable") & (pl.col("d") != 0)).height),
        },
        "capped_nonzero": int((nonzero["s"] < 1).sum()),
        "decomposition": decomposition.to_dicts(),
        "quantiles": {
            name: {label: quantile(values, q) for label, q in QUANTILES.items()}
            for name, values in distributions.items()
        },
        "quantile_n": nonzero.height,
    }


def report_rows(data: dict[str, Any]) -> list[dict[str, Any]]:
    """The report as (measurement, value) rows for a table."""
    q, c, f = data["queries"], data["contrasts"], data["failed_originals"]
    rows = [
        ("Planned trajectories", data["planned_trajectories"]),
        ("Unavailable original utility", data["unavailable_original_utility"]),
        ("Issued / usable CF queries", f"{q['issued']} / {q['usable']}"),
        ("Positive / negative contrasts", f"{c['positive']} / {c['negative']}"),
        ("Nonzero contrasts", c["nonzero"]),
        ("Queried failed original trajectories", f["queried"]),
        ("Nonzero contrasts on failed originals", f["nonzero"]),
        ("Capped nonzero contrasts (s < 1)", data["capped_nonzero"]),
    ]
    rows += [(f"Not queried: {reason}", n) for reason, n in data["not_queried"].items()]
    if q["pending"]:
        rows.append(("Planned queries without an intervention record", q["pending"]))
    rows += [(f"Unusable queries: {reason}", n) for reason, n in q["unusable"].items()]
    signed = lambda x: f"{x:+g}" if x else "0"  # noqa: E731
    for d in data["decomposition"]:
        parts = ", ".join(signed(d[k]) for k in ("d_y", "d_f", "d_g"))
        label = f"D = {signed(d['d'])} from (dY, dF, dG) = ({parts})"
        rows.append((label, f"{d['count']} ({d['failed_originals']} on failed originals)"))
    names = {"m_over_L": "m/L", "s": "s", "M_magnitude": "M receiving |C|", "B_magnitude": "B receiving |C|"}
    for key, label in names.items():
        qs = data["quantiles"][key]
        shown = " / ".join("-" if qs[k] is None else f"{qs[k]:.5g}" for k in QUANTILES)
        rows.append((f"{label}: p5 / median / p95 (N={data['quantile_n']})", shown))
    return [{"measurement": k, "value": v} for k, v in rows]
