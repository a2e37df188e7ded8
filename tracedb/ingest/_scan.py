"""A compiled scanner for ``traces.jsonl`` text: whole chunks of lines to node columns.

The scanner walks the bytes of many lines in one call and writes what ingest stores
straight into flat buffers: token ids, masks, compact streams, message and unknown-field
text, links, node scalars. Python never sees a node as an object; the columns are
sliced out of the buffers (:mod:`tracedb.ingest.scanned` builds the Arrow tables).

It accepts only what it can vouch for and says "fallback" for any other line, which
then goes through :func:`tracedb.ingest.parse.parse_fast` / ``parse_slow``, the paths that
know every rule and word every error: a line with a grammar error, an escaped key, a
duplicate known key, a value of an unusual type (``logprobs``, ``sampled`` or a
timestamp null, ``loss_weights`` given as an object), semantic links carrying more than
``node`` and ``type``, a token id beyond int32, a lone UTF-16 surrogate escape, a value
nested over :data:`MAX_DEPTH` levels, and any node that breaks a layout or graph rule of
the contract. The text outside the node lists (episode and trace metadata) is validated
here and parsed by ``json`` in Python (:mod:`tracedb.ingest.scanned`, which also sends lines with
repeated keys there, or bytes that are not UTF-8, the other way).

Numbers: a token id is a JSON integer. A float is read exactly when its decimal
significand fits the fast path (at most 2**53, and a power of ten within ±22: Clinger's
fast path, where both operands are exact doubles so one IEEE multiply or divide rounds
correctly). Any other float is copied out as text and converted by Arrow's exact parser.
Either way the value is what Python's ``json`` reads (the integer ``-0`` is 0.0), then
rounded to float32 like the other path does.

Memory: the kernels do not check bounds. :class:`tracedb.ingest.scanned.Scanner` sizes every
buffer for the most values a chunk of that many bytes can hold (a value takes two bytes
of JSON at least, text is never longer than the input), and every line is followed by its
line break in the chunk, where the digit loops stop (a line that is not falls back).

Speed: the list loops take the common case inline (a digit is ``byte ^ 48 < 10``; after an
element, its comma and the next element's first byte) and call the general helpers only
otherwise; measured on the benchmark workloads, that doubled the kernel (token ids 270 ->
610 MB/s, masks 390 -> 2,500, logprobs 430 -> 930, message text 320 -> 430).

Size: this module is the one over the ~600 lines a module keeps to. numba takes no
structs and compiles each kernel with the helpers it calls, so the grammar, the node
fields and the number parser live in one compilation unit.
"""

from __future__ import annotations

import numpy as np

from tracedb.jit import compiled, inline
from tracedb.records import COMPACT_STREAMS, NODE_KEYS

# Line statuses.
OK, BLANK, FALLBACK = 0, 1, 2

# Columns of the per-line array.
L_STATUS, L_TRACE_LO, L_TRACE_HI, L_TRACES_LO, L_TRACES_HI, L_BARE = range(6)
L_COLS = 6
# Columns of the per-trace array: its line, the object's span, the span of its
# ``nodes`` value (-1 when absent), its node rows.
T_LINE, T_LO, T_HI, T_NODES_LO, T_NODES_HI, T_NODE_LO, T_NODE_HI = range(7)
T_COLS = 7
# Columns of the per-node array. ``*_OFF`` columns hold the offset of the node's first
# value in that buffer; a node's values end where the next node's begin (the scanner
# writes every buffer in node order), and ``counts`` holds each buffer's final fill.
(
    N_TRACE,
    N_INDEX,
    N_PRESENT,
    N_NULLS,
    N_PARENT,
    N_SAMPLED,
    N_NSAMP,
    N_PREFIX,
    N_TOK_OFF,
    N_SLOT_OFF,
    N_IC_OFF,
    N_LINK_OFF,
    N_MSG_OFF,
    N_ROLE_OFF,
    N_EXTRA_OFF,
    N_STREAM_OFF,
) = range(16)
N_COLS = N_STREAM_OFF + len(COMPACT_STREAMS)
# Bits of ``N_NULLS``: which nullable columns are null on this node.
NULL_PARENT, NULL_SAMPLED, NULL_TS, NULL_SLOTS, NULL_IC, NULL_LINKS, NULL_ROLE, NULL_EXTRA = (1 << i for i in range(8))
NULL_STREAM = 8  # bit NULL_STREAM + s: compact stream s is None
# Buffer counters (indexes of ``counts``).
(
    C_LINE,
    C_TRACE,
    C_NODE,
    C_TOK,
    C_SLOT,
    C_IC,
    C_LINK,
    C_LTXT,
    C_MSG,
    C_ROLE,
    C_EXTRA,
    C_HARD,
    C_HTXT,
    C_STREAM,
) = range(14)
C_COLS = C_STREAM + len(COMPACT_STREAMS)
HARD_TS = -1  # a hard float's target: a node's timestamp (else the stream index)
# Rows of the value buffers, by type (few arguments keep numba's compile time down):
# ``u8`` bytes, ``i32`` and ``i64`` integers; each row is filled from its start.
U_IS_CONTENT, U_LINK_TEXT, U_MESSAGES, U_ROLES, U_EXTRAS, U_HARD_TEXT = range(6)
U_ROWS = 6
I_TOKENS, I_SLOTS, I_LINK_NODES = range(3)
I_ROWS = 3
J_LINK_TYPE_OFF, J_HARD_OFF, J_HARD_TARGET, J_HARD_INDEX = range(4)
J_ROWS = 4

