"""Branch views on the wire: Arrow IPC (the library's schema, byte for byte what a
reader of ``db.branches()`` gets) or JSON (lists; float32 at its shortest decimal; null
stays null)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from .errors import dumps

ARROW_STREAM = "application/vnd.apache.arrow.stream"


def wants_arrow(accept: str | None, fmt: str | None) -> bool:
    """Arrow when ``?format=arrow`` or the Accept header names the Arrow stream type."""
    if fmt is not None:
        return fmt == "arrow"
    if not accept:
        return False
    for part in accept.split(","):
        media, *params = (p.strip() for p in part.split(";"))
        if media.lower() == ARROW_STREAM and not any(p.replace(" ", "") in ("q=0", "q=0.0") for p in params):
            return True
    return False


def to_arrow(table: pa.Table) -> bytes:
    """An Arrow IPC stream of ``table`` with its schema unchanged."""
    sink = pa.BufferOutputStream()
    with ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def list_cells(column: pa.ChunkedArray | pa.Array) -> list[np.ndarray | None]:
    """A list column as one numpy array per row (None for a null list), all views of one
    buffer: linear in the column, whatever its number of rows or chunks."""
    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    values = arr.values.to_numpy(zero_copy_only=False)
    if pa.types.is_boolean(arr.values.type):
        values = values.astype(np.bool_)
    offsets = arr.offsets.to_numpy()
    valid = arr.is_valid().to_numpy(zero_copy_only=False)
    return [values[offsets[i] : offsets[i + 1]] if valid[i] else None for i in range(len(arr))]


def _cells(column: pa.ChunkedArray) -> list[Any]:
    """Each row's value of a column as something orjson writes fast (numpy for lists)."""
    kind = column.type
    if pa.types.is_map(kind):  # loss_weights: a few names at most
        return [
            None if entries is None else {k: np.asarray(v, np.float32) for k, v in entries}
            for entries in column.to_pylist()
        ]
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        return list_cells(column)
    return column.to_pylist()


def json_rows(table: pa.Table) -> list[bytes]:
    """Each row of ``table`` as a JSON object, one key per column. Each column is
    converted once, so the cost is linear in the table (never a slice per row)."""
    names = table.column_names
    columns = [_cells(table.column(name)) for name in names]
    return [dumps(dict(zip(names, row, strict=True))) for row in zip(*columns, strict=True)]


def to_json(table: pa.Table) -> bytes:
    """The one row of ``table`` as a JSON object, one key per column."""
    assert table.num_rows == 1
    return json_rows(table)[0]
