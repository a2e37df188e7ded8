"""How :meth:`Lake.sql` learns what a query needs: DuckDB's optimized plan of the query,
read as scans of lake tables with their columns and pushed filters.

The query is planned over empty tables of the stored schemas (the macros installed; the
optimizers that would use those tables' emptiness switched off): DuckDB's optimized plan
(``json_serialize_plan``) names, for every scan of a lake table, the columns it reads and
the filters DuckDB pushed into it (``=``, ``<`` ..., ``IN``, ``IS [NOT] NULL``, their
``AND`` / ``OR``, bound parameters), translated here into pyiceberg expressions
(:class:`Scan`). From the plan's equi-joins on the key columns (:data:`KEYS`) it also
takes *reductions*: a scan joined on ``trace_id`` (or ``segment_id``, ``episode_id``,
``group_id``) to a scan whose filter pins that column to a few values, or to a table read
before it, only needs the rows whose key is among the other side's. Reading them is
:mod:`tracedb.lake.sqlscan`'s job.

Only what DuckDB proves is pushed: a filter it keeps above a scan (a window's or an
aggregate's output) reads the table whole, but only the columns used. Reductions follow
a key column through what keeps its values (projections, filters, joins, the groups of an
aggregate, unnests, windows, the materialized CTEs DuckDB plans correlated subqueries and
lateral joins with), so that ``trace_summary()``'s count of each trace's nodes reads the
nodes of the traces its filter keeps.
A query DuckDB cannot plan this way (not a ``SELECT``: ``DESCRIBE``, ``SHOW`` ...) gives
no scans (None), and every visible row is read.
"""

from __future__ import annotations

import json
import re
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any

import duckdb
import pyarrow as pa
from pyiceberg.expressions import (
    AlwaysFalse,
    AlwaysTrue,
    And,
    BooleanExpression,
    EqualTo,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    IsNull,
    LessThan,
    LessThanOrEqual,
    NotNull,
    Or,
)

from tracedb import sqlcheck
from tracedb.lake.catalog import lake_tables
from tracedb.sqltext import load_sql, quote_identifier

KEYS = ("trace_id", "segment_id", "episode_id", "group_id")
"""The columns a join may carry a reduction on (the lake's keys)."""
UNSTORED = {"traces": {"seq"}}
"""Columns a reader computes (never pushed to Iceberg)."""
PLANNING_OFF = (
    "statistics_propagation,empty_result_pullup,row_group_pruner,compressed_materialization,late_materialization"
)
"""The optimizers that would plan the empty tables' emptiness away instead of the query."""
_COMPARE = {
    "COMPARE_EQUAL": EqualTo,
    "COMPARE_GREATERTHAN": GreaterThan,
    "COMPARE_GREATERTHANOREQUALTO": GreaterThanOrEqual,
    "COMPARE_LESSTHAN": LessThan,
    "COMPARE_LESSTHANOREQUALTO": LessThanOrEqual,
}
_FLIPPED = {
    "COMPARE_EQUAL": "COMPARE_EQUAL",
    "COMPARE_GREATERTHAN": "COMPARE_LESSTHAN",
    "COMPARE_GREATERTHANOREQUALTO": "COMPARE_LESSTHANOREQUALTO",
    "COMPARE_LESSTHAN": "COMPARE_GREATERTHAN",
    "COMPARE_LESSTHANOREQUALTO": "COMPARE_GREATERTHANOREQUALTO",
}
_VALUE_TYPES = {"VARCHAR", "BIGINT", "INTEGER", "SMALLINT", "TINYINT", "UBIGINT", "UINTEGER", "DOUBLE", "FLOAT"}
_VALUE_TYPES |= {"BOOLEAN", "USMALLINT", "UTINYINT"}


@dataclass
class Scan:
    """One scan of a lake table in a query's optimized plan."""

    table: str
    columns: set[str]
    filter: BooleanExpression
    """What DuckDB pushed into the scan, as a pyiceberg expression (AlwaysTrue: nothing)."""
    pins: dict[str, set[Any]]
    """Columns the filter holds to a finite set of values."""
    joins: list[tuple[str, int, str]] = field(default_factory=list)
    """Reductions: (this scan's key column, the other scan's index, its column)."""


def plan(
    query: str, params: Sequence[Any] | dict[str, Any] | None = None, *, protected: Sequence[str] = ()
) -> list[Scan] | None:
    """The scans of lake tables in the optimized plan of ``query``, planned over empty
    tables of the stored schemas (a connection of the process's own, made once per
    schema); None when the plan cannot be read. A statement that does not only read (a
    COPY may not write into ``protected``) raises :class:`~tracedb.errors.SqlRefused`, a
    query DuckDB refuses its error, here, before anything of it ran."""
    with _planning:
        return _plan(_planner(), query, params, protected)


