"""Column builders both parse paths share: list arrays and the segments' content address."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np
import pyarrow as pa


def list_array(offsets: np.ndarray, values: pa.Array, null: np.ndarray) -> pa.Array:
    """A list array over ``values`` (``offsets``: each list's start, then the end), null
    where ``null``; 64-bit offsets only when the values need them."""
    # From its buffers: ListArray.from_arrays with a mask imports pyarrow.compute (~40 ms),
    # which an ingest by the parser needs nowhere else.
    kind, width = (pa.list_, np.int32) if offsets[-1] < 2**31 else (pa.large_list, np.int64)
    bitmap = pa.py_buffer(np.packbits(~null, bitorder="little")) if null.any() else None
    out = pa.Array.from_buffers(
        kind(values.type), len(null), [bitmap, pa.py_buffer(offsets.astype(width))], children=[values]
    )
    out.validate()
    return out


def numpy_lists(chunks: Sequence[np.ndarray | None], value_type: pa.DataType) -> pa.Array:
    """A list array from numpy chunks (None = a null list) with one copy of the values."""
    lengths = np.fromiter((0 if c is None else len(c) for c in chunks), dtype=np.int64, count=len(chunks))
    offsets = np.zeros(len(chunks) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    present = [c for c in chunks if c is not None and len(c)]
    dtype = value_type.to_pandas_dtype()
    values = pa.array(np.concatenate(present).astype(dtype, copy=False) if present else np.zeros(0, dtype), value_type)
    return list_array(offsets, values, np.fromiter((c is None for c in chunks), dtype=bool, count=len(chunks)))


def segment_keys(tokens: np.ndarray, offsets: Sequence[int] | np.ndarray) -> list[bytes]:
    """Content addresses of the token segments ``tokens[offsets[k]:offsets[k + 1]]``:
    128-bit BLAKE2b of their int32 ids (the ``segments`` table's key)."""
    view = memoryview(np.ascontiguousarray(tokens, dtype=np.int32)).cast("B")
    ends = (np.asarray(offsets, dtype=np.int64) * 4).tolist()
    blake2b = hashlib.blake2b
    return [blake2b(view[a:b], digest_size=16).digest() for a, b in zip(ends[:-1], ends[1:], strict=True)]


def segment_key(tokens: np.ndarray) -> bytes:
    """The content address of one token segment (see :func:`segment_keys`)."""
    return segment_keys(tokens, [0, len(tokens)])[0]