N_KEYS = len(NODE_KEYS)
K_PARENT, K_SEMANTIC, K_MESSAGE, K_SAMPLED, K_TS, K_TOKENS, K_MASK, K_IC = range(8)
K_STREAM = 8
K_LOSS_WEIGHTS = K_STREAM + len(COMPACT_STREAMS)
assert NODE_KEYS[K_STREAM:K_LOSS_WEIGHTS] == COMPACT_STREAMS and NODE_KEYS[K_LOSS_WEIGHTS] == "loss_weights"

_names = [k.encode() for k in NODE_KEYS]
KEY_BYTES = np.frombuffer(b"".join(_names), dtype=np.uint8).copy()
KEY_OFF = np.cumsum([0] + [len(k) for k in _names]).astype(np.int64)
_WORDS = [b"nodes", b"traces", b"role", b"node", b"type"]
WORD_BYTES = np.frombuffer(b"".join(_WORDS), dtype=np.uint8).copy()
WORD_OFF = np.cumsum([0] + [len(w) for w in _WORDS]).astype(np.int64)
W_NODES, W_TRACES, W_ROLE, W_NODE, W_TYPE = range(5)

POW10 = np.array([10.0**k for k in range(23)], dtype=np.float64)
MAX_DEPTH = 512
"""Deeper JSON values go the slow way (Python's json reads ~1,000 levels at most)."""

# Bytes.
_QUOTE, _BSLASH, _COMMA, _COLON = 34, 92, 44, 58
_LBRACE, _RBRACE, _LBRACKET, _RBRACKET = 123, 125, 91, 93
_MINUS, _PLUS, _DOT, _ZERO, _NINE = 45, 43, 46, 48, 57


# Validating without copying passes ``stack`` as the (untouched) output: numba needs a
# writable array there, and the input bytes are read-only. Calls between these functions
# pass no literal constants where a variable goes otherwise (np.int64(0), not 0): numba
# would compile the callee once more for the literal, and these take seconds to compile.


@compiled
def _ws(buf: np.ndarray, i: int, end: int) -> int:
    while i < end:
        c = buf[i]
        if c != 32 and c != 9 and c != 10 and c != 13:
            break
        i += 1
    return i


@compiled
def _match(buf: np.ndarray, lo: int, hi: int, table: np.ndarray, off: np.ndarray, k: int) -> bool:
    a, b = off[k], off[k + 1]
    if hi - lo != b - a:
        return False
    for j in range(b - a):
        if buf[lo + j] != table[a + j]:
            return False
    return True


@compiled
def _node_key(buf: np.ndarray, lo: int, hi: int) -> int:
    for k in range(len(KEY_OFF) - 1):
        if _match(buf, lo, hi, KEY_BYTES, KEY_OFF, k):
            return k
    return -1


@inline
def _hex4(buf: np.ndarray, i: int, end: int) -> int:
    """The value of four hex digits at ``i``, or -1."""
    if i + 4 > end:
        return -1
    v = 0
    for j in range(i, i + 4):
        h = buf[j]
        if 48 <= h <= 57:
            v = v * 16 + (h - 48)
        elif 65 <= h <= 70:
            v = v * 16 + (h - 55)
        elif 97 <= h <= 102:
            v = v * 16 + (h - 87)
        else:
            return -1
    return v


@compiled
def _string(buf: np.ndarray, i: int, end: int, out: np.ndarray, o: int, copy: bool) -> tuple[int, int, bool]:
    """A string starting at the quote ``buf[i]``: (index after it or -1, new ``o``, escaped)."""
    if copy:
        out[o] = _QUOTE
        o += 1
    i += 1
    escaped = False
    while i < end:
        c = buf[i]
        if c == _QUOTE:
            if copy:
                out[o] = _QUOTE
                o += 1
            return i + 1, o, escaped
        if c == _BSLASH:
            escaped = True
            if i + 1 >= end:
                return -1, o, escaped
            d = buf[i + 1]
            n = 2
            if d == 117:  # \uXXXX; a UTF-16 surrogate only as a high-low pair (else not Unicode)
                v = _hex4(buf, i + 2, end)
                n = 6
                if 0xD800 <= v <= 0xDBFF:
                    if i + 12 > end or buf[i + 6] != _BSLASH or buf[i + 7] != 117:
                        return -1, o, escaped
                    w = _hex4(buf, i + 8, end)
                    if w < 0xDC00 or w > 0xDFFF:
                        return -1, o, escaped
                    n = 12
                elif v < 0 or 0xDC00 <= v <= 0xDFFF:
                    return -1, o, escaped
            elif d == _QUOTE or d == _BSLASH or d == 47 or d == 98 or d == 102 or d == 110 or d == 114 or d == 116:
                pass  # a two-byte escape
            else:
                return -1, o, escaped
            if copy:
                for j in range(n):
                    out[o + j] = buf[i + j]
                o += n
            i += n
        elif c < 32:
            return -1, o, escaped
        elif copy:  # a run of plain bytes, copied as it goes
            out[o] = c
            o += 1
            i += 1
            while i < end:
                c = buf[i]
                if c == _QUOTE or c == _BSLASH or c < 32:
                    break
                out[o] = c
                o += 1
                i += 1
        else:
            i += 1
            while i < end:
                c = buf[i]
                if c == _QUOTE or c == _BSLASH or c < 32:
                    break
                i += 1
    return -1, o, escaped


