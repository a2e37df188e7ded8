"""Memory for view columns that stays mapped between views.

A view of the benchmark database writes ~111 MB of columns and reads ~60 MB from DuckDB.
Fresh memory costs a page fault per 4 KiB page on first touch (~25 ms per 34 MB column
on the CI machine), and Arrow's allocator (mimalloc) hands freed memory back to the
kernel within milliseconds; it asks for transparent huge pages, whose faults are cheap
until memory is fragmented (say, after a few GB of Python objects were freed), when each
one waits for the kernel to compact memory: 60-250 ms per view measured. A trainer that
builds a view every few seconds would pay that on every view.

So large columns live in anonymous mappings of their own, and a mapping goes back to a
small pool when Arrow releases the last array that uses it (the array's buffer holds an
``_Owner``, whose ``__del__`` returns the mapping); the next view of a similar size writes
into pages that are already there. The pool (:func:`tracedb.runtime.idle_mappings`, state
of the process) keeps at most ``Settings.buffer_pool_bytes`` of idle mappings
(``TRACEDB_BUFFER_POOL_MB``, default 1024 MiB), largest first; ``0`` turns it off (every
column then comes from Arrow's allocator).
"""

from __future__ import annotations

import mmap

import numpy as np
import pyarrow as pa

from tracedb import runtime

_GRAIN = 1 << 20  # mapping sizes are whole MiB, so views of nearly the same size share them


class _Owner(np.ndarray):
    """The bytes of one mapping while an Arrow buffer uses them."""

    def __del__(self) -> None:
        mapping = self.__dict__.get("_tdb_mapping")
        if mapping is not None:
            try:
                # No lock (this may run inside GC, anywhere): append is atomic, and a race
                # can overshoot the budget by a mapping at most.
                if idle_bytes() + len(mapping) <= runtime.settings().buffer_pool_bytes:
                    runtime.idle_mappings().append(mapping)
            except Exception:  # interpreter shutdown: module globals may be gone already
                pass


def empty(n: int, dtype: type) -> np.ndarray:
    """An uninitialised array of ``n`` items whose memory Arrow can take without a copy
    (``values.base`` is the ``pa.Buffer``)."""
    size = n * np.dtype(dtype).itemsize
    knobs = runtime.settings()
    if size == 0 or size < knobs.buffer_min_bytes or knobs.buffer_pool_bytes <= 0:
        return np.frombuffer(pa.allocate_buffer(max(size, 1)), dtype, count=n)
    mapping = _take(size)
    owner = np.frombuffer(mapping, np.uint8, count=size).view(_Owner)
    owner._tdb_mapping = mapping
    return np.frombuffer(pa.py_buffer(owner), dtype, count=n)


def _take(size: int) -> mmap.mmap:
    """An idle mapping of ``size`` (rounded up to whole MiB) to twice that, or a new one;
    trims the pool."""
    need = -(-size // _GRAIN) * _GRAIN
    idle = runtime.idle_mappings()
    budget = runtime.settings().buffer_pool_bytes
    found = None
    others = []
    while True:
        try:
            mapping = idle.popleft()
        except IndexError:
            break
        if found is None and need <= len(mapping) <= 2 * need:
            found = mapping
        else:
            others.append(mapping)
    kept = 0
    for mapping in sorted(others, key=len, reverse=True):
        if kept + len(mapping) <= budget:
            idle.append(mapping)
            kept += len(mapping)
        # else dropped: unmapped once collected
    if found is not None:
        return found
    if hasattr(mmap, "MAP_PRIVATE"):  # private: a forked child's writes must not reach its parent's views
        return mmap.mmap(-1, need, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return mmap.mmap(-1, need)  # Windows: process-private already, and no fork


def idle_bytes() -> int:
    """Bytes of mappings waiting in the pool."""
    return sum(len(m) for m in list(runtime.idle_mappings()))
