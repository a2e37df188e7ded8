"""Moving traces between a file store and a lake: rows of a file store handed to the
lake's writer (``push``; also what a Ray ingest task hands over), and a lake's visible
rows written into a file store (``pull``; also what a Ray view worker computes on)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import pyarrow as pa

from tracedb.database import Database
from tracedb.lake.catalog import lake_tables, per_trace
from tracedb.sqltext import quote_identifier

PUSH_TRACES = 5_000
"""Traces per lake write when pushing a file store (each write is one traces commit)."""


def file_rows(db: Database, trace_ids: Sequence[str], *, rejects: bool = True) -> dict[str, pa.Table]:
    """The rows of ``trace_ids`` in every table the lake mirrors that ``db`` has (its
    episodes and segments; all credit sets; all rejects when ``rejects``), by name."""
    handle = db.handle
    present = handle.table_names()
    out: dict[str, pa.Table] = {}
    chosen = "SELECT trace_id FROM _tdb_push"
    with handle.registered("_tdb_push", pa.table({"trace_id": pa.array(list(trace_ids), pa.string())})):
        for name, schema in lake_tables().items():
            if name not in present:
                continue
            table = quote_identifier(name)
            if per_trace(name, schema):
                query = f"SELECT * FROM {table} WHERE trace_id IN ({chosen})"
            elif name == "episodes":
                query = (
                    f"SELECT * FROM {table} WHERE episode_id IN "
                    f"(SELECT episode_id FROM traces WHERE trace_id IN ({chosen}))"
                )
            elif name == "segments":
                query = (
                    f"SELECT * FROM {table} WHERE segment_id IN "
                    f"(SELECT segment_id FROM nodes WHERE trace_id IN ({chosen}))"
                )
            elif name == "rejects" and not rejects:
                continue
            else:
                query = f"SELECT * FROM {table}"
            out[name] = handle.sql(query)
    return out


def file_chunks(db: Database, size: int = PUSH_TRACES) -> Iterator[dict[str, pa.Table]]:
    """:func:`file_rows` of all of ``db``'s traces, ``size`` traces at a time in sequence
    order (rejects with the first chunk)."""
    ids = db.sql("SELECT trace_id FROM traces ORDER BY seq, trace_id").column("trace_id").to_pylist()
    if not ids:
        yield file_rows(db, [])
        return
    for start in range(0, len(ids), size):
        yield file_rows(db, ids[start : start + size], rejects=start == 0)


_SAME = {
    "episodes": "x.episode_id = r.episode_id",
    "segments": "x.segment_id = r.segment_id",
    "credit_sets": "x.name = r.name",
    "rejects": " AND ".join(
        f"x.{c} IS NOT DISTINCT FROM r.{c}" for c in ("source", "line", "trace_id", "node", "field", "reason")
    ),
}
"""When a row of a table that is not per trace is held already (not written again)."""


def write_into(db: Database, rows: dict[str, pa.Table]) -> int:
    """Write a lake's visible rows (:func:`tracedb.lake.read.visible`) into ``db``: the
    traces it does not hold yet, in the lake's order, numbered on from its watermark
    (``seq`` counts a file's own commits), with their rows; credit sets and rejects it
    lacks. One transaction. Returns the number of traces added."""
    handle = db.handle
    present = handle.table_names()
    traces = rows["traces"]
    with handle.transaction():
        held = set(handle.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist())
        new = [t for t in traces.column("trace_id").to_pylist() if t not in held]
        mark = handle.watermark()
        with handle.registered("_tdb_new", pa.table({"trace_id": pa.array(new, pa.string())})):
            for name, schema in lake_tables().items():
                table = rows.get(name)
                if name not in present or table is None or table.num_rows == 0:
                    continue
                target = quote_identifier(name)
                with handle.registered("_tdb_rows", table):
                    if name == "traces":
                        select = (
                            f"SELECT * REPLACE ({mark} + row_number() OVER (ORDER BY seq, trace_id) AS seq) "
                            "FROM _tdb_rows WHERE trace_id IN (SELECT trace_id FROM _tdb_new)"
                        )
                    elif per_trace(name, schema):
                        select = "SELECT * FROM _tdb_rows WHERE trace_id IN (SELECT trace_id FROM _tdb_new)"
                    else:
                        select = (
                            f"SELECT * FROM _tdb_rows r WHERE NOT EXISTS (SELECT 1 FROM {target} x WHERE {_SAME[name]})"
                        )
                    handle.con.execute(f"INSERT INTO {target} BY NAME {select}")
        if new:
            handle.con.execute("INSERT OR REPLACE INTO tracedb_meta VALUES ('last_seq', ?)", [str(mark + len(new))])
    return len(new)
