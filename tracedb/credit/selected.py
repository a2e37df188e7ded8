"""Credit on a selection: stamp only the selected traces into a set, step by step.

A trainer of a live run credits each step's new groups (``after=W, complete_groups=N``, a
staleness bound, ``max_groups``) into one set, instead of recomputing the set over the
whole database with ``replace``. :func:`stamp_selected` reads the selection and runs the
algorithm in one transaction (one snapshot: the selection's watermark and the rows the
algorithm reads agree), then keeps the algorithm's rows of the selected traces and adds
them to the set, creating it on first use.

- **Statistics over what is stored.** The algorithm runs as it always does, over every
  stored trace: a group mean (grpo, rloo, tree, ...) is taken over each selected trace's
  whole group as stored at that moment, members outside the selection included, dropped
  and eval traces out of it as in any run. With ``complete_groups`` a group is credited
  once it is complete, so its statistics are those of the whole group, and stepping
  through a run gives the values one run over everything gives.
- **One algorithm per set.** A set holds one algorithm's credit with one set of
  parameters: a selection adds to a set only with the algorithm and parameters the set
  was made with (and its layout).
- **Once per trace.** A selected trace the set already holds is refused, naming the
  traces, unless ``replace=True``, which computes those traces again (their old rows go).
- **Read only the groups it needs.** For the algorithms whose statistics stay within a
  group (:data:`GROUP_LOCAL`, grouped by ``group_id``: their default; no field named
  that the algorithm checks some node has), the algorithm reads
  the selected traces' groups only (``traces``, ``nodes``, ``branches`` and ``trace_tags``
  narrowed to them for the run, :func:`scoped`), so a step costs what its groups cost,
  however long the run; any other algorithm or grouping reads everything.
- **Training selection.** The selection is a training output's (dropped traces and eval
  episodes left out unless asked for, :meth:`Selection.for_training`), so the groups a
  step credits are the groups the same selection packs (``max_groups`` included).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import duckdb
import pyarrow as pa
import pyarrow.compute as pc

from tracedb import credit_sets, writeback
from tracedb.errors import WriteError
from tracedb.handle import Handle
from tracedb.selection import Selected, Selection, resolve
from tracedb.sqltext import quote_identifier

SHOWN = 10
"""How many trace ids a refusal names (then how many more there are)."""
GROUP_LOCAL = ("grpo", "rloo", "returns", "gae", "tree", "branch", "potential", "anchor")
"""The algorithms whose credit for a trace reads only the traces of its group (by
``group_by``, when that is ``group_id``; anchor without ``history``). A run naming a field
the algorithm checks some node has (``reward_field``, a ``key_field`` of its own: a typo
check over the data) reads everything, so the check sees every node; so does ``channels``
(its roles, ``loss_weights`` names and rewards are checked the same way)."""
SCOPED_TABLES = ("traces", "nodes", "branches", "trace_tags")
"""The tables a scoped run reads narrowed to its traces."""


def training_selection(selection: Selection, params: Mapping[str, Any]) -> Selection:
    """The selection a credit run stamps: a training output's, except that an algorithm
    asked to credit dropped traces or eval work (``include_dropped=True``,
    ``include_eval=True`` among its parameters) has them selected as well."""
    changes = {
        name: True
        for name in ("include_dropped", "include_eval")
        if getattr(selection, name) is None and params.get(name) is True
    }
    if changes:
        selection = dataclasses.replace(selection, **changes)
    return selection.for_training()


def stamp_selected(
    handle: Handle,
    name: str,
    selection: Selection,
    compute: Callable[[], tuple[pa.Table, Any]],
    *,
    algorithm: str,
    params: Mapping[str, Any],
    description: str | None = None,
    replace: bool = False,
) -> tuple[pa.Table, Any, Selected, int]:
    """Resolve ``selection`` and ``compute`` the credit (``(table, extra)``) in one
    transaction, then stamp the table's rows of the selected traces into set ``name``
    (created when missing). Returns the rows stamped, ``extra``, the resolved selection and
    the nodes written. :class:`WriteError` (nothing written) for a set made by another
    algorithm, other parameters or of another layout, or for selected traces it already
    holds without ``replace``."""
    with handle.transaction():
        picked = resolve(handle, selection)
        with scoped(handle, _scope(handle, picked, algorithm, params)):
            table, extra = compute()
        ids = pa.array(picked.trace_ids, pa.string())
        table = table.filter(pc.is_in(table.column("trace_id").cast(pa.string()), value_set=ids))
        layout = writeback.stamp_layout(table)
        if not credit_sets.exists(handle, name):
            credit_sets.create(handle, name, algorithm=algorithm, params=params, description=description, layout=layout)
            return table, extra, picked, writeback.stamp_into(handle, name, table, created=True)
        _check_same(handle, name, algorithm, params, layout)
        held = _held(handle, name, layout, ids)
        if held and not replace:
            raise WriteError(
                f"credit set {name!r} already holds {len(held)} of the selected traces ({_named(held)}); "
                "pass replace=True (--replace) to compute them again; nothing written"
            )
        if held:
            with handle.registered("_tdb_restamp", pa.table({"trace_id": pa.array(held, pa.string())})):
                handle.con.execute(
                    f"DELETE FROM {credit_sets.TABLES[layout]} WHERE credit_set = ? "
                    "AND trace_id IN (SELECT trace_id FROM _tdb_restamp)",
                    [name],
                )
        return table, extra, picked, writeback.stamp_into(handle, name, table)


def _check_same(handle: Handle, name: str, algorithm: str, params: Mapping[str, Any], layout: str) -> None:
    """Refuse to add to set ``name`` credit of another algorithm, parameters or layout."""
    row = handle.row("SELECT algorithm, params, layout FROM credit_sets WHERE name = ?", [name])
    assert row is not None  # the caller found the set in this transaction
    held_algorithm, held_params, held_layout = row
    stored = json.loads(held_params) if held_params else {}
    given = json.loads(json.dumps(dict(params), sort_keys=True, default=str))
    if (held_algorithm, stored) != (algorithm, given):
        raise WriteError(
            f"credit set {name!r} holds {held_algorithm} with {json.dumps(stored, sort_keys=True)}, not {algorithm} "
            f"with {json.dumps(given, sort_keys=True)}: a set holds one algorithm's credit with one set of "
            "parameters (name another set, or recompute the whole set: replace=True without a selection); "
            "nothing written"
        )
    if held_layout != layout:
        raise WriteError(f"credit set {name!r} is stored per {held_layout}, this credit per {layout}; nothing written")


def _held(handle: Handle, name: str, layout: str, ids: pa.Array) -> list[str]:
    """The traces of ``ids`` that set ``name`` holds rows of, by id."""
    with handle.registered("_tdb_selected", pa.table({"trace_id": ids})):
        rows = handle.con.execute(
            f"SELECT DISTINCT trace_id FROM {credit_sets.TABLES[layout]} WHERE credit_set = ? "
            "AND trace_id IN (SELECT trace_id FROM _tdb_selected) ORDER BY trace_id",
            [name],
        ).fetchall()
    return [r[0] for r in rows]


def _named(ids: list[str]) -> str:
    shown = ", ".join(ids[:SHOWN])
    return shown if len(ids) <= SHOWN else f"{shown} and {len(ids) - SHOWN} more"


def _scope(handle: Handle, picked: Selected, algorithm: str, params: Mapping[str, Any]) -> list[str] | None:
    """The traces a run on ``picked`` must read: every stored member of the selected
    traces' groups (and the ungrouped selected traces), for a group-local algorithm; None
    (everything) otherwise."""
    from tracedb.credit.states import DEFAULT_KEY_FIELD  # with the algorithms, imported when first used

    if (
        algorithm not in GROUP_LOCAL
        or params.get("group_by", "group_id") != "group_id"
        or params.get("history")
        or params.get("reward_field") is not None
        or params.get("key_field", DEFAULT_KEY_FIELD) != DEFAULT_KEY_FIELD
    ):
        return None
    with handle.registered("_tdb_picked", pa.table({"trace_id": pa.array(picked.trace_ids, pa.string())})):
        rows = handle.con.execute(
            "WITH p AS (SELECT trace_id FROM _tdb_picked) SELECT trace_id FROM traces "
            "WHERE trace_id IN (SELECT trace_id FROM p) OR group_id IN "
            "(SELECT group_id FROM traces WHERE trace_id IN (SELECT trace_id FROM p) AND group_id IS NOT NULL)"
        ).fetchall()
    return [r[0] for r in rows]


@contextmanager
def scoped(handle: Handle, trace_ids: list[str] | None) -> Iterator[None]:
    """Within the block, :data:`SCOPED_TABLES` read on ``handle``'s connection hold only
    the rows of ``trace_ids`` (temporary views of the same names, which the connection
    finds before the stored tables); None: the block reads everything. The views are gone
    after the block, also when it fails."""
    if trace_ids is None:
        yield
        return
    con = handle.con
    catalog, schema = handle.row("SELECT current_database(), current_schema()")
    stored = f"{quote_identifier(catalog)}.{quote_identifier(schema)}"
    ids = pa.table({"trace_id": pa.array(trace_ids, pa.string())})
    made: list[str] = []
    try:
        with handle.registered("_tdb_scope_in", ids):
            con.execute("CREATE OR REPLACE TEMP TABLE _tdb_scope AS SELECT DISTINCT trace_id FROM _tdb_scope_in")
        made.append("TABLE temp.main._tdb_scope")
        for table in SCOPED_TABLES:
            con.execute(
                f"CREATE OR REPLACE TEMP VIEW {table} AS SELECT * FROM {stored}.{table} "
                "WHERE trace_id IN (SELECT trace_id FROM temp.main._tdb_scope)"
            )
            made.append(f"VIEW temp.main.{table}")
        yield
    finally:
        for what in reversed(made):
            try:
                con.execute(f"DROP {what}")
            except duckdb.Error:  # an aborted transaction refuses it; its ROLLBACK drops it
                pass
