"""The lake's layout 3 -> 4: the file store's schema-6 columns (policy versions, dropped
traces, the episodes' work) added to the lake's tables and filled in.

A lake of layout 3 or older may have been written by a tracedb of file-store schema 5
or older: its rows have none of :data:`ADDED`, but hold what they come from in their
records, as a schema-5 file does (a node's weight-version spans among its unknown fields, ``Trace.dropped`` in the
trace's record, ``episode.run.work`` in the episode's). The upgrade adds the columns
(:func:`tracedb.lake.upgrade.add_columns`: Iceberg schema evolution, a metadata commit
per table, no data rewritten), then this fills them with the file store's own 5 -> 6
migration (:data:`tracedb.migrations.MIGRATIONS`) run over the visible rows in a DuckDB
connection of its own, so the values are the ones
``tracedb migrate`` stores in a file of the same records: the spans' column, ``dropped``,
``work_type``, the episodes' work step and policy span, and each trace's policy-version
bounds (:func:`tracedb.policy.recompute_bounds`; such a lake has no label mapping).

Only rows an older writer made are filled (a trace whose ``policy_unknown`` is null:
every trace a version-4 writer stores has a count; an episode or a node whose columns
are all null), each value kept where one is stored already. The rows rewritten: the
nodes of the traces that have spans and the episodes that have work (their rows in every
write, filled by key), and ``traces`` (the visible row per trace id, each keeping its
``seq``: :func:`tracedb.lake.compact.rewrite_traces`), last. Rerun after a crash, it
fills what is left and changes nothing already filled.
"""

from __future__ import annotations

from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.expressions import In

from tracedb import migrations
from tracedb.lake import catalog, compact, read
from tracedb.lake.scan import scan_keys, visible_traces

ADDED = {
    "traces": ("dropped", "policy_min", "policy_max", "policy_unknown", "work_type"),
    "episodes": ("work_type", "work_step", "policy_start", "policy_end"),
    "nodes": ("weight_versions",),
}
"""The columns schema 6 added to the tables a lake of layout 3 holds (``policy_labels``
is a table of its own, made by :func:`tracedb.lake.catalog.create`)."""
MIGRATION = 5
"""The file store's migration whose rules fill :data:`ADDED` (5 -> 6)."""
_NEEDS = {
    "traces": ["trace_id", "episode_id", "record", catalog.BATCH],
    "episodes": ["episode_id", "record", "ingested_at", catalog.BATCH],
    "nodes": ["trace_id", "node_index", "n_sampled", "extra", catalog.BATCH],
}
"""What the migration reads of each table (besides the visibility columns)."""


def fill(load: Any, *, properties: dict[str, str] | None = None) -> dict[str, int]:
    """Fill :data:`ADDED` in the rows an older writer made (see the module's
    docstring); ``properties`` go into the summary of the traces rewrite. Returns the
    rows filled per table (0 everywhere: nothing to do, nothing written)."""
    vis = visible_traces(load("traces"), columns=[*_NEEDS["traces"], "policy_unknown"])
    todo = vis.filter(pc.is_null(vis.column("policy_unknown")))
    if todo.num_rows == 0:
        return {name: 0 for name in ADDED}
    con = duckdb.connect()
    try:
        con.register("vis", todo)
        con.execute("CREATE TABLE traces AS SELECT trace_id, episode_id, record::JSON AS record FROM vis")
        ids = todo.column("trace_id").to_pylist()
        episodes = [e for e in todo.column("episode_id").to_pylist() if e is not None]
        raw = scan_keys(load("episodes"), "episode_id", episodes, columns=_NEEDS["episodes"])
        con.register("episode_rows", read.visible_rows(con, "episodes", raw))
        con.execute("CREATE TABLE episodes AS SELECT episode_id, record::JSON AS record FROM episode_rows")
        raw = scan_keys(load("nodes"), "trace_id", ids, columns=_NEEDS["nodes"])
        con.register("node_rows", read.visible_rows(con, "nodes", raw))
        con.execute("CREATE TABLE nodes AS SELECT trace_id, node_index, n_sampled, extra FROM node_rows")
        migrations.MIGRATIONS[MIGRATION](con)
        traces = con.sql(f"SELECT trace_id, {', '.join(ADDED['traces'])} FROM traces").to_arrow_table()
        works = con.sql(
            f"SELECT episode_id, {', '.join(ADDED['episodes'])} FROM episodes "
            "WHERE work_type IS NOT NULL OR work_step IS NOT NULL OR policy_start IS NOT NULL OR policy_end IS NOT NULL"
        ).to_arrow_table()
        spans = con.sql(
            "SELECT trace_id, node_index, weight_versions FROM nodes WHERE weight_versions IS NOT NULL"
        ).to_arrow_table()
    finally:
        con.close()
    filled = {
        "nodes": _fill_rows(load("nodes"), "trace_id", ["trace_id", "node_index"], spans),
        "episodes": _fill_rows(load("episodes"), "episode_id", ["episode_id"], works),
    }
    done = _by_key(traces, ["trace_id"])

    def change(kept: pa.Table) -> pa.Table:
        return _filled(kept, ["trace_id"], done, only=pc.is_null(kept.column("policy_unknown")))

    compact.rewrite_traces(load, properties=properties, force=True, change=change)
    filled["traces"] = traces.num_rows
    return filled


def _by_key(values: pa.Table, key: list[str]) -> dict[tuple, dict[str, Any]]:
    """The rows of ``values`` by their ``key`` columns."""
    return {tuple(row[k] for k in key): row for row in values.to_pylist()}


def _filled(rows: pa.Table, key: list[str], values: dict[tuple, dict[str, Any]], only: Any = None) -> pa.Table:
    """``rows`` with each of ``values``' columns set where the row's is null (and, given
    ``only``, a boolean array, only in those rows), matched by ``key``."""
    if not values or rows.num_rows == 0:
        return rows
    keys = list(zip(*(rows.column(k).to_pylist() for k in key), strict=True))
    chosen = [True] * rows.num_rows if only is None else only.to_pylist()
    columns = [c for c in next(iter(values.values())) if c not in key]
    for column in columns:
        index = rows.schema.get_field_index(column)
        held = rows.column(column).to_pylist()
        new = [
            values[k][column] if (ok and v is None and k in values) else v
            for k, v, ok in zip(keys, held, chosen, strict=True)
        ]
        rows = rows.set_column(index, rows.schema.field(column), pa.array(new, rows.schema.field(column).type))
    return rows


def _fill_rows(table: Any, column: str, key: list[str], values: pa.Table) -> int:
    """Fill ``values``' columns in every row of ``table`` (each write's) whose ``column``
    is one of theirs, where the row holds none, in one overwrite of those rows; returns
    how many rows were filled."""
    if values.num_rows == 0:
        return 0
    wanted = pc.unique(values.column(column)).to_pylist()
    rows = scan_keys(table, column, wanted)
    by_key = _by_key(values, key)
    new = _filled(rows, key, by_key)
    if new.equals(rows):
        return 0
    target = table.schema().as_arrow()
    table.overwrite(new.select(target.names).cast(target), overwrite_filter=In(column, wanted))
    return rows.num_rows


__all__ = ["ADDED", "MIGRATION", "fill"]
