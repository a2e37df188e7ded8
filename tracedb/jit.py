"""How tracedb compiles its loops (numba): once per install, cached on disk."""

from __future__ import annotations

from typing import Any

import numba


def compiled(fn: Any) -> Any:
    """``fn`` compiled without the GIL, cached next to its module (or in numba's user
    cache); where no cache location is writable numba refuses ``cache=True``, and the
    function is compiled once per process instead."""
    try:
        return numba.njit(cache=True, nogil=True)(fn)
    except RuntimeError:
        return numba.njit(nogil=True)(fn)


inline = numba.njit(inline="always")
"""Small helpers, compiled into their callers."""
