"""Where a database file's bytes are: per table and column, metadata, indexes, free space.

DuckDB keeps a file as a header (three 4 KiB headers) and blocks of ``block_size`` bytes
(256 KiB by default). ``pragma_storage_info(table)`` lists every column segment of a
table with the block it starts in (``block_id``), its offset there (``block_offset``) and
any further blocks it spills into (``additional_block_ids``, long strings), but not its
size. So the sizes are derived from the blocks:

- every data block is counted once, over all tables (DuckDB packs small segments of
  several columns, and of several tables, into one block);
- in a block, each segment owns the bytes from its offset to the next segment's offset;
  the last one owns the rest of the block. A segment alone in its block from offset 0
  owns the block (a full-size segment); the last of several shared segments is charged
  the rest of the shared block, of which only a part is its own and the rest unused
  space: that charge is reported as the column's ``tail_bytes`` (an upper bound of the
  segment's size), so the whole block is accounted for;
- a block a segment spills into is that segment's entirely (shared evenly when several
  segments name it; a block that is some segment's first block is never charged twice);
- the blocks of ``pragma_metadata_info`` are the catalog and row-group metadata;
- the other used blocks (``pragma_database_size``'s used blocks less those) are the ART
  indexes of the primary keys, which DuckDB does not list: reported as one figure;
- free blocks (left by deleted or rewritten data, reused by later writes) and the header
  make up the rest, so the parts add up to the file's size exactly.

Segments not yet checkpointed (still in the WAL, or in memory) have no block: their rows
are reported per table as ``rows_not_checkpointed`` and the WAL's size beside the file's.
"""

from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import duckdb

from tracedb.handle import Handle
from tracedb.sqltext import quote_identifier, quote_literal


def _part(path: list[int], kind: str) -> str:
    """The role of a segment within its column: ``validity`` (null bits), ``lists``
    (a list's lengths), ``struct``, ``values`` (a column's own values) or ``child values``
    (a list's or struct's)."""
    if kind == "VALIDITY":
        return "validity"
    if kind.endswith("[]") or kind.startswith("MAP"):
        return "lists"
    if kind.startswith("STRUCT"):
        return "struct"
    return "values" if len(path) == 1 else "child values"


def storage_bytes(handle: Handle) -> dict[str, Any]:
    """The breakdown of the database file's bytes (see the module doc); raises
    ``ValueError`` for an in-memory database, which has no file."""
    if handle.path == ":memory:":
        raise ValueError("an in-memory database has no file to break down")
    return breakdown(handle.con, handle.path)


