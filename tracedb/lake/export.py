"""Exporting a lake's branch views to a file: ``tracedb export`` of the lake's traces.

The driver resolves the selection over the lake's rows (:mod:`tracedb.lake.select`; a
trainer's export, ``trainable=True``, leaves dropped traces and eval episodes out unless
the selection keeps them, as the file store's does), then pulls the selected traces into
an in-memory tracedb ``traces_per_chunk`` at a time (whole groups, in group order) and
writes each chunk's views (:meth:`tracedb.Database.branches`, the same kernels) to the
file, so memory holds one chunk. The file is published as the file store's export is
(written beside the path, fsynced, renamed into place) and its schema carries the lake's
watermark the selection was read at (``tracedb.watermark``: the ``after`` of the next
export). No Ray is needed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow.compute as pc

from tracedb.database import connect
from tracedb.export import FORMATS, open_writer
from tracedb.lake import catalog, move, read
from tracedb.lake.select import resolved
from tracedb.lake.workers import chunks
from tracedb.publish import publishing
from tracedb.selection import Selection, with_watermark

CHUNK_TRACES = 256
"""Traces pulled into memory at a time."""


def export(
    lake: catalog.Opened,
    path: str | Path,
    selection: Selection,
    *,
    format: str | None = None,
    trainable: bool | None = None,
    columns: list[str] | None = None,
    train_once: bool = False,
    credit: str | None = None,
    compression: str | None = "zstd",
    traces_per_chunk: int = CHUNK_TRACES,
) -> dict[str, Any]:
    """See :meth:`tracedb.lake.Lake.export`."""
    if not isinstance(traces_per_chunk, int) or traces_per_chunk < 1:
        raise ValueError(f"traces_per_chunk is a number of traces (an int >= 1), not {traces_per_chunk!r}")
    if trainable is True:
        selection = selection.for_training()
    path = Path(path)
    fmt = format or FORMATS.get(path.suffix.lower())
    if fmt not in ("parquet", "arrow", "arrows"):
        raise ValueError(f"cannot tell the export format of {path}; use .parquet, .arrow or .arrows, or format=")
    ids, selected = resolved(lake, selection)
    options = dict(trainable=trainable, columns=columns, train_once=train_once, credit=credit)
    rows = tokens = 0
    with publishing(path) as tmp:
        writer: Any = None
        try:
            for part in chunks(ids, traces_per_chunk) or [[]]:
                with connect(":memory:") as db:
                    move.write_into(db, read.visible(lake, trace_ids=part))
                    table = db.branches(**options)
                table = with_watermark(table.replace_schema_metadata(None), selected.watermark)
                if writer is None:
                    writer = open_writer(fmt, tmp, table.schema, compression)
                if table.num_rows:
                    writer.write_table(table)
                    rows += table.num_rows
                    if "token_ids" in table.column_names:
                        tokens += int(pc.sum(pc.list_value_length(table.column("token_ids"))).as_py() or 0)
        finally:
            if writer is not None:
                writer.close()
    return {
        "path": str(path),
        "format": fmt,
        "rows": rows,
        "tokens": tokens,
        "bytes": path.stat().st_size,
        "watermark": selected.watermark,
    }


__all__ = ["CHUNK_TRACES", "export"]