@compiled
def _number(buf: np.ndarray, i: int, end: int) -> tuple[int, float, bool, bool]:
    """A JSON number at ``i``: (index after it or -1, value, exact, integral).

    ``exact`` False: the value is not computed (too many digits or too large a power of
    ten for the fast path); the caller converts the text."""
    start = i
    neg = False
    if i < end and buf[i] == _MINUS:
        neg = True
        i += 1
    if i >= end:
        return -1, 0.0, False, False
    mant = np.uint64(0)
    digits = 0  # significant digits taken into mant
    dropped = False
    exp10 = 0
    c = buf[i]
    if c == _ZERO:
        i += 1
    elif 49 <= c <= _NINE:
        while i < end and _ZERO <= buf[i] <= _NINE:
            if digits < 19:
                mant = mant * np.uint64(10) + np.uint64(buf[i] - _ZERO)
                digits += 1
            else:
                dropped = True
                exp10 += 1
            i += 1
    else:
        return -1, 0.0, False, False
    integral = True
    if i < end and buf[i] == _DOT:
        integral = False
        i += 1
        if i >= end or not (_ZERO <= buf[i] <= _NINE):
            return -1, 0.0, False, False
        while i < end and _ZERO <= buf[i] <= _NINE:
            d = buf[i] - _ZERO
            if digits < 19:
                if digits > 0 or d != 0:
                    mant = mant * np.uint64(10) + np.uint64(d)
                    digits += 1
                exp10 -= 1
            elif d != 0:
                dropped = True
            i += 1
    if i < end and (buf[i] == 101 or buf[i] == 69):
        integral = False
        i += 1
        eneg = False
        if i < end and (buf[i] == _PLUS or buf[i] == _MINUS):
            eneg = buf[i] == _MINUS
            i += 1
        if i >= end or not (_ZERO <= buf[i] <= _NINE):
            return -1, 0.0, False, False
        e = 0
        while i < end and _ZERO <= buf[i] <= _NINE:
            if e < 100000:
                e = e * 10 + (buf[i] - _ZERO)
            i += 1
        exp10 += -e if eneg else e
    if i - start > 400:
        return i, 0.0, False, integral
    if mant == 0 and not dropped:
        if integral:
            return i, 0.0, True, True  # JSON -0 is the integer 0, as float("-0") is not
        value = 0.0
    elif dropped or mant > np.uint64(1 << 53) or exp10 > 22 or exp10 < -22:
        return i, 0.0, False, integral
    elif exp10 >= 0:
        value = float(mant) * POW10[exp10]
    else:
        value = float(mant) / POW10[-exp10]
    return i, -value if neg else value, True, integral


@compiled
def _beyond_double(buf: np.ndarray, i: int, j: int) -> bool:
    """Whether the JSON number ``buf[i:j]`` (with a fraction or an exponent) may read as
    an infinity: its decimal order is 308 or more (the largest double is 1.8e308)."""
    k = i
    if buf[k] == _MINUS:
        k += 1
    whole = 0  # significant digits before the point
    while k < j and _ZERO <= buf[k] <= _NINE:
        if whole > 0 or buf[k] != _ZERO:
            whole += 1
        k += 1
    zeros = 0  # zeros after the point before the first significant digit
    seen = whole > 0
    if k < j and buf[k] == _DOT:
        k += 1
        while k < j and _ZERO <= buf[k] <= _NINE:
            if not seen:
                if buf[k] == _ZERO:
                    zeros += 1
                else:
                    seen = True
            k += 1
    if not seen:
        return False  # zero
    e = 0
    if k < j and (buf[k] == 101 or buf[k] == 69):
        k += 1
        eneg = False
        if k < j and (buf[k] == _PLUS or buf[k] == _MINUS):
            eneg = buf[k] == _MINUS
            k += 1
        while k < j:
            if e < 100000:
                e = e * 10 + (buf[k] - _ZERO)
            k += 1
        if eneg:
            e = -e
    order = (whole - 1 if whole > 0 else -(zeros + 1)) + e
    return order >= 308


@compiled
def _literal(buf: np.ndarray, i: int, end: int) -> tuple[int, int]:
    """true / false / null at ``i``: (index after it or -1, 1 / 0 / 2)."""
    if i + 4 <= end and buf[i] == 116 and buf[i + 1] == 114 and buf[i + 2] == 117 and buf[i + 3] == 101:
        return i + 4, 1
    if (
        i + 5 <= end
        and buf[i] == 102
        and buf[i + 1] == 97
        and buf[i + 2] == 108
        and buf[i + 3] == 115
        and buf[i + 4] == 101
    ):
        return i + 5, 0
    if i + 4 <= end and buf[i] == 110 and buf[i + 1] == 117 and buf[i + 2] == 108 and buf[i + 3] == 108:
        return i + 4, 2
    return -1, 0


