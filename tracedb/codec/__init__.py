"""How the per-token arrays are kept in the file: as text, one character per value.

DuckDB 2.0 compresses strings with zstd (``USING COMPRESSION zstd``, a frame per vector of
2,048 rows) but integers and lists only by bit-packing, which has no entropy coding and
sees no repeats: real token ids (a BPE vocabulary's Zipf ids, long repeated spans) and
confident logprobs (mostly near zero) compress 4-5x better as zstd text. So a row's
values are written as a string of code points, which any DuckDB client decodes
(``schema/encoded.sql``: ``tdb_tokens``, ``tdb_stream``) and tracedb decodes in bulk here.

**Values as characters.** A value ``u`` in ``0..UMAX`` is the character ``U+(u + 32)``,
the surrogates skipped (``+ 0x800`` from ``U+D800`` on): no control character, every
string valid UTF-8; small values take one byte.

**Token ids** (``segments``): one character per id, no header (ids beyond ``0..UMAX``
stay an ``INTEGER[]``; see :func:`token_form`).

**Streams** (``nodes.logprobs``, ``advantages``, ..., and each list of ``loss_weights``):
per row, the first character is its form, then

- ``+d`` / ``-d`` / ``~d`` (``d`` a digit, the decimals): **fixed point**: every value is
  ``m / 10**d`` for a whole ``m`` (by the float32 the division rounds to: verifiers
  writes 4 decimals), the characters are the ``m``: all non-negative (``+``), all with
  the sign bit set (``-``: ``-0.0`` included), or ``2 m + sign`` (``~``);
- ``=``: **decimals**: the values as the shortest decimals that read back to the same
  float32, comma-separated (any other float: a computed credit, ``0.0833333358168602``).

Either way a row decodes to exactly the float32 values that were ingested (bit for bit,
the sign of zero too) and prints as the same shortest decimal as before: for a fixed row,
``m / 10**d`` is the only decimal of ``d`` places in the float32's rounding interval (the
interval is narrower than ``10**-d`` in the range ``m <= UMAX`` holds).

Encoding and decoding run compiled (:mod:`tracedb.codec._kernels`) for large inputs and
in numpy and Python's codecs for small ones (no compilation for a small file): the same
text either way, tested against each other.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import pyarrow as pa

from tracedb.codec.constants import (
    BASE,
    DECIMAL,
    GAP,
    MAX_DECIMALS,
    MIXED,
    NONNEG,
    NONPOS,
    POW10,
    SURROGATE,
    UMAX,
)

__all__ = [
    "UMAX",
    "KERNEL_VALUES",
    "token_text",
    "token_form",
    "token_values",
    "stream_text",
    "stream_values",
    "stream_lists",
    "stream_form",
    "stream_columns",
    "loss_weights_text",
    "loss_weights_values",
]

KERNEL_VALUES = 50_000
"""Inputs of more values than this go through the compiled loops, smaller ones through
numpy (loading the compiled loops costs more than encoding a few thousand values)."""

Parts = tuple[np.ndarray, np.ndarray, np.ndarray]
"""(values, offsets (rows + 1) into values, validity per row)."""


def _compiled() -> Any:
    import tracedb.codec._kernels as kernels

    return kernels


# --------------------------------------------------------------------------- characters


def codes(values: np.ndarray) -> np.ndarray:
    """The code points of ``values`` (each in ``0..UMAX``)."""
    c = np.asarray(values, np.int64) + BASE
    return np.where(c >= SURROGATE, c + GAP, c)


def values_of(code_points: np.ndarray) -> np.ndarray:
    """The values of code points (the inverse of :func:`codes`)."""
    c = np.asarray(code_points, np.int64)
    return np.where(c >= 0xE000, c - BASE - GAP, c - BASE)


def _text(values: np.ndarray) -> str:
    return codes(values).astype("<u4").tobytes().decode("utf-32-le")


def _string_array(offsets: np.ndarray, data: np.ndarray, valid: np.ndarray | None) -> pa.Array:
    """A string array over UTF-8 ``data`` cut at ``offsets`` (null where not ``valid``)."""
    n = len(offsets) - 1
    mask = None if valid is None or valid.all() else pa.array(valid).buffers()[1]
    nulls = 0 if mask is None else int((~valid).sum())
    if offsets[-1] < 2**31:
        return pa.StringArray.from_buffers(n, pa.py_buffer(offsets.astype(np.int32)), pa.py_buffer(data), mask, nulls)
    large = pa.LargeStringArray.from_buffers(n, pa.py_buffer(offsets.astype(np.int64)), pa.py_buffer(data), mask, nulls)
    return large


def _utf8_parts(text: pa.Array) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(bytes, offsets into them per row, validity) of one string array."""
    if pa.types.is_large_string(text.type):
        offsets = np.frombuffer(text.buffers()[1], np.int64)[text.offset : text.offset + len(text) + 1]
    else:
        offsets = np.frombuffer(text.buffers()[1], np.int32)[text.offset : text.offset + len(text) + 1]
    data_buf = text.buffers()[2]
    data = np.frombuffer(data_buf, np.uint8) if data_buf is not None else np.zeros(0, np.uint8)
    valid = text.is_valid().to_numpy(zero_copy_only=False) if text.null_count else np.ones(len(text), bool)
    return data, offsets.astype(np.int64), valid


