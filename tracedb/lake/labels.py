"""Weight labels mapped to policy versions in a lake (its ``policy_labels``).

A lake stores each trace's policy-version bounds in its ``traces`` row (``policy_min``,
``policy_max``, ``policy_unknown``: :mod:`tracedb.policy`'s rule), computed by the writer
with the mapping it had. So the lake keeps one mapping and every writer uses it:

- readers show a label's latest row (``policy_labels`` is a log of mappings; a label
  mapped again has a newer row), :func:`mapping`;
- a write (a push, an ingest task, ``Lake.append``) adds the labels the lake lacks and
  refuses, before anything is written, a label the lake maps to another version
  (:func:`new_rows`: bounds computed with another number would disagree with the lake's);
- a Ray ingest task starts from the lake's mapping (:func:`seed`), so its traces' bounds
  use it;
- :func:`set_versions` (``Lake.set_policy_versions``) maps labels in the lake: the rows are
  appended, then the bounds of every visible trace whose spans use one of the labels are
  computed again (:func:`tracedb.policy.recompute_bounds`, over those traces' visible
  rows) and ``traces`` is rewritten with them (compaction's rewrite: every trace keeps its
  ``seq``; the watermark moves past the rewrite).
"""

from __future__ import annotations

import datetime
from collections.abc import Mapping
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from tracedb import policy, policy_labels
from tracedb.database import Database
from tracedb.errors import WriteError
from tracedb.lake import catalog, compact, read
from tracedb.lake.scan import scan_keys, visible_traces

TABLE = "policy_labels"
BOUNDS = ("policy_min", "policy_max", "policy_unknown")


def mapping(lake: Any) -> dict[str, int]:
    """The lake's labels and their versions (each label's latest row)."""
    raw = lake.table(TABLE).scan().to_arrow()
    if raw.num_rows == 0:
        return {}
    con = duckdb.connect()
    try:
        rows = read.visible_rows(con, TABLE, raw).select(["label", "version"]).to_pydict()
    finally:
        con.close()
    return dict(zip(rows["label"], rows["version"], strict=True))


def refuse_other(held: Mapping[str, int], rows: pa.Table, *, theirs: str, ours: str) -> None:
    """:class:`WriteError` naming the first label of ``rows`` (``policy_labels`` rows)
    that ``held`` maps to another version (``theirs``/``ours`` say whose is whose)."""
    for label, version in zip(rows.column("label").to_pylist(), rows.column("version").to_pylist(), strict=True):
        if label in held and held[label] != version:
            raise WriteError(
                f"weight label {label!r}: {theirs} maps it to policy version {held[label]}, {ours} to {version}; "
                "traces' bounds computed with two numbers would disagree (map it in the lake with "
                "Lake.set_policy_versions, or in the file with db.set_policy_versions, so that both agree)"
            )


def new_rows(lake: Any, rows: pa.Table) -> pa.Table:
    """The rows of ``rows`` (``policy_labels`` of a write) whose labels the lake lacks;
    :class:`WriteError` naming the first label the lake maps to another version."""
    if rows.num_rows == 0:
        return rows
    held = mapping(lake)
    refuse_other(held, rows, theirs="the lake", ours="this write")
    return rows.filter(pc.invert(pc.is_in(rows.column("label"), value_set=pa.array(sorted(held), pa.string()))))


def seed(db: Database, lake: Any) -> None:
    """Give an empty in-memory tracedb the lake's mapping (before it ingests for the lake)."""
    held = mapping(lake)
    if held:
        db.set_policy_versions(held)