@compiled
def _value(
    buf: np.ndarray,
    i: int,
    end: int,
    out: np.ndarray,
    o: int,
    copy: bool,
    stack: np.ndarray,
    want_role: bool,
) -> tuple[int, int, int, int]:
    """Validate (and, with ``copy``, minify into ``out``) one JSON value at ``i``.

    Returns (index after it or -1, new ``o``, role span start, end): with ``want_role``
    the span of the string under the object's top-level ``role`` key (-1 when there is
    none or it is not a string; start -2 when it cannot be taken as it is)."""
    depth = 0
    role_lo, role_hi = -1, -1
    role_next = False  # the value about to be read is the top-level "role"
    state = 0  # 0 a value is expected, 1 a value just ended, 2 a key is expected
    while True:
        if i < end and buf[i] <= 32:  # whitespace is rare in what verifiers writes
            i = _ws(buf, i, end)
        if i >= end:
            return -1, o, role_lo, role_hi
        c = buf[i]
        if state == 0:
            is_role = role_next
            role_next = False
            if c == _LBRACE or c == _LBRACKET:
                if depth == len(stack):
                    return -1, o, role_lo, role_hi
                if copy:
                    out[o] = c
                    o += 1
                i += 1
                if i < end and buf[i] <= 32:
                    i = _ws(buf, i, end)
                if i >= end:
                    return -1, o, role_lo, role_hi
                close = _RBRACE if c == _LBRACE else _RBRACKET
                if buf[i] == close:
                    if copy:
                        out[o] = close
                        o += 1
                    i += 1
                    state = 1
                else:
                    stack[depth] = c
                    depth += 1
                    state = 2 if c == _LBRACE else 0
            elif c == _QUOTE:
                j, o, escaped = _string(buf, i, end, out, o, copy)
                if j < 0:
                    return -1, o, role_lo, role_hi
                if is_role:
                    if escaped or role_lo != -1:
                        role_lo = -2
                    else:
                        role_lo, role_hi = i + 1, j - 1
                i = j
                state = 1
            elif c == _MINUS or (_ZERO <= c <= _NINE):
                j, _, exact, integral = _number(buf, i, end)
                if j < 0:
                    return -1, o, role_lo, role_hi
                if not exact and not integral and _beyond_double(buf, i, j):
                    # Python's json reads it as an infinity, which no record may hold: the
                    # parser words it (an integer of any length stays an exact integer).
                    return -1, o, role_lo, role_hi
                if copy:
                    for k in range(i, j):
                        out[o] = buf[k]
                        o += 1
                i = j
                state = 1
            else:
                j, _ = _literal(buf, i, end)
                if j < 0:
                    return -1, o, role_lo, role_hi
                if copy:
                    for k in range(i, j):
                        out[o] = buf[k]
                        o += 1
                i = j
                state = 1
            if is_role and c != _QUOTE and role_lo == -1:
                role_lo = -3  # a role that is not a string: None, but no other role after it
        elif state == 1:
            if depth == 0:
                return i, o, (-1 if role_lo == -3 else role_lo), role_hi
            top = stack[depth - 1]
            if c == _COMMA:
                if copy:
                    out[o] = c
                    o += 1
                i += 1
                state = 2 if top == _LBRACE else 0
            elif (top == _LBRACE and c == _RBRACE) or (top == _LBRACKET and c == _RBRACKET):
                if copy:
                    out[o] = c
                    o += 1
                i += 1
                depth -= 1
            else:
                return -1, o, role_lo, role_hi
        else:  # a key
            if c != _QUOTE:
                return -1, o, role_lo, role_hi
            j, o, escaped = _string(buf, i, end, out, o, copy)
            if j < 0:
                return -1, o, role_lo, role_hi
            if want_role and depth == 1:
                if escaped:
                    role_lo = -2  # could spell "role"
                elif _match(buf, i + 1, j - 1, WORD_BYTES, WORD_OFF, W_ROLE):
                    if role_lo != -1:
                        role_lo = -2  # a second role
                    role_next = True
            i = j
            if i < end and buf[i] <= 32:
                i = _ws(buf, i, end)
            if i >= end or buf[i] != _COLON:
                return -1, o, role_lo, role_hi
            if copy:
                out[o] = _COLON
                o += 1
            i += 1
            state = 0


@compiled
def _list_start(buf: np.ndarray, i: int, end: int) -> tuple[int, bool]:
    """After ``[`` at ``i``: (index of the first element or after ``]``, empty)."""
    if i >= end or buf[i] != _LBRACKET:
        return -1, False
    i = _ws(buf, i + 1, end)
    if i < end and buf[i] == _RBRACKET:
        return i + 1, True
    return i, False


@compiled
def _list_next(buf: np.ndarray, i: int, end: int) -> tuple[int, bool]:
    """After an element: (index of the next element or after ``]``, done); -1 on error."""
    i = _ws(buf, i, end)
    if i >= end:
        return -1, True
    if buf[i] == _COMMA:
        return _ws(buf, i + 1, end), False
    if buf[i] == _RBRACKET:
        return i + 1, True
    return -1, True


@inline
def _after_item(buf: np.ndarray, i: int, end: int) -> tuple[int, bool]:
    """After a list element, the common case inline: ``,`` or ``]`` right away."""
    if i < end:
        c = buf[i]
        if c == _COMMA:
            i += 1
            if i < end and buf[i] > 32:
                return i, False
            return _ws(buf, i, end), False
        if c == _RBRACKET:
            return i + 1, True
    return _list_next(buf, i, end)


@compiled
def _int_list(buf: np.ndarray, i: int, end: int, out: np.ndarray, o: int) -> tuple[int, int]:
    """A list of int32 at ``buf[i] == '['`` into ``out[o:]``: (index after it or -1, new ``o``).

    Digit runs stop at ``buf[end]`` without a bounds check: see :func:`scan`."""
    i, done = _list_start(buf, i, end)
    if i < 0:
        return -1, o
    while not done:
        c = buf[i]
        neg = c == _MINUS
        if neg:
            i += 1
            c = buf[i]
        start = i
        d = c ^ 48  # a digit's value; 10 or more for any other byte
        if d == 0:
            v = 0
            i += 1
        else:
            v = 0
            while d < 10:
                v = v * 10 + d
                i += 1
                d = buf[i] ^ 48
            if i == start or i - start > 10 or i > end:
                return -1, o
        if neg:
            v = -v
        if v < -2147483648 or v > 2147483647:
            return -1, o
        out[o] = v
        o += 1
        if i < end and buf[i] == _COMMA and i + 1 < end and buf[i + 1] > 32:  # the next element, inline
            i += 1
        else:
            i, done = _after_item(buf, i, end)
            if i < 0:
                return -1, o
    return i, o