_planning = threading.Lock()
_planners: dict[Any, duckdb.DuckDBPyConnection] = {}


def _planner() -> duckdb.DuckDBPyConnection:
    """The planning connection of the stored schemas as they are (made when first asked for)."""
    schemas = lake_tables()
    key = tuple(schemas.items())
    con = _planners.get(key)
    if con is None:
        con = duckdb.connect()
        for name, schema in schemas.items():
            con.register("_tdb_empty", pa.Table.from_batches([], schema=schema))
            con.execute(f"CREATE TABLE {quote_identifier(name)} AS SELECT * FROM _tdb_empty")
            con.unregister("_tdb_empty")
        con.execute(load_sql("macros.sql"))
        con.execute(f"SET disabled_optimizers = '{PLANNING_OFF}'")
        _planners.clear()  # one schema at a time (another only when the stored schema changed)
        _planners[key] = con
    return con


def _plan(
    con: duckdb.DuckDBPyConnection,
    query: str,
    params: Sequence[Any] | dict[str, Any] | None,
    protected: Sequence[str] = (),
) -> list[Scan] | None:
    schemas = lake_tables()
    sqlcheck.check(con, query, copy_to_file=True, protected=protected)
    planned = with_literals(con, query, params)
    serialized = json.loads(
        con.execute("SELECT json_serialize_plan(?, optimize := true, skip_null := true)", [planned]).fetchall()[0][0]
    )
    if serialized.get("error") or len(serialized.get("plans", [])) != 1:
        con.execute("RESET disabled_optimizers")
        try:
            con.sql(query, params=params)  # DuckDB's own error for a bad query, else: not a plan to read
        finally:
            con.execute(f"SET disabled_optimizers = '{PLANNING_OFF}'")
        return None
    scans: list[Scan] = []
    _walk(serialized["plans"][0], scans, _Parameters(params), set(schemas), {})
    named = {n for n in schemas if re.search(rf"\b{re.escape(n)}\b", query, re.IGNORECASE)}
    if named - {s.table for s in scans}:
        return None  # a table named but not scanned (DESCRIBE, a table function): read it all
    return scans


def with_literals(con: duckdb.DuckDBPyConnection, query: str, params: Sequence[Any] | dict[str, Any] | None) -> str:
    """``query`` with its bound parameters of a string, integer or boolean value written
    in as literals, for planning only: DuckDB pushes a constant into the scans under a
    macro's CTEs, a parameter it leaves above them. The places are DuckDB's own (its
    parse's ``query_location`` of each parameter); anything it cannot parse is left."""
    if not params:
        return query
    found = json.loads(con.execute("SELECT json_serialize_sql(?)", [query]).fetchall()[0][0])
    if found.get("error"):
        return query
    values = _Parameters(params)
    places: list[tuple[int, int, str]] = []

    def visit(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("class") == "PARAMETER" and "query_location" in node:
                literal = _literal(values.value(str(node.get("identifier"))))
                if literal is not None:
                    places.append((node["query_location"], node.get("query_location_length", 0), literal))
            for value in node.values():
                visit(value)
        elif isinstance(node, list):
            for value in node:
                visit(value)

    visit(found)
    out = query
    for at, length, literal in sorted(set(places), reverse=True):
        if length <= 0 or at + length > len(out) or out[at] not in "?$":
            return query  # not where the parse says: plan the query as it is
        out = out[:at] + literal + out[at + length :]
    return out


def _literal(value: Any) -> str | None:
    if isinstance(value, bool):
        return "TRUE" if value else "FALSE"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, str):
        return "'" + value.replace("'", "''") + "'"
    return None


class _Parameters:
    def __init__(self, params: Sequence[Any] | dict[str, Any] | None) -> None:
        self.params = params

    def value(self, identifier: str) -> Any:
        if isinstance(self.params, dict):
            return self.params.get(identifier, _UNKNOWN)
        if self.params is not None and identifier.isdigit() and 0 < int(identifier) <= len(self.params):
            return self.params[int(identifier) - 1]
        return _UNKNOWN


_UNKNOWN = object()
Origin = tuple[int, str] | None
"""Where an operator's output column comes from unchanged: (scan index, column), or None."""


