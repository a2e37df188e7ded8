"""The credit-set registry: which named sets of advantages a database holds.

Credit sets sit side by side on the same frozen rollouts. ``default`` is the credit
ingested with the records (``nodes.advantages``); every other set is a row of
``credit_sets`` (algorithm, parameters, creation time, layout) with its values stored in
one of two ways, fixed when it is created: per trace (``layout = 'trace'``, one row per
trace in ``trace_credit``: credit constant over a trace, as grpo and rloo give) or per
node (``'node'``, one row per node in ``credit``). Every path that names a set (the
writers, the credit algorithms, counterfactual edit credit, views, the CLI and the REST
routes) goes through :func:`resolve`, so "does this set exist" has one answer.
"""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Mapping
from typing import Any

import pyarrow as pa

from tracedb.errors import NotFound, WriteError
from tracedb.handle import Handle

DEFAULT_SET = "default"
"""The credit set ingested with the records (``nodes.advantages``)."""
LAYOUTS = ("node", "trace")
"""How a named set is stored: ``node`` (table ``credit``), ``trace`` (table ``trace_credit``)."""
TABLES = {"node": "credit", "trace": "trace_credit"}
"""The table each layout's rows are in."""


def stored_name(name: str | None) -> str | None:
    """The name a set's rows are stored under: None for the default set (``None`` or
    ``"default"``: the ingested credit, on the nodes), else ``name`` (not checked to exist:
    :func:`resolve` checks)."""
    return None if name in (None, DEFAULT_SET) else name


def check_name(name: object) -> str:
    """``name`` if it can name a new credit set, else :class:`WriteError` saying why: it
    must be a non-empty string with no whitespace at either end and no control characters
    (a set is named on command lines, in URLs and in tables), and not ``default`` (the
    ingested credit). Every path that creates a set calls this."""
    if not isinstance(name, str):
        raise WriteError(f"a credit set name is a string, not {type(name).__name__} {name!r}")
    if not name.strip():
        raise WriteError(f"{name!r} cannot name a credit set: the name is empty")
    if name != name.strip():
        raise WriteError(f"{name!r} cannot name a credit set: it has whitespace at its start or end")
    if any(unicodedata.category(c).startswith("C") for c in name):
        raise WriteError(f"{name!r} cannot name a credit set: it holds a control character")
    if name == DEFAULT_SET:
        raise WriteError(f"{name!r} cannot name a credit set (the default set is the ingested credit)")
    return name


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
    if stored_name(name) is None:
        return None
    if not exists(handle, name):
        raise missing(handle, name)
    return name


def layout(handle: Handle, name: str) -> str:
    """How named set ``name`` is stored: ``"trace"`` or ``"node"`` (:class:`NotFound` when
    there is no such set)."""
    found = handle.scalar("SELECT layout FROM credit_sets WHERE name = ?", [name])
    if found is None:
        raise missing(handle, name)
    return found


def missing(handle: Handle, name: str) -> NotFound:
    """The error for a set that is not there: the sets there are, and how to make it."""
    return NotFound(
        f"credit set {name!r} does not exist; known sets: {names(handle)}; make it with "
        f"`tracedb credit ALGORITHM --name {name}` (`tracedb credit --list`: the algorithms; credit.run in Python)"
    )


def listing(handle: Handle) -> pa.Table:
    """The sets: name, algorithm, params, description, created_at, assigned nodes, layout
    (``default`` is ``node``: the ingested credit is on the nodes)."""
    return handle.sql(
        "SELECT 'default' AS name, 'ingested' AS algorithm, NULL::JSON AS params, "
        "'credit ingested with the records' AS description, NULL::TIMESTAMP AS created_at, "
        "(SELECT count(*) FROM nodes WHERE advantages IS NOT NULL) AS assigned_nodes, 'node' AS layout "
        "UNION ALL SELECT s.name, s.algorithm, s.params, s.description, s.created_at, "
        "CASE s.layout WHEN 'trace' THEN (SELECT count(*) FROM trace_credit c JOIN nodes n USING (trace_id) "
        "                                 WHERE c.credit_set = s.name AND n.n_sampled > 0) "
        "ELSE (SELECT count(*) FROM credit c WHERE c.credit_set = s.name) END, s.layout FROM credit_sets s "
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
    layout: str = "node",
) -> None:
    """Register a named set (its algorithm, parameters, creation time and ``layout``), empty.

    ``layout="node"`` (the default) stores values per node and takes every writer;
    ``"trace"`` stores one value per trace and takes only per-trace scalars
    (``write_traces`` with ``value``, a ``(trace_id, value)`` stamp). ``replace=True``
    drops an existing set of that name and its credit first."""
    check_name(name)
    if layout not in LAYOUTS:
        raise WriteError(f"credit set {name!r}: layout must be one of {list(LAYOUTS)}, not {layout!r}")
    with handle.transaction():
        if replace:
            # One statement finds the old set and removes it; a second drops its credit.
            old = handle.row("DELETE FROM credit_sets WHERE name = ? RETURNING layout", [name])
            if old is not None:
                handle.con.execute(f"DELETE FROM {TABLES[old[0]]} WHERE credit_set = ?", [name])
        elif handle.row("SELECT 1 FROM credit_sets WHERE name = ?", [name]) is not None:
            raise WriteError(f"credit set {name!r} exists; pass replace=True to recompute it")
        handle.con.execute(
            "INSERT INTO credit_sets (name, algorithm, params, description, layout) VALUES (?, ?, ?, ?, ?)",
            [name, algorithm, json.dumps(dict(params or {}), sort_keys=True, default=str), description, layout],
        )


def drop(handle: Handle, name: str) -> None:
    """Remove a named set and all its credit."""
    with handle.transaction():
        if resolve(handle, name) is None:
            raise WriteError("the default set is the ingested credit; clear it with db.clear() instead")
        old = handle.row("DELETE FROM credit_sets WHERE name = ? RETURNING layout", [name])
        handle.con.execute(f"DELETE FROM {TABLES[old[0]]} WHERE credit_set = ?", [name])