@compiled
def _float_list(
    buf: np.ndarray,
    i: int,
    end: int,
    out: np.ndarray,
    o: int,
    target: int,
    u8: np.ndarray,
    i64: np.ndarray,
    counts: np.ndarray,
) -> tuple[int, int]:
    """A list of numbers at ``buf[i] == '['`` into ``out[o:]``, the fast path inline (the
    others go to :func:`_hard`): (index after it or -1, new ``o``)."""
    i, done = _list_start(buf, i, end)
    if i < 0:
        return -1, o
    while not done:
        lo = i
        c = buf[i]
        neg = c == _MINUS
        if neg:
            i += 1
            c = buf[i]
        mant = 0
        start = i
        d = c ^ 48  # a digit's value; 10 or more for any other byte
        if d == 0:
            i += 1
        else:
            while d < 10:
                mant = mant * 10 + d
                i += 1
                d = buf[i] ^ 48
            if i == start:
                return -1, o
        c = buf[i]
        digits = i - start
        exp10 = 0
        if c == _DOT:
            i += 1
            frac = i
            d = buf[i] ^ 48
            while d < 10:
                mant = mant * 10 + d
                i += 1
                d = buf[i] ^ 48
            if i == frac:
                return -1, o
            exp10 = frac - i
            digits += i - frac
            c = buf[i]
        if c == 101 or c == 69:  # an exponent: the general reader
            j, value, exact, _ = _number(buf, lo, end)
            if j < 0:
                return -1, o
            i = j
            if exact:
                out[o] = value
            else:
                _hard(buf, lo, j, target, o, u8, i64, counts)
        elif i > end:
            return -1, o
        elif digits <= 18 and mant <= 9007199254740992 and exp10 >= -22:
            value = float(mant) / POW10[-exp10]
            out[o] = -value if neg and (mant != 0 or exp10 < 0) else value  # -0 is the integer 0, -0.0 a float
        else:
            _hard(buf, lo, i, target, o, u8, i64, counts)
        o += 1
        if i < end and buf[i] == _COMMA and i + 1 < end and buf[i + 1] > 32:
            i += 1
        else:
            i, done = _after_item(buf, i, end)
            if i < 0:
                return -1, o
    return i, o


@compiled
def _bool_list(buf: np.ndarray, i: int, end: int, out: np.ndarray, o: int) -> tuple[int, int, int, int, int]:
    """A list of booleans at ``buf[i] == '['`` into ``out[o:]`` as 0/1: (index after it or
    -1, new ``o``, trues, position of the first true, of the last false; -1 for none)."""
    trues, first_true, last_false = 0, -1, -1
    i, done = _list_start(buf, i, end)
    if i < 0:
        return -1, o, trues, first_true, last_false
    while not done:
        if i + 4 > end:
            return -1, o, trues, first_true, last_false
        c = buf[i]
        if c == 116 and buf[i + 1] == 114 and buf[i + 2] == 117 and buf[i + 3] == 101:
            out[o] = 1
            trues += 1
            if first_true < 0:
                first_true = o
            i += 4
        elif c == 102 and i + 5 <= end and buf[i + 1] == 97 and buf[i + 2] == 108 and buf[i + 3] == 115:
            if buf[i + 4] != 101:
                return -1, o, trues, first_true, last_false
            out[o] = 0
            last_false = o
            i += 5
        else:
            return -1, o, trues, first_true, last_false
        o += 1
        if i < end and buf[i] == _COMMA and i + 1 < end and buf[i + 1] > 32:
            i += 1
        else:
            i, done = _after_item(buf, i, end)
            if i < 0:
                return -1, o, trues, first_true, last_false
    return i, o, trues, first_true, last_false


@compiled
def scan(
    buf: np.ndarray,
    starts: np.ndarray,
    ends: np.ndarray,
    allow_ragged: bool,
    stack: np.ndarray,
    lines: np.ndarray,
    traces: np.ndarray,
    nodes: np.ndarray,
    timestamps: np.ndarray,
    u8: np.ndarray,
    i32: np.ndarray,
    i64: np.ndarray,
    streams: np.ndarray,
    counts: np.ndarray,
) -> None:
    """Scan the lines ``buf[starts[k]:ends[k]]``; fills the arrays described above.

    Each line must be followed by its line break (``buf[ends[k]] == 10``): the number loops
    stop at a non-digit instead of checking bounds, so any other line falls back.

    ``counts`` holds every buffer's fill when it returns. A line that falls back leaves
    no rows behind (its counters are put back), so each buffer stays in node order."""
    saved = np.empty(len(counts), np.int64)
    for li in range(len(starts)):
        lo, end = starts[li], ends[li]
        lines[li, L_STATUS] = FALLBACK
        lines[li, L_TRACE_LO] = counts[C_TRACE]
        lines[li, L_TRACE_HI] = counts[C_TRACE]
        lines[li, L_TRACES_LO] = -1
        lines[li, L_TRACES_HI] = -1
        lines[li, L_BARE] = 0
        i = _ws(buf, lo, end)
        if i >= end:
            lines[li, L_STATUS] = BLANK
            continue
        if end >= len(buf) or buf[end] != 10:
            continue  # not followed by its line break, where the digit loops stop: fall back
        saved[:] = counts
        if _line(buf, i, end, li, allow_ragged, stack, lines, traces, nodes, timestamps, u8, i32, i64, streams, counts):
            lines[li, L_STATUS] = OK
            lines[li, L_TRACE_HI] = counts[C_TRACE]
        else:
            counts[:] = saved
        counts[C_LINE] = li + 1


