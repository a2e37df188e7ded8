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
    of ``db.branches()``, ``credit`` picks a credit set. The file is written beside
    ``path`` (under a name of its own), fsynced and renamed into place, the directory
    fsynced (:mod:`tracedb.publish`), so a failed export leaves no partial file, a crash
    of the machine after the call returned loses nothing of it, and concurrent exports to
    one path do not collide; it gets the process umask's mode. Returns
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
                columns=columns,
                train_once=train_once,
                credit=credit,
                batch_tokens=batch_tokens,
            ):
                if writer is None:  # the file's schema carries the watermark (tracedb.watermark_of)
                    writer = open_writer(fmt, tmp, table.schema, compression)
                    mark = watermark_of(table)
                if table.num_rows:
                    writer.write_table(table)
                    rows += table.num_rows
                    if "token_ids" in table.column_names:
                        tokens += int(pc.sum(pc.list_value_length(table.column("token_ids"))).as_py() or 0)
            if writer is None:  # nothing selected: still a valid, empty file
                writer = open_writer(fmt, tmp, BRANCH_SCHEMA, compression)
        finally:
            if writer is not None:
                writer.close()
    size = path.stat().st_size
    return {"path": str(path), "format": fmt, "rows": rows, "tokens": tokens, "bytes": size, "watermark": mark}


def open_writer(fmt: str, path: Path, schema: pa.Schema, compression: str | None) -> Any:
    """A writer of ``fmt`` (parquet, arrow, arrows) at ``path`` for tables of ``schema``
    (``write_table``, ``close``), compressed as an export is."""
    if fmt == "parquet":
        return pq.ParquetWriter(path, schema, compression=compression or "none")
    options = ipc.IpcWriteOptions(compression=compression if compression in ("zstd", "lz4") else None)
    if fmt == "arrow":
        return ipc.new_file(path, schema, options=options)
    return ipc.new_stream(path, schema, options=options)