def breakdown(con: duckdb.DuckDBPyConnection, path: str) -> dict[str, Any]:
    """:func:`storage_bytes` of the database that is ``con``'s default catalog, kept in
    the file ``path``: any DuckDB file, not only tracedb's (the encoding experiments of
    ``benchmarks/encodings.py`` read theirs with it)."""
    size_row = con.execute(
        "SELECT block_size, total_blocks, used_blocks, free_blocks FROM pragma_database_size() "
        "WHERE database_name = current_database()"
    ).fetchone()
    if size_row is None:
        raise ValueError(f"DuckDB reports no size for {path}")
    block_size, total_blocks, used_blocks, free_blocks = (int(v) for v in size_row)
    catalog = con.execute("SELECT current_database()").fetchone()[0]
    metadata_blocks = {
        int(r[0])
        for r in con.execute(f"SELECT block_id FROM pragma_metadata_info({quote_literal(catalog)})").fetchall()
    }
    tables = [
        r[0]
        for r in con.execute(
            "SELECT table_name FROM duckdb_tables() WHERE database_name = current_database() "
            "AND schema_name = current_schema() ORDER BY table_name"
        ).fetchall()
    ]
    segments: list[dict[str, Any]] = []
    columns: dict[str, list[str]] = {}
    rows: dict[str, int] = {}
    pending: dict[str, int] = {}
    for table in tables:
        columns[table] = [
            r[0]
            for r in con.execute(
                "SELECT column_name FROM duckdb_columns() WHERE table_name = ? AND database_name = current_database() "
                "AND schema_name = current_schema() ORDER BY column_index",
                [table],
            ).fetchall()
        ]
        rows[table] = int(con.execute(f"SELECT count(*) FROM {quote_identifier(table)}").fetchone()[0])
        info = con.execute(
            "SELECT column_id, column_path, segment_type, compression, count, persistent, block_id, "
            f"block_offset, additional_block_ids FROM pragma_storage_info({quote_literal(table)})"
        ).fetchall()
        pending[table] = 0
        for column_id, column_path, kind, compression, count, persistent, block_id, offset, extra in info:
            path_ids = json.loads(column_path)
            if not persistent:
                if path_ids == [0]:  # the first column's own segments: one per stretch of rows
                    pending[table] += int(count)
                continue
            if block_id is None or block_id < 0:
                continue  # a constant segment (e.g. no nulls): no bytes of its own
            segments.append(
                {
                    "table": table,
                    "column": columns[table][int(column_id)],
                    "part": _part(path_ids, str(kind)),
                    "compression": str(compression),
                    "block": int(block_id),
                    "offset": int(offset),
                    "extra": [int(b) for b in extra or []],
                    "bytes": 0,
                }
            )
    by_block: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in segments:
        by_block[s["block"]].append(s)
    for block in by_block.values():
        block.sort(key=lambda s: s["offset"])
        shared = len(block) > 1 or block[0]["offset"] > 0
        for here, after in zip(block, block[1:] + [None], strict=True):
            end = block_size if after is None else after["offset"]
            here["bytes"] += max(0, end - here["offset"])
            if after is None and shared:
                here["tail"] = max(0, end - here["offset"])
    spilled: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for s in segments:
        for b in s["extra"]:
            if b not in by_block:
                spilled[b].append(s)
    for holders in spilled.values():
        for s in holders:
            s["bytes"] += block_size / len(holders)
    data_blocks = set(by_block) | set(spilled)

    per_table: dict[str, dict[str, dict[str, Any]]] = {t: {} for t in tables}
    for s in segments:
        col = per_table[s["table"]].setdefault(
            s["column"],
            {"bytes": 0.0, "tail": 0, "segments": 0, "compression": defaultdict(float), "parts": defaultdict(float)},
        )
        col["bytes"] += s["bytes"]
        col["tail"] += s.get("tail", 0)
        col["segments"] += 1
        col["compression"][s["compression"]] += s["bytes"]
        col["parts"][s["part"]] += s["bytes"]

    file = Path(path)
    file_bytes = file.stat().st_size if file.exists() else 0
    wal = Path(path + ".wal")
    out_tables = []
    for table in tables:
        cols = []
        for name in columns[table]:
            c = per_table[table].get(name)
            cols.append(
                {
                    "column": name,
                    "bytes": round(c["bytes"]) if c else 0,
                    "tail_bytes": c["tail"] if c else 0,
                    "segments": c["segments"] if c else 0,
                    "compression": _rounded(c["compression"]) if c else {},
                    "parts": _rounded(c["parts"]) if c else {},
                }
            )
        out_tables.append(
            {
                "table": table,
                "rows": rows[table],
                "rows_not_checkpointed": pending[table],
                "bytes": sum(c["bytes"] for c in cols),
                "tail_bytes": sum(c["tail_bytes"] for c in cols),
                "columns": cols,
            }
        )
    other_used = used_blocks - len(data_blocks) - len(metadata_blocks)
    return {
        "path": path,
        "file_bytes": file_bytes,
        "wal_bytes": wal.stat().st_size if wal.exists() else 0,
        "block_size": block_size,
        "blocks": {
            "total": total_blocks,
            "used": used_blocks,
            "free": free_blocks,
            "data": len(data_blocks),
            "metadata": len(metadata_blocks),
            "indexes": max(0, other_used),
        },
        "data_bytes": len(data_blocks) * block_size,
        "metadata_bytes": len(metadata_blocks) * block_size,
        "index_bytes": max(0, other_used) * block_size,
        "free_bytes": free_blocks * block_size,
        "header_bytes": max(0, file_bytes - total_blocks * block_size),
        "tables": out_tables,
    }


def _rounded(values: dict[str, float]) -> dict[str, int]:
    return {k: round(v) for k, v in sorted(values.items(), key=lambda kv: -kv[1])}


def flat_rows(breakdown: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per column that holds bytes, then the file's other parts: ``table``,
    ``column``, ``bytes``, ``share`` (of the file), ``tail`` (of those bytes, the end of a
    shared block charged to its last segment), ``compression`` (the methods, most bytes
    first). The rows' bytes add up to the file's size."""
    total = breakdown["file_bytes"] or 1
    out: list[dict[str, Any]] = []
    for t in sorted(breakdown["tables"], key=lambda t: -t["bytes"]):
        for c in sorted(t["columns"], key=lambda c: -c["bytes"]):
            if c["bytes"]:
                out.append(
                    {
                        "table": t["table"],
                        "column": c["column"],
                        "bytes": c["bytes"],
                        "share": round(c["bytes"] / total, 4),
                        "tail": c["tail_bytes"],
                        "compression": ", ".join(c["compression"]),
                    }
                )
    for label, key in (
        ("(ART indexes)", "index_bytes"),
        ("(metadata)", "metadata_bytes"),
        ("(free blocks)", "free_bytes"),
        ("(file header)", "header_bytes"),
    ):
        if breakdown[key]:
            out.append(
                {
                    "table": label,
                    "column": "",
                    "bytes": breakdown[key],
                    "share": round(breakdown[key] / total, 4),
                    "tail": 0,
                    "compression": "",
                }
            )
    return out