@compiled
def _line(
    buf: np.ndarray,
    i: int,
    end: int,
    li: int,
    allow_ragged: bool,
    stack: np.ndarray,
    lines: np.ndarray,
    traces: np.ndarray,
    nodes: np.ndarray,
    timestamps: np.ndarray,
    u8: np.ndarray,
    i32: np.ndarray,
    i64: np.ndarray,
    streams: np.ndarray,
    counts: np.ndarray,
) -> bool:
    """One record (an Episode, or a bare Trace); False = fall back."""
    if buf[i] != _LBRACE:
        return False
    line_lo = i
    i = _ws(buf, i + 1, end)
    seen_traces = seen_nodes = False
    if i < end and buf[i] == _RBRACE:
        return False  # no id: the slow path words it
    while True:
        if i >= end or buf[i] != _QUOTE:
            return False
        j, _, escaped = _string(buf, i, end, stack, i, False)
        if j < 0 or escaped:
            return False
        k_lo, k_hi = i + 1, j - 1
        i = _ws(buf, j, end)
        if i >= end or buf[i] != _COLON:
            return False
        i = _ws(buf, i + 1, end)
        if _match(buf, k_lo, k_hi, WORD_BYTES, WORD_OFF, W_TRACES):
            if seen_traces:
                return False
            seen_traces = True
            lines[li, L_TRACES_LO] = i
            i, empty = _list_start(buf, i, end)
            if i < 0:
                return False
            position = np.int64(0)
            while not empty:
                if i >= end or buf[i] != _LBRACE:
                    return False
                i = _trace(
                    buf,
                    i,
                    end,
                    li,
                    position,
                    allow_ragged,
                    stack,
                    traces,
                    nodes,
                    timestamps,
                    u8,
                    i32,
                    i64,
                    streams,
                    counts,
                )
                if i < 0:
                    return False
                position += 1
                i, empty = _list_next(buf, i, end)
                if i < 0:
                    return False
            lines[li, L_TRACES_HI] = i
        elif _match(buf, k_lo, k_hi, WORD_BYTES, WORD_OFF, W_NODES):
            if seen_nodes:
                return False
            seen_nodes = True
        if not _match(buf, k_lo, k_hi, WORD_BYTES, WORD_OFF, W_TRACES):
            i, _, _, _ = _value(buf, i, end, stack, i, False, stack, False)
            if i < 0:
                return False
        i = _ws(buf, i, end)
        if i >= end:
            return False
        if buf[i] == _COMMA:
            i = _ws(buf, i + 1, end)
            continue
        if buf[i] != _RBRACE:
            return False
        i = _ws(buf, i + 1, end)
        break
    if i != end:
        return False  # text after the record
    if seen_nodes:
        if seen_traces:
            return False
        # A bare Trace record: scan it again as one trace (the first pass only validated).
        lines[li, L_BARE] = 1
        if (
            _trace(
                buf,
                line_lo,
                end,
                li,
                np.int64(0),
                allow_ragged,
                stack,
                traces,
                nodes,
                timestamps,
                u8,
                i32,
                i64,
                streams,
                counts,
            )
            < 0
        ):
            return False
    elif not seen_traces:
        return False
    return True


@compiled
def _trace(
    buf: np.ndarray,
    i: int,
    end: int,
    li: int,
    position: int,
    allow_ragged: bool,
    stack: np.ndarray,
    traces: np.ndarray,
    nodes: np.ndarray,
    timestamps: np.ndarray,
    u8: np.ndarray,
    i32: np.ndarray,
    i64: np.ndarray,
    streams: np.ndarray,
    counts: np.ndarray,
) -> int:
    """One Trace object at ``buf[i] == '{'``; returns the index after it or -1."""
    t = counts[C_TRACE]
    counts[C_TRACE] = t + 1
    traces[t, T_LINE] = li
    traces[t, T_LO] = i
    traces[t, T_NODES_LO] = -1
    traces[t, T_NODES_HI] = -1
    traces[t, T_NODE_LO] = counts[C_NODE]
    i = _ws(buf, i + 1, end)
    if i < end and buf[i] == _RBRACE:
        return -1
    while True:
        if i >= end or buf[i] != _QUOTE:
            return -1
        j, _, escaped = _string(buf, i, end, stack, i, False)
        if j < 0 or escaped:
            return -1
        is_nodes = _match(buf, i + 1, j - 1, WORD_BYTES, WORD_OFF, W_NODES)
        i = _ws(buf, j, end)
        if i >= end or buf[i] != _COLON:
            return -1
        i = _ws(buf, i + 1, end)
        if is_nodes:
            if traces[t, T_NODES_LO] != -1:
                return -1
            traces[t, T_NODES_LO] = i
            i, empty = _list_start(buf, i, end)
            if i < 0:
                return -1
            index = np.int64(0)
            while not empty:
                i = _node(buf, i, end, t, index, allow_ragged, stack, nodes, timestamps, u8, i32, i64, streams, counts)
                if i < 0:
                    return -1
                index += 1
                i, empty = _list_next(buf, i, end)
                if i < 0:
                    return -1
            traces[t, T_NODES_HI] = i
        else:
            i, _, _, _ = _value(buf, i, end, stack, i, False, stack, False)
            if i < 0:
                return -1
        i = _ws(buf, i, end)
        if i >= end:
            return -1
        if buf[i] == _COMMA:
            i = _ws(buf, i + 1, end)
            continue
        if buf[i] != _RBRACE:
            return -1
        i += 1
        break
    traces[t, T_HI] = i
    traces[t, T_NODE_HI] = counts[C_NODE]
    return i


