"""Reads behind the run page and the group page: a live run's aggregates, a group's members.

Everything the run page plots is aggregated in SQL into at most ``MAX_BINS`` bins, so a
poll costs a few scans of the ``traces`` table (no per-trace rows leave DuckDB) however
large the run. Every aggregate of one answer is read as of one watermark (``seq <=
W``): a trace committed while the answer is built waits for the next poll instead of
showing up in some plots and not others. Values are bound parameters; the only SQL put
together here is chosen from fixed fragments.

Zero variance and credit status are the library's rules, read through its macros
(``group_rewards()``, ``tdb_zero_variance``, ``trace_credit_status()``): a group is
zero-variance when it has scored members and all of them hold the same reward. So is the
policy mismatch (``node_mismatch()``: tokens holding both ``logprobs`` and
``trainer_logprobs``, k3, the ratio band), summed per trace and per bin in SQL.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pyarrow as pa

from tracedb import credit_sets
from tracedb.credit import dose
from tracedb.database import Database

from . import queries, tracepage
from .errors import invalid, not_found

MAX_BINS = 500
"""The most bins a plot gets, whatever the size of the run."""
MAX_HIST_BINS = 100
"""The most bins of the reward histogram."""
AXIS_TAGS = 20
"""The most tag names offered as x axes."""
REJECTS_RECENT_S = 300
"""What counts as a recent reject: rejected in the last five minutes."""
RECENT_GROUPS = 10
"""Groups listed on the run page: the latest to have a member arrive."""
STRIP_TOKENS = (128, 2000)
"""Bounds on one branch's strip on the group page, in tokens."""
STRIP_BUDGET = 50_000
"""Tokens of strips one group page holds at most (beyond ``STRIP_TOKENS[0]`` per strip)."""
GROUP_STRIPS = 400
"""Branch strips one group page shows at most: each member's first branches, at least one each."""
CREDIT_COLUMNS = 12
"""The most credit sets whose status the group page shows per member."""


# --------------------------------------------------------------------------- axes


WORK_STEP = "work_step"
"""The x axis of the training step an episode was dispatched at (verifiers'
``run.work.step``), offered when some trace's episode has one."""


def axes(db: Database, mark: int) -> list[str]:
    """The x axes on offer: ``seq``, ``work_step`` when some episode has one, and
    ``tag:NAME`` for each tag some trace holds a number in (the ``AXIS_TAGS`` most common)."""
    rows = db.sql(
        "SELECT g.name FROM trace_tags g JOIN traces t USING (trace_id) "
        "WHERE g.number IS NOT NULL AND t.seq <= ? GROUP BY g.name ORDER BY count(*) DESC, g.name LIMIT ?",
        [mark, AXIS_TAGS],
    ).to_pylist()
    stepped = db.scalar(
        "SELECT EXISTS (SELECT 1 FROM traces t JOIN episodes e USING (episode_id) "
        "WHERE t.seq <= ? AND e.work_step IS NOT NULL)",
        [mark],
    )
    return ["seq", *([WORK_STEP] if stepped else []), *(f"tag:{r['name']}" for r in rows)]


def resolve_axis(by: str, offered: list[str]) -> str:
    """``auto`` is the ``step`` tag when traces hold one, else the episodes' training step
    (``work_step``) when they have one, else ``seq``; a named tag must be one some trace
    holds a number in (else 422 naming ``by``)."""
    if by == "auto":
        return next((a for a in ("tag:step", WORK_STEP) if a in offered), "seq")
    if by in offered:
        return by
    if by == WORK_STEP:
        raise invalid("by: no trace's episode has a training step (run.work.step)")
    if by.startswith("tag:"):
        tags = ", ".join(a[4:] for a in offered[1:]) or "none"
        raise invalid(f"by: no trace has a numeric tag {by[4:]!r} (numeric tags: {tags})")
    raise invalid(f"by: expected auto, seq, {WORK_STEP} or tag:NAME, got {by!r}")


# --------------------------------------------------------------------------- the run page


