"""A trace's turns at a glance: per sampled node (a turn of the model), its advantage in one
credit set, summed up (``/view/{id}``'s turn summary and ``GET /traces/{id}/turns``).

A 33k-token trace is a long scroll of strips; its turns are a few dozen rows. A turn is a
sampled node, numbered in node order; its figures are over its sampled tokens' values in
the set (the compact stream as stored, one value per sampled token): mean, min, max and
sum, all None when the set leaves the node unassigned (never scored is not zero). At most
``TURNS`` turns are listed (``turns_from`` pages on), with the trace's totals beside them.
"""

from __future__ import annotations

from typing import Any

from tracedb.database import Database

from . import queries
from .errors import not_found

TURNS = 500
"""Turns one answer lists at most."""


def sampled_nodes(db: Database, trace_id: str) -> set[int]:
    """The indices of the trace's sampled nodes."""
    table = db.sql("SELECT node_index FROM nodes WHERE trace_id = ? AND sampled", [trace_id])
    return set(table.column("node_index").to_pylist())


def turn_summary(
    db: Database, trace_id: str, credit: str | None, *, turns_from: int = 0, limit: int = TURNS
) -> dict[str, Any]:
    """The trace's turns ``turns_from`` .. ``turns_from + limit`` in node order, each with
    ``turn`` (1-based), ``node_index``, ``role``, ``n_sampled``, ``assigned`` and its
    advantages' ``mean``, ``min``, ``max``, ``sum``; and over every turn of the trace:
    ``n_turns``, ``assigned_turns``, ``sampled_tokens``, ``scale`` (the largest |mean|, for
    a colour scale) and ``next_from`` (None on the last page). 404 for an unknown trace."""
    queries.trace_meta(db, trace_id)
    rows = db.sql(
        "SELECT row_number() OVER (ORDER BY n.node_index)::BIGINT AS turn, n.node_index, n.role, n.n_sampled, "
        "  a.advantages IS NOT NULL AS assigned, list_avg(a.advantages) AS mean, list_min(a.advantages) AS min, "
        "  list_max(a.advantages) AS max, list_sum(a.advantages) AS sum "
        "FROM nodes n JOIN credit_advantages(?) a USING (trace_id, node_index) "
        "WHERE n.trace_id = ? AND n.sampled ORDER BY n.node_index",
        [credit, trace_id],
    ).to_pylist()
    if rows and turns_from >= len(rows):
        raise not_found(f"trace {trace_id!r} has {len(rows)} turns (sampled nodes); no turn {turns_from + 1}")
    page = rows[turns_from : turns_from + limit]
    for row in page:
        for key in ("mean", "min", "max", "sum"):
            row[key] = None if row[key] is None else float(row[key])
    means = [abs(r["mean"]) for r in rows if r["mean"] is not None]
    return {
        "trace_id": trace_id,
        "n_turns": len(rows),
        "assigned_turns": sum(1 for r in rows if r["assigned"]),
        "sampled_tokens": sum(r["n_sampled"] for r in rows),
        "scale": max(means) if means else None,
        "turns_from": turns_from,
        "next_from": turns_from + limit if turns_from + limit < len(rows) else None,
        "turns": page,
    }
