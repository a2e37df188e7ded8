"""Runs side by side (``/runs/compare``): per run its headline figures, and per step its
reward, zero-variance share and tokens per trace, on one x axis for all.

Per run, as of its watermark: traces, groups, reward mean, the zero-variance share (of the
groups with a scored member, those whose scored rewards are all equal: no group-relative
gradient), the dropped share (``traces.dropped``: 0 with ``dropped_recorded`` false on a
file whose schema has no such column), staleness (a trace's ``work_step`` minus its lowest
policy version, mean and max over the traces that have both; None where the schema records
neither) and tokens per trace. The per-step series are the run page's bins
(:func:`pages.run_data`): over ``tag:step`` when every run has it (one row per step),
else over each run's ingest sequence cut into the same number of parts (row k is the k-th
part of each run).
"""

from __future__ import annotations

from typing import Any

from tracedb.database import Database

from . import pages

BINS = 50
"""Steps a comparison shows at most (over ``tag:step``)."""
PARTS = 20
"""Parts of each run's ingest sequence a comparison shows (when not every run has a step tag)."""


def columns(db: Database, table: str) -> set[str]:
    return {row["column_name"] for row in db.sql(f"DESCRIBE {table}").to_pylist()}


def axis_for(dbs: list[Database]) -> str:
    """``tag:step`` when every run's traces have a numeric step tag, else ``seq``."""
    every = all("tag:step" in pages.axes(db, db.watermark()) for db in dbs)
    return "tag:step" if every else "seq"


def run_figures(db: Database, axis: str, bins: int = BINS) -> dict[str, Any]:
    """One run's headline figures and per-bin series over ``axis``."""
    data = pages.run_data(db, by=axis, bins=bins, recent=0, hist_bins=1)
    mark = data["watermark"]
    summary = data["summary"]
    traces = summary["traces"]
    figures: dict[str, Any] = {
        "watermark": mark,
        "traces": traces,
        "groups": summary["groups"],
        "reward_mean": summary["reward_mean"],
        "zero_variance_share": summary["zero_variance_share"],
        "groups_scored": summary["groups_scored"],
        "groups_zero_variance": summary["groups_zero_variance"],
        "tokens_per_trace": summary["tokens"] / traces if traces else None,
        "sampled_share": summary["sampled_share"],
    }
    trace_columns = columns(db, "traces")
    figures["dropped_recorded"] = "dropped" in trace_columns
    figures["dropped_share"] = (
        (db.scalar("SELECT avg(CASE WHEN dropped THEN 1.0 ELSE 0.0 END) FROM traces WHERE seq <= ?", [mark]) or 0.0)
        if figures["dropped_recorded"]
        else 0.0
    )
    figures["staleness_recorded"] = "policy_min" in trace_columns and "work_step" in columns(db, "episodes")
    figures["staleness_mean"] = figures["staleness_max"] = None
    if figures["staleness_recorded"]:
        row = db.sql(
            "SELECT avg(e.work_step - t.policy_min) AS mean, max(e.work_step - t.policy_min) AS max "
            "FROM traces t JOIN episodes e USING (episode_id) "
            "WHERE t.seq <= ? AND e.work_step IS NOT NULL AND t.policy_min IS NOT NULL",
            [mark],
        ).to_pylist()[0]
        figures["staleness_mean"] = None if row["mean"] is None else float(row["mean"])
        figures["staleness_max"] = None if row["max"] is None else float(row["max"])
    series = [
        {
            "lo": b["lo"],
            "hi": b["hi"],
            "traces": b["traces"],
            "reward_mean": b["mean"],
            "zero_variance_share": b["zero_variance_share"],
            "tokens_per_trace": b["tokens_mean"],
        }
        for b in data["bins"]
    ]
    return {"figures": figures, "series": series, "untagged": data["axis"].get("untagged", 0)}


def compare(named: dict[str, Database]) -> dict[str, Any]:
    """The runs ``named`` (name -> database) side by side: ``runs`` (name, figures), the
    ``axis`` and ``rows``: per step (or part), each run's series entry under its name."""
    dbs = list(named.values())
    axis = axis_for(dbs)
    per = {name: run_figures(db, axis, BINS if axis == "tag:step" else PARTS) for name, db in named.items()}
    rows: dict[Any, dict[str, Any]] = {}
    for name, run in per.items():
        for k, entry in enumerate(run["series"]):
            key = entry["lo"] if axis != "seq" else k
            row = rows.setdefault(key, {"key": key, "runs": {}})
            row["runs"][name] = entry
    ordered = [rows[k] for k in sorted(rows)]
    return {
        "axis": axis,
        "runs": [{"name": name, **run["figures"], "untagged": run["untagged"]} for name, run in per.items()],
        "rows": ordered,
    }