def run_data(
    db: Database,
    *,
    by: str = "auto",
    bins: int = 100,
    recent: int = 1000,
    hist_bins: int = 20,
    after: int | None = None,
    mismatch_c: float = 2.0,
) -> dict[str, Any]:
    """The run page's aggregates as of the current watermark ``W``.

    ``after`` is the watermark of the caller's last answer: when nothing arrived since,
    only the watermark and the rejects come back (``changed`` false; rejects carry no
    sequence number, so they are always read). Otherwise: the headline numbers
    (``summary``), per-bin series over the x axis ``by`` (``seq``: bins of equal width
    over 1..W; ``tag:NAME`` or ``work_step``, the episodes' training step: one bin per
    distinct value when there are at most ``bins`` of them, else ``bins`` equal-width
    ranges; traces without the tag or step are counted in ``axis.untagged``; each bin's
    ``dropped`` traces and ``dropped_share``, verifiers' ``Trace.dropped``), the reward
    histogram of the latest ``recent`` traces (0: all) in ``hist_bins`` equal-width bins,
    and the latest groups. A group is counted in the bin
    of its newest member's x.

    The policy mismatch, over the tokens holding both ``logprobs`` (the sampler's) and
    ``trainer_logprobs`` (a recompute pass's): ``mismatch`` for the whole run and, per bin,
    ``mismatch_traces`` (the bin's traces holding such tokens), ``mismatch_tokens``,
    ``k3_mean`` (the mean over those tokens of k3, an estimate of KL(inference || trainer)),
    ``ratio_mean``, ``ratio_max`` and ``outside_share`` (ratios exp(trainer - inference)
    outside ``[1/mismatch_c, mismatch_c]``); null where no token holds both.
    """
    if not 1 <= bins <= MAX_BINS:
        raise invalid(f"bins: expected 1 to {MAX_BINS}, got {bins}")
    if not 1 <= hist_bins <= MAX_HIST_BINS:
        raise invalid(f"hist_bins: expected 1 to {MAX_HIST_BINS}, got {hist_bins}")
    if recent < 0:
        raise invalid(f"recent: expected 0 (all) or a count of traces, got {recent}")
    if not (isinstance(mismatch_c, int | float) and math.isfinite(mismatch_c) and mismatch_c >= 1):
        raise invalid(f"mismatch_c: expected a finite number of at least 1 (the band [1/c, c]), got {mismatch_c}")
    mark = db.watermark()
    state = {"watermark": mark, "rejects": rejects(db)}
    if after is not None and after == mark:
        return {**state, "changed": False}
    offered = axes(db, mark)
    axis = resolve_axis(by, offered)
    series, layout = _bins(db, axis, bins, mark, mismatch_c)
    return {
        **state,
        "changed": True,
        "summary": summary(db, mark),
        "mismatch": mismatch_summary(db, mark, mismatch_c),
        "axes": offered,
        "axis": {"by": axis, "requested": by, "bins": bins, **layout},
        "bins": series,
        "histogram": histogram(db, mark, recent, hist_bins),
        "recent_groups": recent_groups(db, mark),
    }


def rejects(db: Database) -> dict[str, Any]:
    """How many lines were rejected, how many in the last ``REJECTS_RECENT_S`` seconds,
    and the latest one's reason and place."""
    row = db.sql(
        "SELECT count(*) AS total, "
        "  count(*) FILTER (WHERE rejected_at > current_timestamp::TIMESTAMP - to_seconds(?)) AS recent, "
        "  max(rejected_at) AS last_at, arg_max(reason, rejected_at) AS last_reason, "
        "  arg_max(source, rejected_at) AS last_source, arg_max(line, rejected_at) AS last_line "
        "FROM rejects",
        [REJECTS_RECENT_S],
    ).to_pylist()[0]
    row["recent_window_s"] = REJECTS_RECENT_S
    row["last_at"] = _iso(row["last_at"])
    return row


