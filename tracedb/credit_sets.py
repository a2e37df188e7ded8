"""The credit-set registry: which named sets of advantages a database holds.

Credit sets sit side by side on the same frozen rollouts. ``default`` is the credit
ingested with the records (``nodes.advantages``); every other set is a row of
``credit_sets`` (algorithm, parameters, creation time) with its values in ``credit``.
Every path that names a set (the writers, the credit algorithms, counterfactual edit
credit, views, the CLI and the REST routes) goes through :func:`resolve`, so "does this
set exist" has one answer.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from tracedb.errors import NotFound, WriteError
from tracedb.handle import Handle

DEFAULT_SET = "default"
"""The credit set ingested with the records (``nodes.advantages``)."""


def exists(handle: Handle, name: str) -> bool:
    """True for ``"default"`` and for every named set created."""
    return name == DEFAULT_SET or bool(handle.scalar("SELECT count(*) FROM credit_sets WHERE name = ?", [name]))


def names(handle: Handle) -> list[str]:
    """Every set's name, ``default`` first."""
    rows = handle.con.execute("SELECT name FROM credit_sets ORDER BY created_at, name").fetchall()
    return [DEFAULT_SET, *(r[0] for r in rows)]


def resolve(handle: Handle, name: str | None) -> str | None:
    """The set a caller means: None for the default set (``None`` or ``"default"``), else
    the named set, which must exist (:class:`NotFound`, naming the sets there are)."""
    if name in (None, DEFAULT_SET):
        return None
    if not exists(handle, name):
        raise NotFound(f"credit set {name!r} does not exist; known sets: {names(handle)}")
    return name


def listing(handle: Handle) -> pa.Table:
    """The sets: name, algorithm, params, description, created_at, assigned nodes."""
    return handle.sql(
        "SELECT 'default' AS name, 'ingested' AS algorithm, NULL::JSON AS params, "
        "'credit ingested with the records' AS description, NULL::TIMESTAMP AS created_at, "
        "(SELECT count(*) FROM nodes WHERE advantages IS NOT NULL) AS assigned_nodes "
        "UNION ALL SELECT s.name, s.algorithm, s.params, s.description, s.created_at, "
        "(SELECT count(*) FROM credit c WHERE c.credit_set = s.name) FROM credit_sets s "
        "ORDER BY created_at NULLS FIRST, name"
    )


def create(
    handle: Handle,
    name: str,
    *,
    algorithm: str = "manual",
    params: Mapping[str, Any] | None = None,
    description: str | None = None,
    replace: bool = False,
) -> None:
    """Register a named set (its algorithm, parameters and creation time), empty.

    ``replace=True`` drops an existing set of that name and its credit first."""
    if not name or name == DEFAULT_SET:
        raise WriteError(f"{name!r} cannot name a credit set (the default set is the ingested credit)")
    with handle.transaction():
        if exists(handle, name) and not replace:
            raise WriteError(f"credit set {name!r} exists; pass replace=True to recompute it")
        handle.con.execute("DELETE FROM credit WHERE credit_set = ?", [name])
        handle.con.execute("DELETE FROM credit_sets WHERE name = ?", [name])
        handle.con.execute(
            "INSERT INTO credit_sets (name, algorithm, params, description) VALUES (?, ?, ?, ?)",
            [name, algorithm, json.dumps(dict(params or {}), sort_keys=True, default=str), description],
        )


def drop(handle: Handle, name: str) -> None:
    """Remove a named set and all its credit."""
    with handle.transaction():
        if resolve(handle, name) is None:
            raise WriteError("the default set is the ingested credit; clear it with db.clear() instead")
        handle.con.execute("DELETE FROM credit WHERE credit_set = ?", [name])
        handle.con.execute("DELETE FROM credit_sets WHERE name = ?", [name])
