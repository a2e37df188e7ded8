"""Compacting a lake: what readers never see is removed, small files are rewritten.

Each table but ``traces`` is rewritten (one overwrite commit per table) holding only
what a reader can see, with the lake's own :data:`~tracedb.lake.catalog.BATCH` kept:
per-trace rows of the write that committed their trace's row, episodes likewise (one per
episode id), each segment once, rejects once per key, credit sets once per name. Rows
of a write that never committed its traces row are removed only when the file holding
them was added more than ``grace`` seconds ago, so a writer still at work keeps its
rows; a writer committing while a table is being rewritten makes that table's commit
conflict, and the table is read and rewritten again.

``traces`` is left as it is: a trace's ``seq`` is the data sequence number of its file,
which a rewrite by pyiceberg would renumber. (It holds no invisible rows: a traces row
is only committed after the check that no other has that trace id.)
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import duckdb
import pyarrow as pa
from pyiceberg.exceptions import CommitFailedException
from pyiceberg.expressions import AlwaysTrue
from pyiceberg.io.pyarrow import ArrowScan

from tracedb.lake import catalog, read
from tracedb.lake.scan import scan_traces
from tracedb.sqltext import quote_identifier

GRACE_SECONDS = 3600.0
"""Rows of an uncommitted write in a file younger than this are kept (a writer may still
commit its traces row)."""

ATTEMPTS = 5
"""Rewrites of one table tried when writers keep committing to it meanwhile."""

_ADDED = "_tdb_added_ms"


@dataclass
class CompactReport:
    """What a compaction did, per table: rows and files before and after."""

    tables: dict[str, dict[str, int]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"tables": self.tables}


def _scan_with_age(table: Any) -> tuple[pa.Table, int]:
    """Every row of ``table`` with the time (ms) its file was added, and the file count."""
    snapshot = table.current_snapshot()
    if snapshot is None:
        return table.scan().to_arrow().append_column(_ADDED, pa.array([], pa.int64())), 0
    added = {}
    for manifest in snapshot.manifests(table.io):
        for entry in manifest.fetch_manifest_entry(table.io, discard_deleted=True):
            made = table.snapshot_by_id(entry.snapshot_id)
            added[entry.data_file.file_path] = made.timestamp_ms if made is not None else 0
    scan = ArrowScan(table.metadata, table.io, table.schema(), AlwaysTrue())
    tasks = list(table.scan().plan_files())
    parts = []
    for task in tasks:
        part = scan.to_table([task])
        parts.append(part.append_column(_ADDED, pa.array([added[task.file.file_path]] * part.num_rows, pa.int64())))
    if not parts:
        empty = table.scan(limit=0).to_arrow()
        return empty.append_column(_ADDED, pa.array([], pa.int64())), 0
    return pa.concat_tables(parts, promote_options="permissive"), len(tasks)


def _kept_query(name: str, schema: pa.Schema, cutoff_ms: int) -> str:
    """The SQL choosing the rows of ``raw`` that compaction keeps (``vis``: visible traces)."""
    young = f"r.{_ADDED} > {cutoff_ms}"
    if catalog.per_trace(name, schema):
        return (
            f"SELECT r.* FROM raw r WHERE {young} OR EXISTS "
            f"(SELECT 1 FROM vis v WHERE v.trace_id = r.trace_id AND v.{catalog.BATCH} = r.{catalog.BATCH})"
        )
    if name == "episodes":
        return (
            f"SELECT * FROM raw r WHERE {young} UNION ALL SELECT r.* FROM raw r SEMI JOIN vis v "
            f"ON r.episode_id = v.episode_id AND r.{catalog.BATCH} = v.{catalog.BATCH} WHERE NOT {young} "
            f"QUALIFY row_number() OVER (PARTITION BY r.episode_id ORDER BY r.ingested_at, r.{catalog.BATCH}) = 1"
        )
    if name == "segments":
        return (
            f"SELECT * FROM raw r WHERE {young} UNION ALL SELECT r.* FROM raw r WHERE NOT {young} "
            "AND r.segment_id IN (SELECT segment_id FROM used) "
            "QUALIFY row_number() OVER (PARTITION BY r.segment_id ORDER BY r.segment_id) = 1"
        )
    if name == "rejects":
        key = ", ".join(f"r.{quote_identifier(c)}" for c in read.REJECT_KEY)
        return f"SELECT r.* FROM raw r QUALIFY row_number() OVER (PARTITION BY {key} ORDER BY r.rejected_at) = 1"
    if name == "credit_sets":
        return "SELECT r.* FROM raw r QUALIFY row_number() OVER (PARTITION BY r.name ORDER BY r.created_at) = 1"
    return "SELECT r.* FROM raw r"


def compact(lake: catalog.Opened, *, grace: float = GRACE_SECONDS) -> CompactReport:
    """See :meth:`tracedb.lake.Lake.compact`."""
    if grace < 0:
        raise ValueError(f"grace is a number of seconds >= 0, not {grace!r}")
    report = CompactReport()
    for name, schema in catalog.lake_tables().items():
        if name == "traces":
            continue
        for attempt in range(1, ATTEMPTS + 1):
            cutoff = int((time.time() - grace) * 1000)
            traces = scan_traces(lake.table("traces"), AlwaysTrue(), ["trace_id", "episode_id", catalog.BATCH])
            con = duckdb.connect()
            con.register("raw_traces", traces)
            con.execute(
                "CREATE TEMP TABLE vis AS SELECT * FROM raw_traces WHERE seq IS NOT NULL "
                f"QUALIFY row_number() OVER (PARTITION BY trace_id ORDER BY seq, {catalog.BATCH}) = 1"
            )
            if name == "segments":
                nodes, _ = _scan_with_age(lake.table("nodes"))
                con.register("nodes_raw", nodes)
                con.execute(
                    "CREATE TEMP TABLE used AS SELECT DISTINCT n.segment_id FROM nodes_raw n WHERE "
                    f"n.{_ADDED} > {cutoff} OR EXISTS (SELECT 1 FROM vis v WHERE v.trace_id = n.trace_id "
                    f"AND v.{catalog.BATCH} = n.{catalog.BATCH})"
                )
            table = lake.table(name)
            raw, files = _scan_with_age(table)
            con.register("raw", raw)
            kept = con.sql(_kept_query(name, schema, cutoff)).to_arrow_table().drop_columns([_ADDED])
            con.close()
            entry = {"rows_before": raw.num_rows, "rows_after": kept.num_rows, "files_before": files}
            if kept.num_rows == raw.num_rows and files <= 1:
                report.tables[name] = {**entry, "files_after": files}
                break
            try:
                table.overwrite(kept.cast(table.schema().as_arrow()))
            except CommitFailedException:
                if attempt == ATTEMPTS:
                    raise
                continue
            report.tables[name] = {**entry, "files_after": len(list(lake.table(name).scan().plan_files()))}
            break
    return report


__all__ = ["ATTEMPTS", "GRACE_SECONDS", "CompactReport", "compact"]