def set_versions(lake: catalog.Opened, labels: Mapping[str, int]) -> int:
    """See :meth:`tracedb.lake.Lake.set_policy_versions`."""
    rows = policy_labels.check(labels)
    now = datetime.datetime.now(datetime.UTC).replace(tzinfo=None)
    table = pa.table(
        {
            "label": pa.array(list(rows), pa.string()),
            "version": pa.array(list(rows.values()), pa.int64()),
            "set_at": pa.array([now] * len(rows), pa.timestamp("us")),
        }
    )
    target = lake.table(TABLE)
    target.append(table.cast(target.schema().as_arrow()))
    bounds = _bounds(lake, list(rows))
    if not bounds:
        return 0
    load = compact.own_tables(lake.location)

    def change(kept: pa.Table) -> pa.Table:
        ids = kept.column("trace_id").to_pylist()
        for column in BOUNDS:
            held = kept.column(column).to_pylist()
            new = [bounds[t][column] if t in bounds else v for t, v in zip(ids, held, strict=True)]
            index = kept.schema.get_field_index(column)
            kept = kept.set_column(index, kept.schema.field(column), pa.array(new, kept.schema.field(column).type))
        return kept

    compact.rewrite_traces(load, force=True, change=change)
    return len(bounds)


def _bounds(lake: catalog.Opened, labels: list[str]) -> dict[str, dict[str, Any]]:
    """The bounds, under the lake's mapping, of the visible traces whose spans use one of
    ``labels``, by trace id (:func:`tracedb.policy.recompute_bounds` over their rows)."""
    vis = visible_traces(lake.table("traces"), columns=["trace_id", "episode_id", *BOUNDS])
    con = duckdb.connect()
    try:
        con.register("vis", vis)
        spans = lake.table("nodes").scan(selected_fields=("trace_id", catalog.BATCH, "weight_versions")).to_arrow()
        con.register("spans", spans)
        used = con.execute(
            f"SELECT DISTINCT s.trace_id FROM spans s SEMI JOIN vis v ON s.trace_id = v.trace_id "
            f"AND s.{catalog.BATCH} = v.{catalog.BATCH}, unnest(s.weight_versions) AS u(w) "
            "WHERE w.version IN (SELECT unnest(?::VARCHAR[]))",
            [labels],
        ).fetchall()
        ids = [r[0] for r in used]
        if not ids:
            return {}
        con.register("chosen", pa.table({"trace_id": pa.array(ids, pa.string())}))
        con.execute(
            "CREATE TABLE traces AS SELECT trace_id, episode_id, policy_min, policy_max, policy_unknown "
            "FROM vis SEMI JOIN chosen USING (trace_id)"
        )
        episodes = [
            e for e in con.sql("SELECT DISTINCT episode_id FROM traces WHERE episode_id IS NOT NULL").fetchall()
        ]
        raw = scan_keys(lake.table("episodes"), "episode_id", [e[0] for e in episodes])
        con.register("episode_rows", read.stored("episodes", read.visible_rows(con, "episodes", raw)))
        con.execute("CREATE TABLE episodes AS SELECT episode_id, policy_start, work_step FROM episode_rows")
        raw = scan_keys(
            lake.table("nodes"),
            "trace_id",
            ids,
            columns=["trace_id", "node_index", "n_sampled", "weight_versions", "present", "extra", catalog.BATCH],
        )
        con.register("node_rows", read.stored("nodes", read.visible_rows(con, "nodes", raw)))
        con.execute("CREATE TABLE nodes AS SELECT trace_id, node_index, n_sampled, weight_versions FROM node_rows")
        held = mapping(lake)
        con.register(
            "label_rows",
            pa.table(
                {"label": pa.array(list(held), pa.string()), "version": pa.array(list(held.values()), pa.int64())}
            ),
        )
        con.execute("CREATE TABLE policy_labels AS SELECT * FROM label_rows")
        policy.recompute_bounds(con)
        out = con.sql(f"SELECT trace_id, {', '.join(BOUNDS)} FROM traces").to_arrow_table().to_pylist()
    finally:
        con.close()
    return {row["trace_id"]: row for row in out}


__all__ = ["BOUNDS", "TABLE", "mapping", "new_rows", "refuse_other", "seed", "set_versions"]
