"""Compiled loops of the stored encodings (numba, compiled once and cached on disk): values
to UTF-8 text and back, and the fixed-point form of each stream row.

Every loop works on flat arrays: ``offsets`` (rows + 1) cut the values (encoding) or the
UTF-8 bytes (decoding) into rows. The rules are :mod:`tracedb.codec`'s; these loops are its
fast path and are tested against its reference (numpy and Python's codecs).
"""

from __future__ import annotations

import numpy as np

from tracedb.codec.constants import BASE, DECIMAL, GAP, MAX_DECIMALS, MIXED, NONNEG, NONPOS, POW10, SURROGATE, UMAX
from tracedb.jit import compiled, inline


@inline
def _code(u: int) -> int:
    c = u + BASE
    return c + GAP if c >= SURROGATE else c


@inline
def _width(c: int) -> int:
    if c < 0x80:
        return 1
    if c < 0x800:
        return 2
    if c < 0x10000:
        return 3
    return 4


@inline
def _put(out: np.ndarray, o: int, c: int) -> int:
    if c < 0x80:
        out[o] = c
        return o + 1
    if c < 0x800:
        out[o] = 0xC0 | (c >> 6)
        out[o + 1] = 0x80 | (c & 0x3F)
        return o + 2
    if c < 0x10000:
        out[o] = 0xE0 | (c >> 12)
        out[o + 1] = 0x80 | ((c >> 6) & 0x3F)
        out[o + 2] = 0x80 | (c & 0x3F)
        return o + 3
    out[o] = 0xF0 | (c >> 18)
    out[o + 1] = 0x80 | ((c >> 12) & 0x3F)
    out[o + 2] = 0x80 | ((c >> 6) & 0x3F)
    out[o + 3] = 0x80 | (c & 0x3F)
    return o + 4


@inline
def _get(data: np.ndarray, i: int) -> tuple[int, int]:
    """(value, next index) of the character at ``data[i]`` (valid UTF-8)."""
    b = np.int64(data[i])
    if b < 0x80:
        c, i = b, i + 1
    elif b < 0xE0:
        c, i = ((b & 0x1F) << 6) | (np.int64(data[i + 1]) & 0x3F), i + 2
    elif b < 0xF0:
        c = ((b & 0x0F) << 12) | ((np.int64(data[i + 1]) & 0x3F) << 6) | (np.int64(data[i + 2]) & 0x3F)
        i += 3
    else:
        c = (
            ((b & 0x07) << 18)
            | ((np.int64(data[i + 1]) & 0x3F) << 12)
            | ((np.int64(data[i + 2]) & 0x3F) << 6)
            | (np.int64(data[i + 3]) & 0x3F)
        )
        i += 4
    return (c - BASE - GAP if c >= 0xE000 else c - BASE), i


@compiled
def text_sizes(values: np.ndarray, offsets: np.ndarray, out: np.ndarray) -> bool:
    """UTF-8 bytes of each row of ``values`` as text; False when a value is outside 0..UMAX."""
    for r in range(len(offsets) - 1):
        n = 0
        for k in range(offsets[r], offsets[r + 1]):
            u = np.int64(values[k])
            if u < 0 or u > UMAX:
                return False
            n += _width(_code(u))
        out[r] = n
    return True


@compiled
def write_text(values: np.ndarray, offsets: np.ndarray, out_off: np.ndarray, out: np.ndarray) -> None:
    """Each row of ``values`` (checked by :func:`text_sizes`) as text at ``out[out_off[r]:]``."""
    for r in range(len(offsets) - 1):
        o = out_off[r]
        for k in range(offsets[r], offsets[r + 1]):
            o = _put(out, o, _code(np.int64(values[k])))


@compiled
def text_counts(data: np.ndarray, offsets: np.ndarray, skip: int, out: np.ndarray) -> None:
    """Characters of each row after its first ``skip`` (a row starting with ``=`` counts
    the values of its decimal list instead: commas + 1, none when empty)."""
    for r in range(len(offsets) - 1):
        lo, hi = offsets[r], offsets[r + 1]
        if skip and hi > lo and data[lo] == DECIMAL:
            n = 0
            for i in range(lo + 1, hi):
                if data[i] == 44:
                    n += 1
            out[r] = n + 1 if hi - lo > 1 else 0
            continue
        n = 0
        for i in range(lo, hi):
            if (data[i] & 0xC0) != 0x80:
                n += 1
        out[r] = max(n - skip, 0)


