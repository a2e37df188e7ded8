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


def _column(arr: pa.Array) -> Any:
    """Row 0 of a one-row column as something orjson writes fast (numpy for lists)."""
    if pa.types.is_map(arr.type):
        entries = arr[0].as_py()  # loss_weights: a few names at most
        return None if entries is None else {k: np.asarray(v, np.float32) for k, v in entries}
    if pa.types.is_list(arr.type) or pa.types.is_large_list(arr.type):
        if arr.null_count:
            return None
        flat = arr.flatten()
        if pa.types.is_boolean(flat.type):
            return flat.to_numpy(zero_copy_only=False).astype(np.bool_)
        return flat.to_numpy(zero_copy_only=False)
    return arr[0].as_py()


def to_json(table: pa.Table) -> bytes:
    """The one row of ``table`` as a JSON object, one key per column."""
    assert table.num_rows == 1
    table = table.combine_chunks()
    return dumps({name: _column(table.column(name).chunk(0)) for name in table.column_names})
