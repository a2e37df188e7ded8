"""The runs a server compares: named when it starts (``tracedb serve --db a.duckdb --db
name=b.duckdb``), never from a request. A request names runs; the server alone knows their
files, so no query string reaches a path.

The first run is the server's own file (the one every other route serves, held by its
backend); the others are opened read-only for the request that reads them and closed after.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path

import duckdb

import tracedb
from tracedb.database import Database
from tracedb.errors import TraceDBError

from .errors import ApiError, invalid, not_found

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
MAX_COMPARED = 8
"""Runs one comparison shows at most."""


def default_name(path: str | Path) -> str:
    """A run's name when none is given: its file's stem, other characters as '_'."""
    stem = re.sub(r"[^A-Za-z0-9_.-]", "_", Path(path).stem).lstrip("._-")[:64]
    return stem or "run"


def parse_run(text: str) -> tuple[str, Path]:
    """``name=path`` or ``path`` (named by its file's stem): the name and the path; a
    ValueError naming what is wrong."""
    name, sep, path = text.partition("=")
    if not sep or Path(text).exists():  # a file whose name holds '=' is a path
        name, path = default_name(text), text
    if not path:
        raise ValueError(f"--db {text!r}: no path after {name}=")
    if not NAME.match(name):
        raise ValueError(
            f"--db {text!r}: a run's name is letters, digits, '_', '.', '-' (at most 64, "
            f"not starting with a sign); got {name!r} (write NAME=PATH to choose one)"
        )
    return name, Path(path)


class Runs:
    """The server's named runs: ``primary`` (its own file) first, then the others."""

    def __init__(self, primary: str, path: Path, others: Mapping[str, str | Path] | None = None) -> None:
        if not NAME.match(primary):
            raise ValueError(f"run name {primary!r}: letters, digits, '_', '.', '-' only (at most 64)")
        self.primary = primary
        self.paths: dict[str, Path] = {primary: Path(path)}
        for name, other in (others or {}).items():
            if not NAME.match(name):
                raise ValueError(f"run name {name!r}: letters, digits, '_', '.', '-' only (at most 64)")
            if name in self.paths:
                raise ValueError(f"two runs are named {name!r}: name one of them (--db NAME=PATH)")
            if not Path(other).is_file():
                raise ValueError(f"run {name!r}: no database at {other}")
            if Path(other).resolve() == Path(path).resolve():
                raise ValueError(f"run {name!r} is the server's own file ({path}, run {primary!r})")
            self.paths[name] = Path(other)

    @property
    def names(self) -> list[str]:
        return list(self.paths)

    def chosen(self, text: str | None, more: list[str] | None = None) -> list[str]:
        """The run names a ``runs=a,b`` parameter (and repeated ``run=`` ones, as a form
        sends them) ask for (default: every run, up to ``MAX_COMPARED``); 404 naming the
        runs there are for an unknown one."""
        names = [n.strip() for n in (text or "").split(",") + (more or []) if n.strip()]
        if not names:
            return self.names[:MAX_COMPARED]
        if len(names) > MAX_COMPARED:
            raise invalid(f"runs: at most {MAX_COMPARED} runs side by side, got {len(names)}")
        if len(set(names)) != len(names):
            raise invalid(f"runs: a run named twice in {','.join(names)!r}")
        for name in names:
            if name not in self.paths:
                raise not_found(f"runs: no run named {name!r}; this server has {', '.join(self.names)}")
        return names

    @contextmanager
    def open(self, name: str, primary: Database) -> Iterator[Database]:
        """The run ``name``'s database: ``primary`` for the server's own, else its file read-only."""
        if name == self.primary:
            yield primary
            return
        try:
            db = tracedb.connect(self.paths[name], read_only=True)
        except (TraceDBError, duckdb.Error, OSError) as e:
            raise ApiError(
                409, "run_unavailable", f"run {name!r} ({self.paths[name]}) cannot be read now: {e}"
            ) from None
        with db:
            yield db