@compiled
def read_text(data: np.ndarray, offsets: np.ndarray, out_off: np.ndarray, out: np.ndarray) -> bool:
    """The values of each row's text into ``out[out_off[r]:out_off[r + 1]]``; False when
    a row's text holds another number of values than its place."""
    exact = True
    for r in range(len(offsets) - 1):
        i, hi, o, end = offsets[r], offsets[r + 1], out_off[r], out_off[r + 1]
        while i < hi and o < end:
            u, i = _get(data, i)
            out[o] = u
            o += 1
        if i != hi or o != end:
            exact = False
    return exact


@inline
def _fits(a: float, t: np.float32, d: int) -> tuple[bool, int]:
    """Whether ``a`` (a float32 magnitude, widened) is ``m / 10**d`` for an integer m
    within 0..UMAX, by the float32 the division rounds to; and m."""
    p = POW10[d]
    m = np.floor(a * p + 0.5)
    if m > UMAX:
        return False, 0
    return np.float32(m / p) == t, np.int64(m)


@compiled
def stream_plan(
    values: np.ndarray, offsets: np.ndarray, valid: np.ndarray, form: np.ndarray, dec: np.ndarray, size: np.ndarray
) -> None:
    """Per row: its form (:data:`NONNEG`, :data:`NONPOS`, :data:`MIXED`, or 0 for a row that
    is not fixed point: written as decimals), its decimals, and its text's UTF-8 bytes."""
    for r in range(len(offsets) - 1):
        form[r], dec[r], size[r] = 0, 0, 0
        if not valid[r]:
            continue
        lo, hi = offsets[r], offsets[r + 1]
        d = 0
        neg = 0
        ok = True
        for k in range(lo, hi):
            t = np.float32(abs(values[k]))
            a = np.float64(t)
            while d <= MAX_DECIMALS:
                fit, _ = _fits(a, t, d)
                if fit:
                    break
                d += 1
            if d > MAX_DECIMALS:
                ok = False
                break
            if np.signbit(values[k]):
                neg += 1
        if not ok:
            continue
        kind = NONNEG if neg == 0 else (NONPOS if neg == hi - lo else MIXED)
        n = 2
        for k in range(lo, hi):  # again at the row's decimals: every value must fit there
            t = np.float32(abs(values[k]))
            fit, m = _fits(np.float64(t), t, d)
            if kind == MIXED:
                m = 2 * m + (1 if np.signbit(values[k]) else 0)
            if not fit or m > UMAX:
                ok = False
                break
            n += _width(_code(m))
        if ok:
            form[r], dec[r], size[r] = kind, d, n


@compiled
def write_streams(
    values: np.ndarray, offsets: np.ndarray, form: np.ndarray, dec: np.ndarray, out_off: np.ndarray, out: np.ndarray
) -> None:
    """The text of each fixed-point row (``form`` nonzero) at ``out[out_off[r]:]``."""
    for r in range(len(offsets) - 1):
        kind = form[r]
        if kind == 0:
            continue
        o = out_off[r]
        out[o] = kind
        out[o + 1] = 48 + dec[r]
        o += 2
        p = POW10[dec[r]]
        for k in range(offsets[r], offsets[r + 1]):
            m = np.int64(np.floor(np.float64(abs(values[k])) * p + 0.5))
            if kind == MIXED:
                m = 2 * m + (1 if np.signbit(values[k]) else 0)
            o = _put(out, o, _code(m))


@compiled
def read_streams(data: np.ndarray, offsets: np.ndarray, out_off: np.ndarray, out: np.ndarray) -> None:
    """The values of each fixed-point row's text into ``out[out_off[r]:out_off[r + 1]]``
    (rows written as decimals are left to the caller)."""
    for r in range(len(offsets) - 1):
        i, hi, o, end = offsets[r], offsets[r + 1], out_off[r], out_off[r + 1]
        if hi - i < 2 or data[i] == DECIMAL:
            continue
        kind = data[i]
        p = POW10[data[i + 1] - 48]
        i += 2
        while i < hi and o < end:
            u, i = _get(data, i)
            if kind == NONNEG:
                out[o] = np.float32(u / p)
            elif kind == NONPOS:
                out[o] = np.float32(-(u / p))
            elif u & 1:
                out[o] = np.float32(-((u >> 1) / p))
            else:
                out[o] = np.float32((u >> 1) / p)
            o += 1
