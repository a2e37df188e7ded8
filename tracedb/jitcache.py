"""Whether a compiled module's loops are already in numba's on-disk cache, told without
importing numba (~0.35 s) or compiling anything.

numba caches compiled code next to the module (``__pycache__``) and gives no public way
to ask whether a call will hit that cache. After a module's kernels ran once, tracedb
leaves a marker beside numba's files naming the module's source digest, numba's version
and Python's; a marker that matches says the next process will load, not compile. Where
``__pycache__`` is not writable no marker is left and every check says "not compiled":
the cost is only that a small input takes the parser instead of the scanner.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import sys
from pathlib import Path


def _marker(module_file: str) -> Path:
    path = Path(module_file)
    return path.parent / "__pycache__" / f"{path.stem}.tracedb-compiled"


def _digest(module_file: str) -> str:
    parts = [Path(module_file).read_bytes(), importlib.metadata.version("numba").encode(), sys.version.encode()]
    return hashlib.sha256(b"\0".join(parts)).hexdigest()


def is_compiled(module_file: str) -> bool:
    """True when the module at ``module_file`` was compiled (and cached) as it is now."""
    try:
        return _marker(module_file).read_text() == _digest(module_file)
    except OSError:
        return False


def mark_compiled(module_file: str) -> None:
    """Record that the module's kernels have run (so numba has cached them)."""
    try:
        _marker(module_file).write_text(_digest(module_file))
    except OSError:
        pass  # a read-only install: no marker, see the module docstring
