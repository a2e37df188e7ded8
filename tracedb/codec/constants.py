"""The constants of the stored encodings (:mod:`tracedb.codec`), apart from its compiled
loops so that reading them imports no numba (a small ingest encodes in numpy)."""

from __future__ import annotations

import numpy as np

BASE = 32  # the code point of value 0 (no control character: text stays printable)
GAP = 0x800  # the surrogates U+D800..U+DFFF, skipped
SURROGATE = 0xD800
UMAX = 0x10FFFF - BASE - GAP
POW10 = np.array([10.0**d for d in range(10)], dtype=np.float64)
MAX_DECIMALS = 9

# Stream row forms (the first byte of a row's text).
NONNEG, NONPOS, MIXED, DECIMAL = 43, 45, 126, 61  # '+', '-', '~', '='
