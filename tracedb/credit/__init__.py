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
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tracedb.errors import CreditWarning

if TYPE_CHECKING:  # imported where used: the registry is read at the command line's start
    import pyarrow as pa

    from tracedb.handle import Handle, HandleOf
    from tracedb.selection import Selection


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
        Algorithm(
            "vtrace",
            "vtrace:vtrace",
            "node",
            "V-trace: rho_s (r_s + gamma v_{s+1} - V_s), truncated ratios per turn from trainer_logprobs",
            per_node="vtrace:vtrace_per_node",
        ),
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
    selection: Selection | None = None,
    **params: Any,
) -> dict[str, Any]:
    """Compute ``algorithm`` on ``db`` (a :class:`tracedb.Database` or its handle) and
    stamp it as credit set ``name`` (default: the algorithm's name), in one transaction
    (:func:`tracedb.writeback.stamp`). Returns the set's name, algorithm, parameters and
    what was written.

    ``matched_to=SET`` (any algorithm; ``-p matched_to=SET`` on the command line) rescales
    the output per trace to the ``sum |A|`` over tokens that set gives the trace, leaving a
    trace where either is 0 as it is; the result's ``matched`` counts both kinds
    (:func:`tracedb.credit.dose.match`).

    **On a selection** (``selection=Selection(...)``, or its fields as keywords:
    ``after=W, complete_groups=N``, ``trace_ids``, ``group``, a staleness bound,
    ``max_groups``, ...): only the selected traces are stamped, into the set ``name``,
    created on first use (:mod:`tracedb.credit.selected`). Group statistics are taken over
    each selected trace's whole group as stored; a selected trace already in the set is
    refused unless ``replace=True``, which computes it again (the set's other traces stay).
    The result adds ``traces`` (selected), ``watermark`` (the ``after`` of the next step)
    and ``selection`` (what the selection left out: :attr:`Selected.report`).

    A run whose output is another algorithm's by construction (anchor with no state
    shared by two turns, redistribute with no weights, channels selecting every token)
    is done all the same, and says so under ``warnings`` (a :class:`CreditWarning`'s text each)."""
    from tracedb import credit_sets
    from tracedb.handle import handle_of

    handle = handle_of(db)
    algo = _lookup(algorithm)
    name = credit_sets.check_name(algorithm if name is None else name)  # before the work, not after it
    selection = _selection(algo, selection, params)
    matched_to = params.pop("matched_to", None)
    resolved = {**algo.params(), **params, **({} if matched_to is None else {"matched_to": matched_to})}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", CreditWarning)
        out = _stamped(handle, algo, name, selection, matched_to, params, resolved, description, replace)
    notes = []
    for w in caught:
        if issubclass(w.category, CreditWarning):
            notes.append(str(w.message))
        else:  # not ours to keep: passed on as it came
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
    return {**out, "warnings": notes} if notes else out


def _stamped(
    handle: Handle,
    algo: Algorithm,
    name: str,
    selection: Selection | None,
    matched_to: Any,
    params: dict[str, Any],
    resolved: dict[str, Any],
    description: str | None,
    replace: bool,
) -> dict[str, Any]:
    """Compute the credit and stamp it as set ``name`` (only the selected traces with a
    selection); the result :func:`run` returns, less its warnings."""
    from tracedb import writeback
    from tracedb.credit import selected

    algorithm = algo.name
    if selection is not None:
        step = selected.training_selection(selection, resolved)
        table, matched, picked, nodes = selected.stamp_selected(
            handle,
            name,
            step,
            lambda: _credit(handle, algo, matched_to, params, stamping=True),
            algorithm=algorithm,
            params=resolved,
            description=description,
            replace=replace,
        )
        out = {"name": name, "algorithm": algorithm, "params": resolved, "rows": table.num_rows, "nodes": nodes}
        out.update(traces=len(picked.traces), watermark=picked.watermark, selection=picked.report)
        return out if matched is None else {**out, "matched": matched}
    table, matched = _credit(handle, algo, matched_to, params, stamping=True)
    nodes = writeback.stamp(
        handle, name, table, algorithm=algorithm, params=resolved, description=description, replace=replace
    )
    out = {"name": name, "algorithm": algorithm, "params": resolved, "rows": table.num_rows, "nodes": nodes}
    return out if matched is None else {**out, "matched": matched}


def _selection(algo: Algorithm, selection: Selection | None, params: dict[str, Any]) -> Selection | None:
    """The selection a run stamps: ``selection``, or one built from the selection fields
    among ``params`` that are not the algorithm's own parameters (taken out of
    ``params``); both is refused."""
    from tracedb.selection import Selection

    own = algo.params()
    fields = {k: params.pop(k) for k in list(params) if k in Selection.FIELDS and k not in own}
    if not fields:
        return selection
    if selection is not None:
        raise ValueError(
            f"give the selection once: selection=Selection(...) or its fields as keywords, not both ({sorted(fields)})"
        )
    return Selection(**fields)


def _function(target: str) -> Callable[..., pa.Table]:
    module, function = target.split(":")
    return getattr(importlib.import_module(f"tracedb.credit.{module}"), function)


def _lookup(algorithm: str) -> Algorithm:
    algos = algorithms()
    if algorithm not in algos:
        raise ValueError(f"unknown credit algorithm {algorithm!r}; known: {sorted(algos)}")
    return algos[algorithm]
