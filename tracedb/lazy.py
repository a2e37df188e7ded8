"""Names a package exports, imported when first used (PEP 562 module ``__getattr__``).

A process pays for what it touches: ``import tracedb`` or the ``tracedb`` command's start
must not import DuckDB, Arrow, Polars or numba for a name nobody asked for. A package
lists its exports as ``{"name": "module:attribute"}`` (or ``{"name": "module"}`` for a
submodule) and hands :func:`exports`' two functions to its module as ``__getattr__`` and
``__dir__``; ``from package import name`` and ``package.name`` then import the module on
first use and keep the value in the package, so later uses cost a dict lookup.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping
from typing import Any


def exports(package: str, names: Mapping[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``(__getattr__, __dir__)`` for ``package``, exporting ``names`` lazily."""

    def getattr_(name: str) -> Any:
        target = names.get(name)
        if target is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module, _, attribute = target.partition(":")
        value = importlib.import_module(module)
        if attribute:
            value = getattr(value, attribute)
        setattr(sys.modules[package], name, value)
        return value

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *names})

    return getattr_, dir_
