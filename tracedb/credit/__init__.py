"""Credit assignment: algorithms that write advantages onto nodes as named credit sets.

Each algorithm is one small vectorized function from columns (Arrow / Polars / DuckDB)
to credit, registered in :data:`ALGORITHMS`. It returns either per-trace scalars
(``trace_id, value``: broadcast over the trace's sampled tokens) or per-node compact
lists (``trace_id, node_index, values``). :func:`run` records the set (algorithm,
parameters, creation time) and writes its credit in one transaction. A turn-level
algorithm may also register ``per_node``: the same credit as one value per node, which
:func:`run` stamps instead of expanding it into lists that the stamp collapses again.
"""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # imported where used: the registry is read at the command line's start
    import pyarrow as pa

    from tracedb.handle import Handle, HandleOf


@dataclass(frozen=True)
class Algorithm:
    name: str
    target: str  # "module:function" under tracedb.credit, imported when first used
    layout: str  # "trace" (trace_id, value) or "node" (trace_id, node_index, values)
    summary: str
    per_node: str | None = None  # "module:function": the same credit as one value per node

    @property
    def func(self) -> Callable[..., pa.Table]:
        """The algorithm's function ``(handle, **params) -> credit table`` (its module is
        imported when first used)."""
        return _function(self.target)

    @property
    def stamp_func(self) -> Callable[..., pa.Table]:
        """What :func:`run` stamps: ``per_node`` when given (the credit of :attr:`func` as
        ``(trace_id, node_index, value)``, one value per node, which turn-level credit is:
        nothing to expand into lists and collapse again), else :attr:`func`."""
        return _function(self.per_node) if self.per_node else self.func

    def params(self) -> dict[str, Any]:
        """Parameter names and defaults, from the function signature."""
        sig = inspect.signature(self.func)
        return {k: p.default for k, p in list(sig.parameters.items())[1:]}


ALGORITHMS: dict[str, Algorithm] = {
    a.name: a
    for a in (
        Algorithm("grpo", "outcome:grpo", "trace", "group-relative advantage r - mean(group), optional std scaling"),
        Algorithm("rloo", "outcome:rloo", "trace", "leave-one-out baseline r - mean(others)"),
        Algorithm(
            "returns",
            "returns:returns",
            "node",
            "discounted turn-level returns along each branch",
            per_node="returns:returns_per_node",
        ),
        Algorithm(
            "gae", "returns:gae", "node", "GAE(gamma, lambda) over each branch's turns", per_node="returns:gae_per_node"
        ),
        Algorithm("tree", "tree:tree", "node", "prefix-tree credit over shared token prefixes within a group"),
        Algorithm("reweight", "reweight:reweight", "node", "mean-preserving token reweighting of an existing set"),
        Algorithm("anchor", "anchor:anchor", "node", "GiGPO/TIGPO: episode + omega * same-state step advantage"),
        Algorithm("potential", "potential:potential", "node", "PGPO: r + gamma Phi(next state) - Phi(state)"),
        Algorithm("branch", "branch:branch", "node", "CBPO: R - V(fork) per prefix-tree segment, scaled by its spread"),
        Algorithm("redistribute", "redistribute:redistribute", "node", "a trace advantage spread over turns by weight"),
        Algorithm("channels", "channels:channels", "node", "each selected token gets its channel's reward advantage"),
    )
}
"""The one table of credit algorithms."""


def algorithms() -> dict[str, Algorithm]:
    """The registered algorithms, by name."""
    return ALGORITHMS


def compute(db: HandleOf, algorithm: str, *, matched_to: str | None = None, **params: Any) -> pa.Table:
    """Run an algorithm on ``db`` (a :class:`tracedb.Database` or its handle) without
    writing anything; returns its credit table. ``matched_to=SET`` rescales it per trace
    to the ``sum |A|`` that set gives the trace (:func:`tracedb.credit.dose.match`)."""
    from tracedb.handle import handle_of

    return _credit(handle_of(db), _lookup(algorithm), matched_to, params)[0]


def _credit(
    handle: Handle, algo: Algorithm, matched_to: str | None, params: dict[str, Any], *, stamping: bool = False
) -> tuple[pa.Table, Any]:
    from tracedb.credit import dose

    table = (algo.stamp_func if stamping else algo.func)(handle, **params)
    if matched_to is None:
        return table, None
    return dose.match(handle, table, matched_to)


def run(
    db: HandleOf,
    algorithm: str,
    name: str | None = None,
    *,
    replace: bool = False,
    description: str | None = None,
    **params: Any,
) -> dict[str, Any]:
    """Compute ``algorithm`` on ``db`` (a :class:`tracedb.Database` or its handle) and
    stamp it as credit set ``name`` (default: the algorithm's name), in one transaction
    (:func:`tracedb.writeback.stamp`). Returns the set's name, algorithm, parameters and
    what was written.

    ``matched_to=SET`` (any algorithm; ``-p matched_to=SET`` on the command line) rescales
    the output per trace to the ``sum |A|`` over tokens that set gives the trace, leaving a
    trace where either is 0 as it is; the result's ``matched`` counts both kinds
    (:func:`tracedb.credit.dose.match`)."""
    from tracedb import credit_sets, writeback
    from tracedb.handle import handle_of

    handle = handle_of(db)
    algo = _lookup(algorithm)
    name = credit_sets.check_name(algorithm if name is None else name)  # before the work, not after it
    matched_to = params.pop("matched_to", None)
    table, matched = _credit(handle, algo, matched_to, params, stamping=True)
    resolved = {**algo.params(), **params, **({} if matched_to is None else {"matched_to": matched_to})}
    nodes = writeback.stamp(
        handle, name, table, algorithm=algorithm, params=resolved, description=description, replace=replace
    )
    out = {"name": name, "algorithm": algorithm, "params": resolved, "rows": table.num_rows, "nodes": nodes}
    return out if matched is None else {**out, "matched": matched}


def _function(target: str) -> Callable[..., pa.Table]:
    module, function = target.split(":")
    return getattr(importlib.import_module(f"tracedb.credit.{module}"), function)


def _lookup(algorithm: str) -> Algorithm:
    algos = algorithms()
    if algorithm not in algos:
        raise ValueError(f"unknown credit algorithm {algorithm!r}; known: {sorted(algos)}")
    return algos[algorithm]