@compiled
def _hard(
    buf: np.ndarray,
    lo: int,
    hi: int,
    target: int,
    index: int,
    u8: np.ndarray,
    i64: np.ndarray,
    counts: np.ndarray,
) -> None:
    """Record a float the fast path cannot compute: its text, where the value goes."""
    h = counts[C_HARD]
    i64[J_HARD_TARGET, h] = target
    i64[J_HARD_INDEX, h] = index
    o = counts[C_HTXT]
    i64[J_HARD_OFF, h] = o
    for k in range(lo, hi):
        u8[U_HARD_TEXT, o] = buf[k]
        o += 1
    counts[C_HTXT] = o
    counts[C_HARD] = h + 1


@compiled
def _node(
    buf: np.ndarray,
    i: int,
    end: int,
    t: int,
    index: int,
    allow_ragged: bool,
    stack: np.ndarray,
    nodes: np.ndarray,
    timestamps: np.ndarray,
    u8: np.ndarray,
    i32: np.ndarray,
    i64: np.ndarray,
    streams: np.ndarray,
    counts: np.ndarray,
) -> int:
    """One MessageNode object at ``i``; returns the index after it or -1 (fall back)."""
    tokens, slots, link_nodes = i32[I_TOKENS], i32[I_SLOTS], i32[I_LINK_NODES]
    is_content, link_text, messages = u8[U_IS_CONTENT], u8[U_LINK_TEXT], u8[U_MESSAGES]
    roles, extras, link_type_off = u8[U_ROLES], u8[U_EXTRAS], i64[J_LINK_TYPE_OFF]
    if i >= end or buf[i] != _LBRACE:
        return -1
    n = counts[C_NODE]
    counts[C_NODE] = n + 1
    nodes[n, N_TRACE] = t
    nodes[n, N_INDEX] = index
    nodes[n, N_PARENT] = -1
    nodes[n, N_SAMPLED] = -1
    nodes[n, N_PREFIX] = 0
    nodes[n, N_NSAMP] = 0
    nodes[n, N_TOK_OFF] = counts[C_TOK]
    nodes[n, N_SLOT_OFF] = counts[C_SLOT]
    nodes[n, N_IC_OFF] = counts[C_IC]
    nodes[n, N_LINK_OFF] = counts[C_LINK]
    nodes[n, N_MSG_OFF] = counts[C_MSG]
    nodes[n, N_ROLE_OFF] = counts[C_ROLE]
    nodes[n, N_EXTRA_OFF] = counts[C_EXTRA]
    for s in range(streams.shape[0]):
        nodes[n, N_STREAM_OFF + s] = counts[C_STREAM + s]
    nulls = NULL_PARENT | NULL_SAMPLED | NULL_TS | NULL_SLOTS | NULL_IC | NULL_LINKS | NULL_ROLE | NULL_EXTRA
    for s in range(streams.shape[0]):
        nulls |= 1 << (NULL_STREAM + s)
    timestamps[n] = 0.0
    present = 0
    n_mask = 0
    x = counts[C_EXTRA]  # unknown fields, as {"key":value,...}
    i = _ws(buf, i + 1, end)
    empty_object = i < end and buf[i] == _RBRACE
    while not empty_object:
        if i >= end or buf[i] != _QUOTE:
            return -1
        j, _, escaped = _string(buf, i, end, stack, i, False)
        if j < 0 or escaped:
            return -1
        key = _node_key(buf, i + 1, j - 1)
        k_lo = i
        i = _ws(buf, j, end)
        if i >= end or buf[i] != _COLON:
            return -1
        i = _ws(buf, i + 1, end)
        if i >= end:
            return -1
        if key >= 0:
            if present & (1 << key):
                return -1  # a known key twice
            present |= 1 << key
        c = buf[i]
        if key == K_TOKENS:
            i, o = _int_list(buf, i, end, tokens, counts[C_TOK])
            if i < 0:
                return -1
            counts[C_TOK] = o
        elif key == K_MASK or key == K_IC:
            # A mask is read into the free end of the is_content buffer: only its
            # counts and slots are kept, so the next bools write over it.
            start = counts[C_IC]
            i, o, sampled, first_true, last_false = _bool_list(buf, i, end, is_content, start)
            if i < 0:
                return -1
            if key == K_IC:
                counts[C_IC] = o
                nulls &= ~NULL_IC
            else:
                n_mask = o - start
                nodes[n, N_NSAMP] = sampled
                if sampled == 0 or last_false < first_true:
                    nodes[n, N_PREFIX] = n_mask - sampled
                else:  # not canonical: slots 0 / k-th sampled token
                    nodes[n, N_PREFIX] = -1
                    nulls &= ~NULL_SLOTS
                    so = counts[C_SLOT]
                    rank = 0
                    for k in range(start, o):
                        if is_content[k]:
                            rank += 1
                            slots[so] = rank
                        else:
                            slots[so] = 0
                        so += 1
                    counts[C_SLOT] = so
        elif key == K_MESSAGE:
            if c != _LBRACE:
                return -1
            j, o, role_lo, role_hi = _value(buf, i, end, messages, counts[C_MSG], True, stack, True)
            if j < 0 or role_lo == -2:
                return -1
            counts[C_MSG] = o
            if role_lo >= 0:
                r = counts[C_ROLE]
                for k in range(role_lo, role_hi):
                    roles[r] = buf[k]
                    r += 1
                counts[C_ROLE] = r
                nulls &= ~NULL_ROLE
            i = j
        elif key == K_PARENT:
            j, v = _literal(buf, i, end)
            if j >= 0:
                if v != 2:
                    return -1
                i = j
            else:
                j, value, exact, integral = _number(buf, i, end)
                if j < 0 or not exact or not integral or value < 0 or value > 2147483647.0:
                    return -1
                nodes[n, N_PARENT] = np.int64(value)
                nulls &= ~NULL_PARENT
                i = j
        elif key == K_SAMPLED:
            j, v = _literal(buf, i, end)
            if j < 0 or v == 2:
                return -1
            nodes[n, N_SAMPLED] = v
            nulls &= ~NULL_SAMPLED
            i = j
        elif key == K_TS:
            j, value, exact, _ = _number(buf, i, end)
            if j < 0:
                return -1
            if exact:
                timestamps[n] = value
            else:
                _hard(buf, i, j, np.int64(HARD_TS), n, u8, i64, counts)
            nulls &= ~NULL_TS
            i = j
        elif key == K_SEMANTIC:
            i, empty = _list_start(buf, i, end)
            if i < 0:
                return -1
            nulls &= ~NULL_LINKS
            ln = counts[C_LINK]
            lt = counts[C_LTXT]
            while not empty:
                if i >= end or buf[i] != _LBRACE:
                    return -1
                i = _ws(buf, i + 1, end)
                have = 0  # 1 node, 2 type
                while True:
                    if i >= end or buf[i] != _QUOTE:
                        return -1
                    j, _, escaped = _string(buf, i, end, stack, i, False)
                    if j < 0 or escaped:
                        return -1
                    which = 0
                    if _match(buf, i + 1, j - 1, WORD_BYTES, WORD_OFF, W_NODE):
                        which = 1
                    elif _match(buf, i + 1, j - 1, WORD_BYTES, WORD_OFF, W_TYPE):
                        which = 2
                    if which == 0 or have & which:
                        return -1  # another key, or one twice: the slow path keeps it as written
                    have |= which
                    i = _ws(buf, j, end)
                    if i >= end or buf[i] != _COLON:
                        return -1
                    i = _ws(buf, i + 1, end)
                    if which == 1:
                        j, value, exact, integral = _number(buf, i, end)
                        if j < 0 or not exact or not integral or value < 0 or value >= index:
                            return -1  # not an earlier node: the slow path words it
                        link_nodes[ln] = np.int32(value)
                    else:
                        if i >= end or buf[i] != _QUOTE:
                            return -1
                        j, _, escaped = _string(buf, i, end, stack, i, False)
                        if j < 0 or escaped:
                            return -1
                        link_type_off[ln] = lt
                        for k in range(i + 1, j - 1):
                            link_text[lt] = buf[k]
                            lt += 1
                    i = _ws(buf, j, end)
                    if i < end and buf[i] == _COMMA:
                        i = _ws(buf, i + 1, end)
                        continue
                    if i < end and buf[i] == _RBRACE:
                        i += 1
                        break
                    return -1
                if have != 3:
                    return -1
                ln += 1
                i, empty = _list_next(buf, i, end)
                if i < 0:
                    return -1
            counts[C_LINK] = ln
            counts[C_LTXT] = lt
        elif key == K_LOSS_WEIGHTS:
            j, v = _literal(buf, i, end)
            if j < 0 or v != 2:
                return -1  # an object of weights: the slow path
            i = j
        elif key >= K_STREAM:
            s = key - K_STREAM
            j, v = _literal(buf, i, end)
            if j >= 0:
                if v != 2 or s == 0:
                    return -1  # logprobs is a list, empty when unknown: null is for the slow path to word
                i = j
            else:
                nulls &= ~(1 << (NULL_STREAM + s))
                i, o = _float_list(buf, i, end, streams[s], counts[C_STREAM + s], s, u8, i64, counts)
                if i < 0:
                    return -1
                counts[C_STREAM + s] = o
        else:  # an unknown field: kept as text
            extras[x] = _COMMA if x > counts[C_EXTRA] else _LBRACE
            x += 1
            for k in range(k_lo, j):
                extras[x] = buf[k]
                x += 1
            extras[x] = _COLON
            x += 1
            i, x, _, _ = _value(buf, i, end, extras, x, True, stack, False)
            if i < 0:
                return -1
        i = _ws(buf, i, end)
        if i >= end:
            return -1
        if buf[i] == _COMMA:
            i = _ws(buf, i + 1, end)
            continue
        if buf[i] != _RBRACE:
            return -1
        break
    i += 1
    if not present & (1 << K_MESSAGE):
        return -1  # message is required: the slow path says so
    if x > counts[C_EXTRA]:
        extras[x] = _RBRACE
        counts[C_EXTRA] = x + 1
        nulls &= ~NULL_EXTRA
    # The contract's layout and graph rules; a node that breaks one is worded by the slow path.
    n_tok = counts[C_TOK] - nodes[n, N_TOK_OFF]
    if n_mask != n_tok:
        return -1
    n_ic = counts[C_IC] - nodes[n, N_IC_OFF]
    if n_ic != 0 and n_ic != n_tok:
        return -1
    if not allow_ragged:
        k_sampled = nodes[n, N_NSAMP]
        for s in range(streams.shape[0]):
            m = counts[C_STREAM + s] - nodes[n, N_STREAM_OFF + s]
            if m != 0 and m != k_sampled:
                return -1
    if nodes[n, N_PARENT] >= index:
        return -1
    nodes[n, N_PRESENT] = present
    nodes[n, N_NULLS] = nulls
    return i