def summary(db: Database, mark: int) -> dict[str, Any]:
    """The headline numbers of the traces up to the watermark ``mark``."""
    row = db.sql(
        "SELECT count(*) AS traces, count(DISTINCT group_id) AS groups, count(reward) AS scored, "
        "  count(*) - count(reward) AS unscored, avg(reward) AS reward_mean, stddev_pop(reward) AS reward_std, "
        "  coalesce(sum(n_tokens), 0)::BIGINT AS tokens, coalesce(sum(n_sampled), 0)::BIGINT AS sampled, "
        "  count(dropped) AS dropped, max(ingested_at) AS last_arrival, "
        "  date_diff('millisecond', max(ingested_at), current_timestamp::TIMESTAMP) / 1000.0 AS age_s "
        "FROM traces WHERE seq <= ?",
        [mark],
    ).to_pylist()[0]
    row["last_arrival"] = _iso(row["last_arrival"])
    groups = db.sql(
        "SELECT count(*) FILTER (WHERE scored >= 1) AS eligible, "
        "  count(*) FILTER (WHERE zero_variance) AS zero_variance "
        "FROM group_rewards(through := ?)",
        [mark],
    ).to_pylist()[0]
    row["groups_scored"] = groups["eligible"]
    row["groups_zero_variance"] = groups["zero_variance"]
    row["zero_variance_share"] = _share(groups["zero_variance"], groups["eligible"])
    row["sampled_share"] = _share(row["sampled"], row["tokens"])
    row["dropped_share"] = _share(row["dropped"], row["traces"])
    return row


# The traces of the run with their x value; one of these, by axis kind.
_X_SEQ = "SELECT trace_id, group_id, reward, n_tokens, n_sampled, dropped, seq AS x FROM traces WHERE seq <= $through"
_X_TAG = (
    "SELECT t.trace_id, t.group_id, t.reward, t.n_tokens, t.n_sampled, t.dropped, g.number AS x FROM traces t "
    "JOIN trace_tags g ON g.trace_id = t.trace_id AND g.name = $tag AND g.number IS NOT NULL "
    "WHERE t.seq <= $through"
)
_X_STEP = (
    "SELECT t.trace_id, t.group_id, t.reward, t.n_tokens, t.n_sampled, t.dropped, e.work_step AS x FROM traces t "
    "JOIN episodes e USING (episode_id) WHERE t.seq <= $through AND e.work_step IS NOT NULL"
)
# A row's bin from its x; one of these, by layout. Also applied to a group's x (its newest member's).
_KEY_WIDTH = "CAST((x - 1) // $width AS BIGINT)"  # seq: bins of $width sequence numbers
_KEY_VALUE = "x"  # a tag with few values: one bin each
_KEY_RANGE = "least(CAST(floor((x - $lo) / $width) AS BIGINT), $last)"  # a tag's range in equal parts

_BINS = """
WITH t AS ({rows}),
b AS (
    SELECT {key} AS bin, count(*) AS traces, count(reward) AS scored, avg(reward) AS mean,
           stddev_pop(reward) AS std, min(reward) AS min, max(reward) AS max,
           quantile_cont(reward, 0.1) AS p10, quantile_cont(reward, 0.9) AS p90,
           sum(n_tokens)::BIGINT AS tokens, sum(n_sampled)::BIGINT AS sampled, count(dropped) AS dropped,
           min(x) AS x_min, max(x) AS x_max
    FROM t GROUP BY 1
),
g AS (
    SELECT group_id, max(x) AS x, count(reward) AS scored, min(reward) AS lo, max(reward) AS hi
    FROM t WHERE group_id IS NOT NULL GROUP BY group_id
),
gb AS (
    SELECT {key} AS bin, count(*) AS groups, count(*) FILTER (WHERE scored >= 1) AS groups_scored,
           count(*) FILTER (WHERE scored = 1) AS groups_single,
           count(*) FILTER (WHERE tdb_zero_variance(scored, lo, hi)) AS zero_variance
    FROM g GROUP BY 1
)
SELECT b.*, coalesce(gb.groups, 0) AS groups, coalesce(gb.groups_scored, 0) AS groups_scored,
       coalesce(gb.groups_single, 0) AS groups_single, coalesce(gb.zero_variance, 0) AS zero_variance
FROM b LEFT JOIN gb USING (bin) ORDER BY bin
"""