def _walk(
    node: dict, scans: list[Scan], params: _Parameters, names: set[str], ctes: dict[str, list[Origin] | None]
) -> list[Origin] | None:
    """Record the scans under ``node``; return the origin of each of its output columns
    (None: an operator not followed, its width unknown). ``ctes``: the origins of the
    materialized CTEs seen so far (DuckDB plans a correlated subquery and a lateral join
    as one), by index, for their references."""
    kind = node.get("type")
    below = node.get("children", [])
    if kind == "LOGICAL_MATERIALIZED_CTE" and len(below) == 2:
        ctes[str(node.get("table_index"))] = _walk(below[0], scans, params, names, ctes)
        return _walk(below[1], scans, params, names, ctes)
    children = [_walk(child, scans, params, names, ctes) for child in below]
    if kind == "LOGICAL_GET" and len(children) == 1:
        return _in_out(node, children[0])
    if kind == "LOGICAL_GET":
        return _get(node, scans, params, names)
    if kind == "LOGICAL_CTE_REF":
        return ctes.get(str(node.get("cte_index")))
    if kind == "LOGICAL_EMPTY_RESULT" and "return_types" in node:
        return [None] * len(node["return_types"])
    if kind == "LOGICAL_FILTER" and len(children) == 1 and children[0] is not None:
        mapping = node.get("projection_map") or range(len(children[0]))
        return [_at(children[0], i) for i in mapping]
    if kind == "LOGICAL_PROJECTION" and len(children) == 1:
        return [_ref(e, children[0]) for e in node.get("expressions", [])]
    if kind == "LOGICAL_AGGREGATE_AND_GROUP_BY" and len(children) == 1:
        # Groups, then aggregates, then grouping functions: a group column holds values of its input.
        groups = [_ref(g, children[0]) for g in node.get("groups", [])]
        return groups + [None] * (len(node.get("expressions", [])) + len(node.get("grouping_functions", [])))
    if kind in ("LOGICAL_UNNEST", "LOGICAL_WINDOW") and len(children) == 1 and children[0] is not None:
        return children[0] + [None] * len(node.get("expressions", []))  # the input's columns, then its own
    if kind == "LOGICAL_COMPARISON_JOIN" and len(children) == 2:
        return _join(node, children, scans)
    return None


def _ref(expression: dict, below: list[Origin] | None) -> Origin:
    return _at(below, expression["index"]) if expression.get("expression_class") == "BOUND_REF" else None


def _at(origins: list[Origin] | None, index: int) -> Origin:
    return origins[index] if origins is not None and 0 <= index < len(origins) else None


def _get(node: dict, scans: list[Scan], params: _Parameters, names: set[str]) -> list[Origin] | None:
    table = node.get("function_data", {}).get("table")
    if node.get("qname", {}).get("path") != ["seq_scan"] or table not in names:
        return None
    columns = [
        node["names"][c["index"]] if c["index"] < len(node["names"]) else None for c in node.get("column_indexes", [])
    ]
    by_projection = node.get("table_filters_by_projection", True)
    schema = lake_tables()[table]
    unstored = UNSTORED.get(table, set())
    stored = {f.name for f in schema if f.name not in unstored and not pa.types.is_nested(f.type)}  # Iceberg filters
    terms: list[BooleanExpression] = []
    pins: dict[str, set[Any]] = {}
    for entry in (node.get("table_filters") or {}).get("filters", []):
        key = entry["key"]
        column = (
            columns[key]
            if by_projection and key < len(columns)
            else (node["names"][key] if not by_projection else None)
        )
        if column is None or column not in stored:
            continue
        expression, values = _filter(column, entry["value"], params)
        terms.append(expression)
        if values is not None:
            pins[column] = values & pins[column] if column in pins else values
    index = len(scans)
    scans.append(Scan(table, {c for c in columns if c is not None}, all_of(terms), pins))
    projection = node.get("projection_ids") or range(len(columns))
    return [(index, columns[i]) if i < len(columns) and columns[i] is not None else None for i in projection]


def _in_out(node: dict, below: list[Origin] | None) -> list[Origin] | None:
    """The origins of a table in-out function's output (``unnest(n.weight_versions)`` in a
    ``FROM`` list, a lateral join): its own columns (new values), then the input columns it
    passes through unchanged (``projected_input``), as DuckDB binds them."""
    passed = node.get("projected_input") or []
    if node.get("projection_ids") or (below is None and passed):
        return None  # a projection over both parts: not followed
    return [None] * len(node.get("column_indexes") or []) + [_at(below, i) for i in passed]


