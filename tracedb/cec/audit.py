"""CEC audits over a stamped database: the coefficient identities on the stored credit
(:func:`check`) and the signal-availability table of the plan (:func:`report`)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import polars as pl

from tracedb import credit_sets
from tracedb.cec.planning import counts, selection
from tracedb.cec.rules import CREDIT_SETS, F32_EPS, CecError, quantile
from tracedb.handle import Handle, HandleOf, handle_of

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
    handle = handle_of(db)
    df = selection(handle)
    missing = [name for name in (CREDIT_SETS["M"], CREDIT_SETS["B"]) if not credit_sets.exists(handle, name)]
    if missing:
        raise CecError(f"credit sets {missing} do not exist: run `tracedb cec stamp` first")
    sums_m = _sums(handle, CREDIT_SETS["M"])
    sums_b = _sums(handle, CREDIT_SETS["B"])
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
    handle = handle_of(db)
    df = selection(handle)
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
        "not_queried": counts(df.filter(pl.col("query") != "planned")["query"].to_list()),
        "selection": counts(df["selection"].to_list()),
        "queries": {
            "planned": planned.height,
            "issued": issued.height,
            "usable": usable.height,
            "pending": planned.height - issued.height,
            "unusable": counts(issued.filter(pl.col("intervention") != "usable")["intervention"].to_list()),
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