# The policy mismatch per trace (node_mismatch() summed over its nodes), joined to the rows
# of one axis and aggregated per bin over the tokens holding both streams.
_MISMATCH_TRACES = """
SELECT trace_id, sum(tokens) AS tokens, sum(k3_sum) AS k3_sum, sum(ratio_sum) AS ratio_sum,
       max(ratio_max) AS ratio_max, sum(outside) AS outside
FROM node_mismatch(c := $c) GROUP BY trace_id
"""
_MISMATCH_FIGURES = """
count(*) AS mismatch_traces, sum(m.tokens)::BIGINT AS mismatch_tokens,
sum(m.k3_sum) / sum(m.tokens) AS k3_mean, sum(m.ratio_sum) / sum(m.tokens) AS ratio_mean,
max(m.ratio_max) AS ratio_max, sum(m.outside) / sum(m.tokens) AS outside_share
"""
_MISMATCH_BINS = (
    "WITH t AS ({rows}), m AS (" + _MISMATCH_TRACES + ") "
    "SELECT {key} AS bin, " + _MISMATCH_FIGURES + " FROM t JOIN m USING (trace_id) GROUP BY 1"
)
_MISMATCH_NONE = {
    "mismatch_traces": 0,
    "mismatch_tokens": 0,
    "k3_mean": None,
    "ratio_mean": None,
    "ratio_max": None,
    "outside_share": None,
}


def mismatch_summary(db: Database, mark: int, c: float) -> dict[str, Any]:
    """The policy mismatch of the traces up to the watermark ``mark`` (see :func:`run_data`),
    with the band's ``c``."""
    row = db.sql(
        "WITH m AS (" + _MISMATCH_TRACES + ") SELECT " + _MISMATCH_FIGURES + " FROM m "
        "JOIN traces t USING (trace_id) WHERE t.seq <= $through",
        {"c": c, "through": mark},
    ).to_pylist()[0]
    return {"c": c, **row, "mismatch_tokens": row["mismatch_tokens"] or 0}