def _join(node: dict, children: list[list[Origin] | None], scans: list[Scan]) -> list[Origin] | None:
    """Record the reductions a comparison join carries; return its output's origins (a
    column of either side keeps its input's values, or NULL)."""
    left, right = children
    kind = node.get("join_type")
    reduce_left = kind in ("INNER", "SEMI", "RIGHT")
    reduce_right = kind in ("INNER", "SEMI", "LEFT", "SINGLE")  # a scalar subquery: only its matches
    for condition in node.get("conditions", []):
        if condition.get("comparison") != "COMPARE_EQUAL":
            continue
        a, b = _ref(condition.get("left", {}), left), _ref(condition.get("right", {}), right)
        if a is None or b is None or a[1] not in KEYS or b[1] not in KEYS:
            continue
        if reduce_left:
            scans[a[0]].joins.append((a[1], b[0], b[1]))
        if reduce_right:
            scans[b[0]].joins.append((b[1], a[0], a[1]))
    if left is None:
        return None
    lmap = node.get("left_projection_map") or range(len(left))
    kept = [_at(left, i) for i in lmap]
    if kind in ("SEMI", "ANTI"):
        return kept
    if kind == "MARK":
        return [*kept, None]
    if right is None:
        return None
    rmap = node.get("right_projection_map") or range(len(right))
    return kept + [_at(right, i) for i in rmap]


def _filter(column: str, spec: dict, params: _Parameters) -> tuple[BooleanExpression, set[Any] | None]:
    """A DuckDB table filter on ``column`` as a pyiceberg expression (AlwaysTrue when not
    understood: reading more is always right) and the finite set of values it allows."""
    kind = spec.get("filter_type", "")
    if kind.endswith("CONSTANT_COMPARISON"):
        value = _constant(spec.get("constant", {}))
        return _compare(column, spec.get("comparison_type", ""), value)
    if kind.endswith("IN_FILTER"):
        values = [_constant(v) for v in spec.get("values", [])]
        if any(v is _UNKNOWN for v in values):
            return AlwaysTrue(), None
        return (In(column, values) if values else AlwaysFalse()), set(values)
    if kind.endswith("OPTIONAL_FILTER") and "child_filter" in spec:
        return _filter(column, spec["child_filter"], params)
    if kind.endswith("IS_NULL"):
        return IsNull(column), None
    if kind.endswith("IS_NOT_NULL"):
        return NotNull(column), None
    if kind.endswith("CONJUNCTION_AND") or kind.endswith("CONJUNCTION_OR"):
        parts = [_filter(column, child, params) for child in spec.get("child_filters", [])]
        if not parts:
            return AlwaysTrue(), None
        if kind.endswith("AND"):
            known = [v for _, v in parts if v is not None]
            return all_of([e for e, _ in parts]), reduce(set.intersection, known) if known else None
        values = None if any(v is None for _, v in parts) else set().union(*(v for _, v in parts))
        return reduce(Or, [e for e, _ in parts]), values
    if kind == "EXPRESSION_FILTER":
        return _expression(column, spec.get("expr", {}), params)
    return AlwaysTrue(), None


def _expression(column: str, expr: dict, params: _Parameters) -> tuple[BooleanExpression, set[Any] | None]:
    """``column <op> value`` where value is a constant or a bound parameter."""
    kind = expr.get("type", "")
    children = expr.get("children", [])
    if kind not in _FLIPPED or len(children) != 2:
        return AlwaysTrue(), None
    sides = [_operand(c, params) for c in children]
    if sides[0] == "column" and sides[1] not in ("column", _UNKNOWN):
        return _compare(column, kind, sides[1])
    if sides[1] == "column" and sides[0] not in ("column", _UNKNOWN):
        return _compare(column, _FLIPPED[kind], sides[0])
    return AlwaysTrue(), None


def _operand(expr: dict, params: _Parameters) -> Any:
    kind = expr.get("expression_class")
    if kind == "BOUND_REF":
        return "column"
    if kind == "BOUND_CONSTANT":
        return _constant(expr.get("value", {}))
    if kind == "BOUND_PARAMETER":
        value = params.value(str(expr.get("identifier")))
        return value if isinstance(value, str | int | float | bool) and value is not _UNKNOWN else _UNKNOWN
    return _UNKNOWN


def _constant(value: dict) -> Any:
    if value.get("is_null") or value.get("type", {}).get("id") not in _VALUE_TYPES:
        return _UNKNOWN
    return value.get("value", _UNKNOWN)


def _compare(column: str, kind: str, value: Any) -> tuple[BooleanExpression, set[Any] | None]:
    if value is _UNKNOWN or kind not in _COMPARE:
        return AlwaysTrue(), None
    return _COMPARE[kind](column, value), ({value} if kind == "COMPARE_EQUAL" else None)


def all_of(terms: Iterable[BooleanExpression]) -> BooleanExpression:
    return reduce(And, terms, AlwaysTrue())


# ------------------------------------------------------------------------ reading
