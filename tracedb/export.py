"""Streaming export of branch views to Parquet or Arrow IPC.

Views are built a batch of whole traces at a time (see ``views.iter_branches``) and
written as they come, so memory stays bounded by the batch size, not the database.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.ipc as ipc
import pyarrow.parquet as pq

from tracedb.handle import Handle
from tracedb.publish import publishing
from tracedb.selection import Selection, watermark_of
from tracedb.sqltext import quote_identifier
from tracedb.tables import BRANCH_SCHEMA
from tracedb.views import iter_branches

FORMATS = {
    ".parquet": "parquet",
    ".pq": "parquet",
    ".arrow": "arrow",
    ".ipc": "arrow",
    ".feather": "arrow",
    ".arrows": "arrows",
}
"""File suffix -> format: ``parquet``, ``arrow`` (IPC file) or ``arrows`` (IPC stream)."""


def export(
    handle: Handle,
    path: str | Path,
    selection: Selection = Selection(),
    *,
    format: str | None = None,
    trainable: bool | None = None,
    columns: Sequence[str] | None = None,
    train_once: bool = False,
    credit: str | None = None,
    batch_tokens: int = 16_000_000,
    compression: str | None = "zstd",
) -> dict[str, Any]:
    """Write the branch views of the selected traces to ``path``.

    ``format`` is ``parquet``, ``arrow`` (IPC file) or ``arrows`` (IPC stream); by
    default it follows the suffix. ``selection``, the filters and ``columns`` are those
    of ``db.branches()``, ``credit`` picks a credit set; ``columns`` may also name
    trace-level fields (``group_id``, ``reward``, ``episode_id``, ``env_id``, any column
    of ``traces``; :func:`trace_fields`) and ingest tags (``tag:NAME``, or the bare name
    of a stored tag; the column is the tag's name), each added per branch row after the
    view's columns. The file is written beside ``path`` (under a name of its own),
    fsynced and renamed into place, the directory fsynced (:mod:`tracedb.publish`), so a
    failed export leaves no partial file, a crash of the machine after the call returned
    loses nothing of it, and concurrent exports to one path do not collide; it gets the
    process umask's mode. Returns
    rows, branches' tokens, bytes and the watermark the selection was read at (also in
    the file's schema metadata, ``tracedb.watermark``). With ``trainable=True`` (a
    trainer's export) dropped traces and eval episodes are left out unless the selection's
    ``include_dropped`` / ``include_eval`` keep them.
    """
    if trainable is True:
        selection = selection.for_training()  # a trainer's export: dropped and eval traces out by default
    path = Path(path)
    fmt = format or FORMATS.get(path.suffix.lower())
    if fmt not in ("parquet", "arrow", "arrows"):
        raise ValueError(f"cannot tell the export format of {path}; use .parquet, .arrow or .arrows, or format=")
    view_columns, extra = split_columns(handle, columns)
    rows = tokens = 0
    mark = None
    # Written under a name of its own beside the target (two exports to one path never
    # share it), fsynced and renamed into place, the directory fsynced (tracedb.publish).
    with publishing(path) as tmp:
        writer: Any = None
        try:
            for table in iter_branches(
                handle,
                selection,
                trainable=trainable,
                columns=view_columns,
                train_once=train_once,
                credit=credit,
                batch_tokens=batch_tokens,
            ):
                if extra:
                    table = with_trace_columns(handle, table, extra)
                if writer is None:  # the file's schema carries the watermark (tracedb.watermark_of)
                    writer = open_writer(fmt, tmp, table.schema, compression)
                    mark = watermark_of(table)
                if table.num_rows:
                    writer.write_table(table)
                    rows += table.num_rows
                    if "token_ids" in table.column_names:
                        tokens += int(pc.sum(pc.list_value_length(table.column("token_ids"))).as_py() or 0)
            if writer is None:  # nothing selected: still a valid, empty file
                empty = BRANCH_SCHEMA.empty_table()
                if extra:
                    empty = with_trace_columns(handle, empty, extra)
                writer = open_writer(fmt, tmp, empty.schema, compression)
        finally:
            if writer is not None:
                writer.close()
    size = path.stat().st_size
    return {"path": str(path), "format": fmt, "rows": rows, "tokens": tokens, "bytes": size, "watermark": mark}


_NOT_FIELDS = {"trace_id", "record", "ingested_at"}  # the key, the stored record, an episode's own ingest time


def trace_fields(handle: Handle) -> dict[str, str]:
    """The trace-level fields an export's ``columns`` may name, each with the SQL that
    reads it (``t``: traces, ``e``: the trace's episode): every column of ``traces`` but
    its record, then the episode's columns that ``traces`` does not have (``env_id``, ...)."""

    def columns_of(table: str) -> list[str]:
        return [r[0] for r in handle.con.execute(f"SELECT * FROM {quote_identifier(table)} LIMIT 0").description]

    fields = {c: f"t.{quote_identifier(c)}" for c in columns_of("traces") if c not in _NOT_FIELDS}
    for c in columns_of("episodes"):
        if c not in fields and c not in _NOT_FIELDS and c not in ("source", "line"):
            fields[c] = f"e.{quote_identifier(c)}"
    return fields


def split_columns(handle: Handle, columns: Sequence[str] | None) -> tuple[list[str] | None, dict[str, str]]:
    """``columns`` as the branch view's columns and the rest: per added column name, the
    SQL giving its value for a trace (a trace field, or a tag: ``tag:NAME`` or a stored
    tag's bare name). ValueError naming what may be asked for, for any other name."""
    if columns is None:
        return None, {}
    fields = trace_fields(handle)
    tags = [r[0] for r in handle.con.execute("SELECT DISTINCT name FROM trace_tags ORDER BY name").fetchall()]
    view: list[str] = []
    extra: dict[str, str] = {}
    for name in columns:
        tag = name.removeprefix("tag:") if name.startswith("tag:") else None
        if tag is None and name in BRANCH_SCHEMA.names:
            view.append(name)
            continue
        if tag is None and name in fields:
            extra[name] = fields[name]
            continue
        tag = name if tag is None else tag
        if tag not in tags:
            raise ValueError(
                f"unknown column {name!r}: an export takes the branch view's columns "
                f"({', '.join(BRANCH_SCHEMA.names)}), trace fields ({', '.join(fields)}) "
                f"and tags (tag:NAME; stored: {', '.join(tags) or 'none'})"
            )
        if tag in extra or tag in view:
            raise ValueError(f"column {tag!r} asked for twice (tag:{tag} is a column named {tag})")
        extra[tag] = _tag_sql(handle, tag)
    return view, extra


def _tag_sql(handle: Handle, name: str) -> str:
    """The SQL of a tag's value for a trace, typed by what is stored: BIGINT when every
    value is a whole number, DOUBLE when they are numbers, VARCHAR when strings, else its JSON."""
    numbers, whole, texts, total = handle.con.execute(
        "SELECT count(number), count(*) FILTER (number = round(number)), count(text), count(*) "
        "FROM trace_tags WHERE name = ?",
        [name],
    ).fetchone()
    if numbers == total:
        value = "CAST(g.number AS BIGINT)" if whole == total else "g.number"
    elif texts == total:
        value = "g.text"
    else:
        value = "CAST(g.value AS VARCHAR)"
    literal = "'" + name.replace("'", "''") + "'"  # a stored tag name, not user SQL: quoted as a literal
    return f"(SELECT {value} FROM trace_tags g WHERE g.trace_id = t.trace_id AND g.name = {literal} LIMIT 1)"


def with_trace_columns(handle: Handle, table: pa.Table, extra: dict[str, str]) -> pa.Table:
    """``table`` (branch rows) with the columns of ``extra`` (:func:`split_columns`) added,
    each row getting its trace's value."""
    select = ", ".join(f"{sql} AS {quote_identifier(name)}" for name, sql in extra.items())
    ids = pc.unique(table.column("trace_id")).to_pylist()
    found = handle.con.sql(
        f"SELECT t.trace_id, {select} FROM traces t LEFT JOIN episodes e USING (episode_id) "
        "WHERE t.trace_id IN (SELECT unnest(?::VARCHAR[]))",
        params=[ids],
    ).to_arrow_table()
    at = pc.index_in(table.column("trace_id"), value_set=found.column("trace_id"))
    for name in extra:
        table = table.append_column(name, found.column(name).take(at))
    return table


def open_writer(fmt: str, path: Path, schema: pa.Schema, compression: str | None) -> Any:
    """A writer of ``fmt`` (parquet, arrow, arrows) at ``path`` for tables of ``schema``
    (``write_table``, ``close``), compressed as an export is."""
    if fmt == "parquet":
        return pq.ParquetWriter(path, schema, compression=compression or "none")
    options = ipc.IpcWriteOptions(compression=compression if compression in ("zstd", "lz4") else None)
    if fmt == "arrow":
        return ipc.new_file(path, schema, options=options)
    return ipc.new_stream(path, schema, options=options)