def _chunks(text: pa.Array | pa.ChunkedArray) -> list[pa.Array]:
    if isinstance(text, pa.ChunkedArray):
        return list(text.chunks) or [pa.array([], text.type)]
    return [text]


# --------------------------------------------------------------------------- tokens


def token_form(ids: np.ndarray, sample_bytes: int = 1 << 18) -> str:
    """``"text"`` when ``ids`` are better kept as text (zstd) than as a bit-packed list,
    else ``"list"``: ids outside ``0..UMAX`` are always a list; otherwise a sample of the
    text is compressed with zstd (level 3, as DuckDB does) and compared with the bits
    DuckDB's bit-packing gives every id (the widest id's). Uniform ids (a synthetic
    workload's) pack better; real text under a BPE vocabulary compresses far better."""
    import zstandard

    ids = np.asarray(ids)
    if not len(ids):
        return "text"
    lo, hi = int(ids.min()), int(ids.max())
    if lo < 0 or hi > UMAX:
        return "list"
    width = max(hi, 1).bit_length()
    # A sample of whole runs from the start, middle and end (repeats are what zstd finds).
    take = max(1, sample_bytes // 3)
    if len(ids) <= 3 * take:  # (overlapping parts would repeat, and zstd would find that)
        sample = ids
    else:
        mid = len(ids) // 2
        sample = np.concatenate([ids[:take], ids[mid : mid + take], ids[-take:]])
    raw = _text(sample).encode("utf-8")
    packed = zstandard.ZstdCompressor(level=3).compress(raw)
    return "text" if len(packed) * 8 < 0.85 * width * len(sample) else "list"


def token_text(ids: np.ndarray, offsets: np.ndarray) -> pa.Array:
    """Rows of token ids (``ids[offsets[r]:offsets[r + 1]]``, each in ``0..UMAX``) as text."""
    ids = np.ascontiguousarray(ids)
    offsets = np.asarray(offsets, np.int64)
    n = len(offsets) - 1
    if len(ids) > KERNEL_VALUES:
        k = _compiled()
        sizes = np.empty(n, np.int64)
        if not k.text_sizes(ids, offsets, sizes):
            raise ValueError(f"token ids outside 0..{UMAX} cannot be kept as text")
        out_off = np.zeros(n + 1, np.int64)
        np.cumsum(sizes, out=out_off[1:])
        data = np.empty(int(out_off[-1]), np.uint8)
        k.write_text(ids, offsets, out_off, data)
        return _string_array(out_off, data, None)
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) > UMAX):
        raise ValueError(f"token ids outside 0..{UMAX} cannot be kept as text")
    text = _text(ids)
    return pa.array([text[offsets[r] : offsets[r + 1]] for r in range(n)], pa.string())