def _bins(
    db: Database, axis: str, bins: int, mark: int, mismatch_c: float = 2.0
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Per-bin rows over ``axis`` and how the axis was cut (``layout``: width, values or range)."""
    params: dict[str, Any] = {"through": mark}
    if axis == "seq":
        rows = _X_SEQ
        width = max(1, math.ceil(mark / bins))
        key, layout = _KEY_WIDTH, {"layout": "width", "width": width, "through": mark, "untagged": 0}
        params["width"] = width
    else:
        rows = _X_STEP if axis == WORK_STEP else _X_TAG
        if axis != WORK_STEP:
            params["tag"] = axis[4:]
        stats = db.sql(
            f"SELECT count(DISTINCT x) AS n, min(x) AS lo, max(x) AS hi, count(*) AS tagged FROM ({rows})", params
        ).to_pylist()[0]
        untagged = db.scalar("SELECT count(*) FROM traces WHERE seq <= ?", [mark]) - stats["tagged"]
        if stats["n"] <= bins:
            key, layout = _KEY_VALUE, {"layout": "values", "untagged": untagged}
        else:
            width = (stats["hi"] - stats["lo"]) / bins
            key, layout = _KEY_RANGE, {"layout": "range", "width": width, "lo": stats["lo"], "untagged": untagged}
            params.update(lo=stats["lo"], width=width, last=bins - 1)
    out = db.sql(_BINS.format(rows=rows, key=key), params).to_pylist()
    found = db.sql(_MISMATCH_BINS.format(rows=rows, key=key), {**params, "c": mismatch_c}).to_pylist()
    mismatch = {r.pop("bin"): r for r in found}
    for row in out:
        row.update(mismatch.get(row["bin"], _MISMATCH_NONE))
        _edges(row, layout)
        row["tokens_mean"] = row["tokens"] / row["traces"]
        row["sampled_share"] = _share(row["sampled"], row["tokens"])
        row["zero_variance_share"] = _share(row["zero_variance"], row["groups_scored"])
        row["dropped_share"] = _share(row["dropped"], row["traces"])
    return out, layout


def _edges(row: dict[str, Any], layout: dict[str, Any]) -> None:
    """A bin's nominal edges ``lo``..``hi`` and where it is plotted (``x``: its middle)."""
    key = row.pop("bin")
    if layout["layout"] == "width":
        lo, hi = key * layout["width"] + 1, min((key + 1) * layout["width"], layout["through"])
    elif layout["layout"] == "values":
        lo = hi = key
    else:
        lo = layout["lo"] + key * layout["width"]
        hi = lo + layout["width"]
    row.update(lo=lo, hi=hi, x=(lo + hi) / 2)


def histogram(db: Database, mark: int, recent: int, bins: int) -> dict[str, Any]:
    """The scored rewards of the latest ``recent`` traces (0: all) in ``bins`` equal-width
    bins over their range (one bin when they are all equal); the last bin holds its top edge."""
    window = "SELECT reward FROM traces WHERE seq <= $through ORDER BY seq DESC LIMIT $recent"
    params = {"through": mark, "recent": recent or None}
    stats = db.sql(
        f"SELECT count(*) AS traces, count(reward) AS scored, min(reward) AS lo, max(reward) AS hi FROM ({window})",
        params,
    ).to_pylist()[0]
    out = {"recent": recent, **stats, "bins": []}
    if not stats["scored"]:
        return out
    lo, hi = stats["lo"], stats["hi"]
    n = bins if hi > lo else 1
    found = db.sql(
        f"SELECT least(CAST(floor((reward - $lo) / $span * $n) AS BIGINT), $n - 1) AS bin, count(*) AS n "
        f"FROM ({window}) WHERE reward IS NOT NULL GROUP BY 1",
        {**params, "lo": lo, "span": (hi - lo) or 1.0, "n": n},
    )
    counts = dict(zip(found.column("bin").to_pylist(), found.column("n").to_pylist(), strict=True))
    step = (hi - lo) / n
    out["bins"] = [
        {"lo": lo + i * step, "hi": hi if i == n - 1 else lo + (i + 1) * step, "count": counts.get(i, 0)}
        for i in range(n)
    ]
    return out


def recent_groups(db: Database, mark: int) -> list[dict[str, Any]]:
    """The ``RECENT_GROUPS`` groups whose newest member arrived last, with their reward spread."""
    return db.sql(
        "SELECT group_id, traces, scored, reward_mean AS mean, reward_std AS std, reward_min AS min, "
        "  reward_max AS max, zero_variance, last_seq "
        "FROM group_rewards(through := ?) ORDER BY last_seq DESC, group_id LIMIT ?",
        [mark, RECENT_GROUPS],
    ).to_pylist()


# --------------------------------------------------------------------------- the group page


def group_page(db: Database, group_id: str, credit: str | None) -> dict[str, Any]:
    """A group as ``GET /groups/{id}`` has it, its members by reward (highest first,
    unscored last), each member's credit status in every credit set (at most
    ``CREDIT_COLUMNS``, ``credit`` first), and a heat strip per branch of each member.

    Credit status, per member and set: ``unassigned`` (no node holds advantages: None),
    ``zero`` (assigned, all zero), ``partial`` (some sampled nodes unassigned) or
    ``assigned``. A strip is the branch's tokens in the ``credit`` set from its first
    sampled token on, at most ``STRIP_BUDGET`` / strips tokens within ``STRIP_TOKENS``
    (the page stays light however large the group); ``start``/``end`` say which. A member
    shows its first ``strips_each`` branches (``GROUP_STRIPS`` shared out over the
    members); ``more_branches`` says how many more it has.
    """
    group = queries.group(db, group_id, credit)
    members = sorted(group["traces"], key=lambda m: (m["reward"] is None, -(m["reward"] or 0.0), m["trace_id"]))
    sets = _credit_columns(db, credit)
    statuses = {name: credit_statuses(db, group_id, name) for name in sets}
    for member in members:
        member["credit"] = {name: statuses[name].get(member["trace_id"], "unassigned") for name in sets}
    each = max(1, GROUP_STRIPS // max(1, len(members)))  # a member's first branches (indices are 0, 1, ...)
    table = db.branches(
        group=group_id,
        branch_index=list(range(each)),
        columns=["token_ids", "sampled_mask", "logprobs", "advantages"],
        credit=credit,
    )
    cap = max(STRIP_TOKENS[0], min(STRIP_TOKENS[1], STRIP_BUDGET // max(1, table.num_rows)))
    rows: dict[str, list[int]] = {}
    for i, trace_id in enumerate(table.column("trace_id").to_pylist()):
        rows.setdefault(trace_id, []).append(i)  # by trace id, then branch index
    strips: list[dict[str, Any]] = []
    for member in members:
        member["strips"] = []
        for row in rows.get(member["trace_id"], []):
            strip = _strip(table, row, cap)
            member["strips"].append({"strip": len(strips), **{k: strip.pop(k) for k in _STRIP_META}})
            strips.append(strip)
        member["more_branches"] = member["n_branches"] - len(member["strips"])
    return {**group, "traces": members, "credit_sets": sets, "strips": strips, "strip_cap": cap, "strips_each": each}


def group_compare(db: Database, group_id: str, a: str, b: str) -> dict[str, Any]:
    """Sets ``a`` and ``b`` (``"default"``: the ingested credit) compared over the group's
    traces only, dose-matched (:func:`tracedb.credit.dose.compare` with ``trace_ids``):
    per set its ``dose`` (tokens assigned and credited, coverage, sum A, sum |A|, sum A^2,
    concentration, ...) and, for the pair, its ``agreement`` (shared tokens, sign
    agreement, correlation; 0 shared tokens, no agreement or correlation, when the two
    share no token). 404 for a group without traces."""
    ids = [
        r["trace_id"]
        for r in db.sql("SELECT trace_id FROM traces WHERE group_id = ? ORDER BY 1", [group_id]).to_pylist()
    ]
    if not ids:
        raise not_found(f"group {group_id!r} has no traces in {db.path}")
    figures = dose.compare(db, [a, b], trace_ids=ids)
    # no token both sets assign: the library has no row for the pair; the page says 0 shared
    none = {"set_a": a, "set_b": b, "shared_tokens": 0, "sign_agreement": None, "correlation": None}
    agreement = (figures["agreement"].to_pylist() or [none])[0]
    return {"a": a, "b": b, "traces": ids, "dose": figures["dose"].to_pylist(), "agreement": agreement}


def _credit_columns(db: Database, credit: str | None) -> list[str]:
    """The credit sets shown: the one asked for first, then the others in the registry's order."""
    shown = credit or credit_sets.DEFAULT_SET
    names = [r["name"] for r in queries.credit_sets(db)]
    return [shown, *(n for n in names if n != shown)][:CREDIT_COLUMNS]


def credit_statuses(db: Database, group_id: str, credit: str) -> dict[str, str]:
    """Each member's credit status in one set (``trace_credit_status()``; see :func:`group_page`)."""
    rows = db.sql(
        "SELECT c.trace_id, c.credit_status FROM trace_credit_status(credit := ?) c "
        "JOIN traces t USING (trace_id) WHERE t.group_id = ?",
        [credit_sets.stored_name(credit), group_id],
    ).to_pylist()
    return {r["trace_id"]: r["credit_status"] for r in rows}


_STRIP_META = ("branch_index", "trainable", "start", "end", "n_tokens", "n_sampled", "advantage_mean")


def _strip(table: pa.Table, row: int, cap: int) -> dict[str, Any]:
    """Row ``row`` of a branch view cut to at most ``cap`` tokens from its first sampled one."""
    ids = table.column("token_ids")[row].values.to_numpy(zero_copy_only=False)
    mask = table.column("sampled_mask")[row].values.to_numpy(zero_copy_only=False).astype(bool)
    logprobs = _values(table.column("logprobs")[row])
    advantages = _values(table.column("advantages")[row])
    sampled = np.flatnonzero(mask)
    start = int(sampled[0]) if len(sampled) else 0
    end = min(len(ids), start + cap)
    mean = None
    if advantages is not None and len(sampled):
        mean = float(np.mean(advantages[mask], dtype=np.float64))
    cut = slice(start, end)
    return {
        "branch_index": table.column("branch_index")[row].as_py(),
        "trainable": table.column("trainable")[row].as_py(),
        "start": start,
        "end": end,
        "n_tokens": len(ids),
        "n_sampled": len(sampled),
        "advantage_mean": mean if mean is None or math.isfinite(mean) else None,
        "offset": start,
        "token_ids": ids[cut],
        "sampled_mask": mask[cut],
        "logprobs": None if logprobs is None else logprobs[cut],
        "advantages": None if advantages is None else advantages[cut],
    }


def _values(cell: pa.Scalar) -> np.ndarray | None:
    return cell.values.to_numpy(zero_copy_only=False) if cell.is_valid else None


# --------------------------------------------------------------------------- two credit sets


def credit_diff(db: Database, trace_id: str, a: str | None, b: str | None, *, nodes_from: int = 0) -> dict[str, Any]:
    """One trace's sampled nodes in credit sets ``a`` and ``b`` (None: the default set),
    at most ``tracepage.COMPARE_NODES`` of them from the ``nodes_from``-th on (``window``
    says which): per node, three strips (``a``, ``b`` and ``a - b``; within the page's
    token budget, ``shown`` tokens from the node's start) and a summary row over all its
    tokens: whether each set assigns the node, the mean over its sampled tokens in each,
    and the largest and mean difference. A difference needs both values: a node only one
    set assigns has none (None, not zero). Streams come from the same ``node_tokens()``
    view as the trace page, so the strips line up token for token.
    """
    queries.trace_meta(db, trace_id)  # 404 for an unknown trace
    sampled = db.sql(  # no credit lives in the other nodes
        "SELECT node_index, role, n_tokens, n_sampled FROM nodes WHERE trace_id = ? AND n_sampled > 0 "
        "ORDER BY node_index",
        [trace_id],
    ).to_pylist()
    start, stop = tracepage.compare_window(len(sampled), nodes_from)
    nodes = sampled[start:stop]
    ids = [n["node_index"] for n in nodes]
    left, right = queries.node_tokens(db, trace_id, a, nodes=ids), queries.node_tokens(db, trace_id, b, nodes=ids)
    caps = tracepage.compare_tokens([n["n_tokens"] for n in nodes])
    rows, strips = [], []
    for node, x, y, cap in zip(nodes, left, right, caps, strict=True):
        mask = np.asarray(x["sampled_mask"], bool)
        va, vb = x["advantages"], y["advantages"]
        diff = None if va is None or vb is None else va.astype(np.float64) - vb.astype(np.float64)
        row = {
            **node,
            "assigned_a": va is not None,
            "assigned_b": vb is not None,
            "mean_a": _mean(va, mask),
            "mean_b": _mean(vb, mask),
            "mean_diff": _mean(diff, mask),
            "max_abs_diff": None if diff is None else float(np.abs(diff[mask]).max()),
            "shown": cap,
            "strips": [],
        }
        for side, values in (("a", va), ("b", vb), ("diff", diff)):
            row["strips"].append({"side": side, "strip": len(strips)})
            strips.append(
                {
                    "token_ids": tracepage.head_of(x["token_ids"], cap),
                    "sampled_mask": mask[:cap],
                    "logprobs": tracepage.head_of(x["logprobs"], cap),
                    "advantages": tracepage.head_of(values, cap),
                    "node_index": node["node_index"],
                    "side": side,
                }
            )
        rows.append(row)
    window = {
        "n_sampled": len(sampled),
        "nodes_from": start,
        "nodes_to": stop,
        "previous_nodes": max(0, start - tracepage.COMPARE_NODES) if start > 0 else None,
        "next_nodes": stop if stop < len(sampled) else None,
    }
    return {"trace_id": trace_id, "nodes": rows, "strips": strips, "window": window}


def _mean(values: np.ndarray | None, mask: np.ndarray) -> float | None:
    if values is None or not mask.any():
        return None
    mean = float(np.mean(values[mask], dtype=np.float64))
    return mean if math.isfinite(mean) else None


# --------------------------------------------------------------------------- helpers


def _share(part: int | None, whole: int | None) -> float | None:
    return part / whole if whole else None


def _iso(value: Any) -> str | None:
    return None if value is None else value.isoformat()