def token_values(text: pa.Array | pa.ChunkedArray, counts: np.ndarray | None = None) -> Parts:
    """The token ids of text rows: (int32 ids, offsets, validity). ``counts``, the ids each
    row holds (``segments.n_tokens``; 0 for a null row), spares the pass that counts them
    (they are counted after all when a row's text disagrees)."""
    return _decode(text, skip=0, dtype=np.int32, counts=counts)


# --------------------------------------------------------------------------- streams


def _plan(values: np.ndarray, offsets: np.ndarray, valid: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row: form (``+``, ``-``, ``~`` as their bytes; 0: decimals) and decimals, in numpy."""
    n = len(offsets) - 1
    form = np.zeros(n, np.uint8)
    dec = np.zeros(n, np.uint8)
    lengths = np.diff(offsets)
    t = np.abs(values.astype(np.float32, copy=False))
    a = t.astype(np.float64)
    need = np.full(len(values), -1, np.int64)
    todo = np.arange(len(values))
    for d in range(MAX_DECIMALS + 1):
        if not len(todo):
            break
        m = np.floor(a[todo] * POW10[d] + 0.5)
        ok = (m <= UMAX) & ((m / POW10[d]).astype(np.float32) == t[todo])
        need[todo[ok]] = d
        todo = todo[~ok]
    rows = np.repeat(np.arange(n), lengths)
    row_d = np.zeros(n, np.int64)
    failed = np.zeros(n, bool)
    if len(values):
        np.maximum.at(row_d, rows, need)
        failed[rows[need < 0]] = True
    d = row_d[rows]
    m = np.floor(a * POW10[d] + 0.5)
    sign = np.signbit(values)
    negatives = np.bincount(rows, weights=sign, minlength=n)
    kind = np.where(negatives == 0, NONNEG, np.where(negatives == lengths, NONPOS, MIXED))
    u = np.where(kind[rows] == MIXED, 2 * m + sign, m)
    bad = (u > UMAX) | ((m / POW10[d]).astype(np.float32) != t)
    failed[rows[bad]] = True
    fixed = valid & ~failed
    form[fixed] = kind[fixed]
    dec[fixed] = row_d[fixed]
    return form, dec


def _decimals(values: np.ndarray) -> str:
    """``=`` and the values as shortest float32 decimals, comma-separated."""
    if not len(values):
        return "="
    return "=" + ",".join(pa.array(values, pa.float32()).cast(pa.string()).to_pylist())


def stream_text(values: np.ndarray, offsets: np.ndarray, valid: np.ndarray) -> pa.Array:
    """Rows of a float32 stream (``values[offsets[r]:offsets[r + 1]]``, null where not
    ``valid``) as their text (see the module doc)."""
    values = np.ascontiguousarray(values, np.float32)
    offsets = np.asarray(offsets, np.int64)
    valid = np.asarray(valid, bool)
    n = len(offsets) - 1
    if len(values) > KERNEL_VALUES:
        k = _compiled()
        form = np.empty(n, np.uint8)
        dec = np.empty(n, np.uint8)
        sizes = np.empty(n, np.int64)
        k.stream_plan(values, offsets, valid, form, dec, sizes)
        other = np.flatnonzero(valid & (form == 0))
        texts = {int(r): _decimals(values[offsets[r] : offsets[r + 1]]).encode() for r in other}
        for r, t in texts.items():
            sizes[r] = len(t)
        out_off = np.zeros(n + 1, np.int64)
        np.cumsum(sizes, out=out_off[1:])
        data = np.empty(int(out_off[-1]), np.uint8)
        k.write_streams(values, offsets, form, dec, out_off, data)
        for r, t in texts.items():
            data[out_off[r] : out_off[r + 1]] = np.frombuffer(t, np.uint8)
        return _string_array(out_off, data, valid)
    form, dec = _plan(values, offsets, valid)
    out: list[str | None] = []
    for r in range(n):
        if not valid[r]:
            out.append(None)
            continue
        row = values[offsets[r] : offsets[r + 1]]
        if form[r] == 0:
            out.append(_decimals(row))
            continue
        m = np.floor(np.abs(row).astype(np.float64) * POW10[dec[r]] + 0.5)
        if form[r] == MIXED:
            m = 2 * m + np.signbit(row)
        out.append(chr(form[r]) + chr(48 + dec[r]) + _text(m))
    return pa.array(out, pa.string())


def stream_lists(lists: pa.Array | pa.ChunkedArray) -> pa.Array:
    """A ``FLOAT[]`` column (Arrow list of float32) as its text column."""
    arr = lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists
    if pa.types.is_null(arr.type):
        return pa.nulls(len(arr), pa.string())
    arr = arr.cast(pa.list_(pa.float32())) if arr.type != pa.list_(pa.float32()) else arr
    offsets = arr.offsets.to_numpy().astype(np.int64)
    values = arr.values.to_numpy(zero_copy_only=False)
    valid = arr.is_valid().to_numpy(zero_copy_only=False) if arr.null_count else np.ones(len(arr), bool)
    base = offsets[0]
    return stream_text(values[base : offsets[-1]], offsets - base, valid)


LIST_GROUP = 1024
"""Values DuckDB compresses a float list's values in groups of (ALP: a frame of reference
and one bit width per group)."""


def stream_form(values: np.ndarray, sample_values: int = 1 << 16) -> str:
    """``"text"`` when a batch's stream ``values`` are kept in clearly fewer bytes as text
    (zstd) than as a ``FLOAT[]`` list, else ``"list"`` (read several times faster: no
    decode). The list's bytes are estimated as DuckDB's ALP stores fixed-point floats
    (each group of :data:`LIST_GROUP` values at the bit width of its range; 32 bits a
    value when they are not ``m / 10**d``) or run-length encoded (an advantage repeated
    over a node's tokens), whichever is smaller, the text's by compressing a sample of it with
    zstd (level 3, as DuckDB does). Uniform logprobs (a synthetic workload's) come out
    about even, and stay lists; a policy's confident ones, mostly near 0, compress 3-4x
    as text."""
    import zstandard

    values = np.asarray(values, np.float32)
    if not len(values):
        return "list"
    take = max(1, sample_values // 3)
    if len(values) > 3 * take:
        mid = len(values) // 2
        values = np.concatenate([values[:take], values[mid : mid + take], values[-take:]])
    a = np.abs(values).astype(np.float64)
    for d in range(MAX_DECIMALS + 1):
        m = np.floor(a * POW10[d] + 0.5)
        if m.max() <= UMAX and np.array_equal((m / POW10[d]).astype(np.float32), a.astype(np.float32)):
            break
    else:
        return "list"  # not fixed point: the text would be decimals
    sign = np.signbit(values)
    m = m.astype(np.int64)
    fixed = np.where(sign, -m, m)
    pad = -len(fixed) % LIST_GROUP
    groups = np.concatenate([fixed, np.repeat(fixed[-1:], pad)]).reshape(-1, LIST_GROUP)
    widths = np.ceil(np.log2(groups.max(axis=1) - groups.min(axis=1) + 1.0))
    list_bits = float(widths.sum()) * LIST_GROUP + 64 * len(widths)
    runs = 1 + int(np.count_nonzero(fixed[1:] != fixed[:-1]))
    list_bits = min(list_bits, 48.0 * runs)  # or run-length encoded: a value and a count per run
    points = 2 * m + sign if sign.any() and not sign.all() else m
    text_bits = 8 * len(zstandard.ZstdCompressor(level=3).compress(_text(points).encode("utf-8")))
    return "text" if text_bits < 0.85 * list_bits else "list"


def stream_columns(lists: pa.Array | pa.ChunkedArray) -> tuple[pa.Array, pa.Array]:
    """A batch's ``FLOAT[]`` stream column as the two columns that keep it: (text, list),
    one of them all null, by :func:`stream_form`."""
    arr = lists.combine_chunks() if isinstance(lists, pa.ChunkedArray) else lists
    n = len(arr)
    if pa.types.is_null(arr.type) or arr.null_count == n:
        return pa.nulls(n, pa.string()), pa.nulls(n, pa.list_(pa.float32()))
    arr = arr.cast(pa.list_(pa.float32())) if arr.type != pa.list_(pa.float32()) else arr
    offsets = arr.offsets.to_numpy()
    if stream_form(arr.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]) == "list":
        return pa.nulls(n, pa.string()), arr
    return stream_lists(arr), pa.nulls(n, pa.list_(pa.float32()))


def stream_values(text: pa.Array | pa.ChunkedArray) -> Parts:
    """The float32 values of stream text rows: (values, offsets, validity)."""
    return _decode(text, skip=2, dtype=np.float32)


def _decode(text: pa.Array | pa.ChunkedArray, skip: int, dtype: type, counts: np.ndarray | None = None) -> Parts:
    if isinstance(text, pa.ChunkedArray) and text.num_chunks > 1:
        # One array (DuckDB hands over a chunk per vector of rows): one pass over all of it.
        size = sum(c.buffers()[2].size for c in text.chunks if c.buffers()[2] is not None)
        text = (text.cast(pa.large_string()) if size >= 2**31 else text).combine_chunks()
    chunks = _chunks(text)
    return _decode_chunk(chunks[0], skip, dtype, counts)


PARALLEL_BYTES = 1 << 20
"""Text of more bytes than this is decoded by several threads (the compiled loops run
without the GIL), each a part of the rows."""

_POOL: list[ThreadPoolExecutor] = []
os.register_at_fork(after_in_child=_POOL.clear)  # a forked child has none of the pool's threads


def _parts(offsets: np.ndarray) -> list[tuple[int, int]]:
    """Row ranges of about equal bytes, one per thread (one for small text)."""
    n = len(offsets) - 1
    total = int(offsets[-1] - offsets[0])
    threads = min(os.cpu_count() or 1, 8) if total > PARALLEL_BYTES else 1
    if threads == 1 or n < threads:
        return [(0, n)]
    marks = np.searchsorted(offsets, np.linspace(offsets[0], offsets[-1], threads + 1)[1:-1])
    cuts = [0, *sorted({int(m) for m in marks if 0 < m < n}), n]
    return list(zip(cuts[:-1], cuts[1:], strict=True))


def _each(parts: list[tuple[int, int]], fn: Any) -> None:
    """``fn(a, b)`` for each row range, on the pool's threads when there are several."""
    if len(parts) == 1:
        fn(*parts[0])
        return
    if not _POOL:
        _POOL.append(ThreadPoolExecutor(max_workers=min(os.cpu_count() or 1, 8), thread_name_prefix="tdb-codec"))
    for future in [_POOL[0].submit(fn, a, b) for a, b in parts]:
        future.result()


def _decode_chunk(text: pa.Array, skip: int, dtype: type, known: np.ndarray | None = None) -> Parts:
    n = len(text)
    if n == 0:
        return np.zeros(0, dtype), np.zeros(1, np.int64), np.zeros(0, bool)
    data, offsets, valid = _utf8_parts(text)
    if len(data) > KERNEL_VALUES:
        k = _compiled()
        parts = _parts(offsets)
        if not skip and known is not None and len(known) == n:
            out_off = np.zeros(n + 1, np.int64)
            np.cumsum(np.where(valid, known, 0), out=out_off[1:])
            out = np.zeros(int(out_off[-1]), dtype)
            exact = [True]
            _each(parts, lambda a, b: exact.append(k.read_text(data, offsets[a : b + 1], out_off[a : b + 1], out)))
            if all(exact):
                return out, out_off, valid
        counts = np.empty(n, np.int64)
        _each(parts, lambda a, b: k.text_counts(data, offsets[a : b + 1], skip, counts[a:b]))
        out_off = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=out_off[1:])
        out = np.zeros(int(out_off[-1]), dtype)
        read = k.read_streams if skip else k.read_text
        _each(parts, lambda a, b: read(data, offsets[a : b + 1], out_off[a : b + 1], out))
        if skip:
            _decimal_rows(data, offsets, out_off, out)
        return out, out_off, valid
    rows: list[np.ndarray] = []
    lengths = np.zeros(n, np.int64)
    for r in np.flatnonzero(valid & (offsets[1:] > offsets[:-1])).tolist():  # (a null row holds no text)
        lo, hi = int(offsets[r]), int(offsets[r + 1])
        rows.append(_row_values(bytes(data[lo:hi]), skip, dtype))
        lengths[r] = len(rows[-1])
    out_off = np.zeros(n + 1, np.int64)
    np.cumsum(lengths, out=out_off[1:])
    values = np.concatenate(rows).astype(dtype, copy=False) if rows else np.zeros(0, dtype)
    return values, out_off, valid


def _decimal_rows(data: np.ndarray, offsets: np.ndarray, out_off: np.ndarray, out: np.ndarray) -> None:
    """The rows written as decimals (``=``), parsed into their places."""
    starts = offsets[:-1]
    nonempty = offsets[1:] > starts
    rows = np.flatnonzero(nonempty & (data[np.minimum(starts, max(len(data) - 1, 0))] == DECIMAL))
    for r in rows.tolist():
        lo, hi = int(offsets[r]), int(offsets[r + 1])
        out[out_off[r] : out_off[r + 1]] = _decimal_values(bytes(data[lo + 1 : hi]).decode())


def _decimal_values(text: str) -> np.ndarray:
    if not text:
        return np.zeros(0, np.float32)
    import pyarrow.compute as pc  # here: a small ingest imports none of it

    return pc.cast(pa.array(text.split(",")), pa.float32()).to_numpy(zero_copy_only=False)


def _row_values(raw: bytes, skip: int, dtype: type) -> np.ndarray:
    """One row's values (the reference decoder)."""
    if not skip:
        return values_of(np.frombuffer(raw.decode("utf-8").encode("utf-32-le"), "<u4")).astype(dtype)
    if raw[:1] == b"=":
        return _decimal_values(raw[1:].decode())
    kind, p = raw[0], POW10[raw[1] - 48]
    u = values_of(np.frombuffer(raw[2:].decode("utf-8").encode("utf-32-le"), "<u4")).astype(np.float64)
    if kind == NONNEG:
        return (u / p).astype(np.float32)
    if kind == NONPOS:
        return (-(u / p)).astype(np.float32)
    m = np.floor(u / 2)
    return np.where(u % 2 == 1, -(m / p), m / p).astype(np.float32)


# --------------------------------------------------------------------------- loss weights


def loss_weights_text(maps: Sequence[Any]) -> pa.Array:
    """Each node's ``loss_weights`` (None, or ``(name, values)`` pairs in the record's
    order) as JSON text: an object from each name to its list's stream text."""
    out: list[str | None] = []
    for entries in maps:
        if entries is None:
            out.append(None)
            continue
        pairs = list(entries.items()) if isinstance(entries, dict) else list(entries)
        if not pairs:
            out.append("{}")
            continue
        lists = [np.asarray(v, np.float32) for _, v in pairs]
        offsets = np.cumsum([0] + [len(v) for v in lists])
        texts = stream_text(
            np.concatenate(lists) if lists else np.zeros(0, np.float32), offsets, np.ones(len(lists), bool)
        ).to_pylist()
        out.append(json.dumps(dict(zip([k for k, _ in pairs], texts, strict=True)), ensure_ascii=False))
    return pa.array(out, pa.string())


def loss_weights_values(text: pa.Array | pa.ChunkedArray) -> list[list[tuple[str, np.ndarray]] | None]:
    """The ``loss_weights`` text column back as pairs of (name, float32 values) per node.
    A column that is already a map (a lake's ``nodes``, a schema-6 file) gives its pairs."""
    out: list[list[tuple[str, np.ndarray]] | None] = []
    if text is not None and not pa.types.is_string(text.type) and not pa.types.is_large_string(text.type):
        for pairs in text.to_pylist():
            out.append(None if pairs is None else [(name, np.asarray(v, np.float32)) for name, v in pairs])
        return out
    for row in text.to_pylist() if text is not None else []:
        if row is None:
            out.append(None)
            continue
        entries = json.loads(row)
        names = list(entries)
        values, offsets, _ = stream_values(pa.array(list(entries.values()), pa.string()))
        out.append([(name, values[offsets[i] : offsets[i + 1]]) for i, name in enumerate(names)])
    return out
