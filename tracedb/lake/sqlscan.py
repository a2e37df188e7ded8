"""SQL over a lake reading only what the query needs (what :meth:`Lake.sql` runs).

A query is planned twice. First over empty tables of the stored schemas (the macros
installed; the optimizers that would use those tables' emptiness switched off): DuckDB's
optimized plan (``json_serialize_plan``) names, for every scan of a lake table, the
columns it reads and the filters DuckDB pushed into it (``=``, ``<`` ..., ``IN``, ``IS
[NOT] NULL``, their ``AND`` / ``OR``, bound parameters). From the plan's equi-joins on
the key columns (:data:`KEYS`) it also takes *reductions*: a scan joined on ``trace_id``
(or ``segment_id``, ``episode_id``, ``group_id``) to a scan whose filter pins that column
to a few values, or to a table read before it (``traces`` before the per-trace tables,
``nodes`` before ``segments``), only needs the rows whose key is among the other side's.
Each table is then scanned once by pyiceberg with the OR of its scans' filters as the row
filter (a trace id reaches Iceberg's ``bucket(16, trace_id)`` partitions and the files'
statistics: a one-trace query reads one file per table) and the union of their columns,
the visibility rule of :mod:`tracedb.lake.read` is applied to what was read, and the
query runs over those tables. Every filter is still applied by DuckDB: the tables only
ever hold a superset of the rows each scan needs, so the answers are the ones over every
visible row (tested against full materialization and the file store).

Only what DuckDB proves is pushed: a filter it keeps above a scan (``branch_stats()``'s
``WHERE trace_id = ...`` stays above the lateral ``unnest`` of the branch paths; an
aggregate's, window's or CTE's columns) reads the table whole, but only the columns used
(``branch_stats()`` reads neither segments nor the nodes' streams). A query DuckDB cannot
plan this way (not a ``SELECT``: ``DESCRIBE``, ``SHOW`` ...) reads every visible row.

Why not option (a), a lazily scanned ``pyarrow.dataset`` of the snapshot's files under
DuckDB (projection and filters pushed into the Arrow scan): Arrow cannot prune Iceberg's
partitions (a murmur3 bucket of the trace id is not an Arrow expression) and the files'
min/max trace ids span every hash, so a one-trace filter still reads every file's
columns (measured on the 256-trace benchmark lake: a ``nodes`` file, one row group, has
a trace-id range holding 85% of the ids on average, so about 14 of its 16 files are read
whole for one trace, against 1 here); it would also have to apply
delete files and field-id mapping itself, which pyiceberg's scan does. Why not option
(b) on the parsed statement (``json_serialize_sql``): a predicate outside a macro call
says nothing about the macro's tables without the macro's semantics; the optimized plan
is DuckDB's own answer to that.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any
from urllib.parse import unquote

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
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

from tracedb import sqlcheck, sqlvalues
from tracedb.lake import read
from tracedb.lake.catalog import BATCH, lake_tables, per_trace
from tracedb.lake.scan import scan_keys, visible_traces
from tracedb.sqltext import load_sql, quote_identifier

KEYS = ("trace_id", "segment_id", "episode_id", "group_id")
"""The columns a join may carry a reduction on (the lake's keys)."""
REDUCTION_LIMIT = 20_000
"""The most key values one reduction sends to a scan as an ``IN`` list (more: not reduced)."""
KEY_SCAN_MIN = 256
"""Key sets larger than this are read by key (:func:`tracedb.lake.scan.scan_keys`), not
as a pyiceberg ``In`` row filter."""
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


@dataclass
class ScanReport:
    """What :func:`run` read from the lake."""

    pushed: bool = True
    """False when the plan could not be read and every visible row was scanned."""
    files: dict[str, int] = field(default_factory=dict)
    """Data files scanned per table."""
    rows: dict[str, int] = field(default_factory=dict)
    """Rows scanned per table (before the visibility rule; of ``traces``, the visible ones)."""
    filters: dict[str, str] = field(default_factory=dict)
    """The row filter each table was scanned with."""


def run(
    lake: Any, query: str, params: Sequence[Any] | dict[str, Any] | None = None, *, portable: bool = False
) -> tuple[pa.Table, ScanReport]:
    """The result of ``query`` (with ``params``) over the lake's visible rows and the
    :class:`ScanReport` of what was read for it. Only reads run: every statement is
    checked first (:mod:`tracedb.sqlcheck`; ``COPY (query) TO 'file'`` outside the lake's
    own files is allowed), :class:`~tracedb.errors.SqlRefused` otherwise. ``portable``:
    :func:`tracedb.sqlvalues.portable`."""
    scans = plan(query, params, protected=lake_files(lake))
    if scans is None:
        tables, report = read.visible(lake), ScanReport(pushed=False)
    else:
        tables, report = read_for(lake, scans)
    con = duckdb.connect()
    try:
        for name, table in tables.items():
            con.register(name, table)
        con.execute(load_sql("macros.sql"))
        result = con.sql(query, params=params)
        if result is None:
            return pa.table({}), report
        return (sqlvalues.portable(result) if portable else result).to_arrow_table(), report
    finally:
        con.close()


def plan(
    query: str, params: Sequence[Any] | dict[str, Any] | None = None, *, protected: Sequence[str] = ()
) -> list[Scan] | None:
    """The scans of lake tables in the optimized plan of ``query``, planned over empty
    tables of the stored schemas (in a connection of its own); None when the plan cannot
    be read. A statement that does not only read (a COPY may not write into
    ``protected``) raises :class:`~tracedb.errors.SqlRefused`, a query DuckDB refuses
    its error, here, before anything of it ran."""
    con = duckdb.connect()
    try:
        return _plan(con, query, params, protected)
    finally:
        con.close()


def lake_files(lake: Any) -> list[str]:
    """The local files and directories of a lake's catalog and warehouse (none for a
    remote one): what its SQL may not write into."""
    properties = lake.location.properties
    out = []
    for key, scheme in (("uri", "sqlite:///"), ("warehouse", "file://")):
        value = properties.get(key, "")
        if value.startswith(scheme):
            out.append("/" + unquote(value[len(scheme) :]).lstrip("/"))
    return out


def _plan(
    con: duckdb.DuckDBPyConnection,
    query: str,
    params: Sequence[Any] | dict[str, Any] | None,
    protected: Sequence[str] = (),
) -> list[Scan] | None:
    schemas = lake_tables()
    for name, schema in schemas.items():
        con.register("_tdb_empty", pa.Table.from_batches([], schema=schema))
        con.execute(f"CREATE TABLE {quote_identifier(name)} AS SELECT * FROM _tdb_empty")
        con.unregister("_tdb_empty")
    con.execute(load_sql("macros.sql"))
    sqlcheck.check(con, query, copy_to_file=True, protected=protected)
    con.execute(f"SET disabled_optimizers = '{PLANNING_OFF}'")
    serialized = json.loads(
        con.execute("SELECT json_serialize_plan(?, optimize := true, skip_null := true)", [query]).fetchone()[0]
    )
    if serialized.get("error") or len(serialized.get("plans", [])) != 1:
        con.execute("RESET disabled_optimizers")
        con.sql(query, params=params)  # DuckDB's own error for a bad query, else: not a plan to read
        return None
    scans: list[Scan] = []
    _walk(serialized["plans"][0], scans, _Parameters(params), set(schemas))
    named = {n for n in schemas if re.search(rf"\b{re.escape(n)}\b", query, re.IGNORECASE)}
    if named - {s.table for s in scans}:
        return None  # a table named but not scanned (DESCRIBE, a table function): read it all
    return scans


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


def _walk(node: dict, scans: list[Scan], params: _Parameters, names: set[str]) -> list[Origin] | None:
    """Record the scans under ``node``; return the origin of each of its output columns
    (None: an operator not followed, its width unknown)."""
    kind = node.get("type")
    children = [_walk(child, scans, params, names) for child in node.get("children", [])]
    if kind == "LOGICAL_GET":
        return _get(node, scans, params, names)
    if kind == "LOGICAL_EMPTY_RESULT" and "return_types" in node:
        return [None] * len(node["return_types"])
    if kind == "LOGICAL_FILTER" and len(children) == 1 and children[0] is not None:
        mapping = node.get("projection_map") or range(len(children[0]))
        return [_at(children[0], i) for i in mapping]
    if kind == "LOGICAL_PROJECTION" and len(children) == 1:
        return [_ref(e, children[0]) for e in node.get("expressions", [])]
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
    scans.append(Scan(table, {c for c in columns if c is not None}, _all(terms), pins))
    projection = node.get("projection_ids") or range(len(columns))
    return [(index, columns[i]) if i < len(columns) and columns[i] is not None else None for i in projection]


def _join(node: dict, children: list[list[Origin] | None], scans: list[Scan]) -> list[Origin] | None:
    left, right = children
    kind = node.get("join_type")
    reduce_left = kind in ("INNER", "SEMI", "RIGHT")
    reduce_right = kind in ("INNER", "SEMI", "LEFT")
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
    if kind in ("SEMI", "ANTI", "MARK", "SINGLE") or left is None or right is None:
        return None
    lmap = node.get("left_projection_map") or range(len(left))
    rmap = node.get("right_projection_map") or range(len(right))
    return [_at(left, i) for i in lmap] + [_at(right, i) for i in rmap]


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
            return _all([e for e, _ in parts]), reduce(set.intersection, known) if known else None
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


def _all(terms: Iterable[BooleanExpression]) -> BooleanExpression:
    return reduce(And, terms, AlwaysTrue())


# ------------------------------------------------------------------------ reading


def _order(name: str) -> int:
    """Which tables are read before which (a reduction by data needs the other read first)."""
    return {"traces": 0, "episodes": 1, "credit_sets": 1, "segments": 3, "rejects": 4}.get(name, 2)


class _Reader:
    def __init__(self, lake: Any, scans: list[Scan]) -> None:
        self.lake = lake
        self.scans = scans
        self.read: dict[str, pa.Table] = {}
        self.report = ScanReport()

    def values(self, scan: Scan, column: str, other: int, other_column: str) -> set[Any] | None:
        """The values of ``column`` a scan can need through its join with scan ``other``."""
        source = self.scans[other]
        if other_column in source.pins:
            return source.pins[other_column]
        if _order(source.table) < _order(scan.table) and source.table in self.read:
            found = self.read[source.table]
            if other_column in found.column_names:
                values = set(pc.unique(found.column(other_column).drop_null()).to_pylist())
                return values if len(values) <= REDUCTION_LIMIT else None
        return None

    def restriction(self, name: str) -> tuple[BooleanExpression, dict[str, set[Any] | None]]:
        """The row filter table ``name`` is scanned with (the OR of its scans', each with
        its reductions) and, per key, the values it is held to (None: any)."""
        terms: list[BooleanExpression] = []
        keys: dict[str, set[Any] | None] = {}
        for scan in (s for s in self.scans if s.table == name):
            held = {k: set(v) for k, v in scan.pins.items() if k in KEYS}
            for column, other, other_column in scan.joins:
                values = self.values(scan, column, other, other_column)
                if values is not None:
                    held[column] = values & held[column] if column in held else set(values)
            extra = [In(k, sorted(v)) if v else AlwaysFalse() for k, v in held.items() if v != scan.pins.get(k)]
            terms.append(_all([scan.filter, *extra]))
            for key in KEYS:  # held to a set by every scan: their union; else any value
                if key not in keys or keys[key] is not None:
                    keys[key] = None if key not in held else (keys.get(key) or set()) | held[key]
        return (reduce(Or, terms) if terms else AlwaysFalse()), keys

    def scan(
        self,
        name: str,
        row_filter: BooleanExpression,
        columns: Iterable[str],
        keys: tuple[str, set[Any]] | None = None,
    ) -> pa.Table:
        """The rows of ``name`` that ``row_filter`` keeps (``columns`` of them). With
        ``keys`` (a column the table is bucketed on and the values ``row_filter`` holds
        it to) of more than :data:`KEY_SCAN_MIN` values, the rows of those keys are read
        by :func:`~tracedb.lake.scan.scan_keys` instead (pyiceberg binds an ``In`` filter
        literal by literal: a minute for every segment id of a 256-trace lake); the rest
        of ``row_filter`` is then not pushed, which reads a superset: the query applies
        every filter again."""
        table = self.lake.table(name)
        fields = tuple(dict.fromkeys(c for c in columns if c in table.schema().column_names))
        if keys is not None and len(keys[1]) > KEY_SCAN_MIN and name != "traces":
            files: list[str] = []
            got = scan_keys(table, keys[0], sorted(keys[1]), [c for c in fields if c != keys[0]], files=files)
            got = got.select([c for c in fields if c in got.column_names])
            self.report.files[name] = self.report.files.get(name, 0) + len(files)
            self.report.rows[name] = self.report.rows.get(name, 0) + got.num_rows
            self.report.filters[name] = f"{keys[0]} in {len(keys[1])} keys (scan_keys)"
            return got
        scan = table.scan(row_filter=row_filter, selected_fields=fields)
        tasks = list(scan.plan_files())
        self.report.files[name] = self.report.files.get(name, 0) + len(tasks)
        if name == "traces":
            got = visible_traces(table, row_filter, [c for c in fields if c != "seq"])
        else:
            got = scan.to_arrow() if tasks else pa.Table.from_batches([], table.schema().select(*fields).as_arrow())
        self.report.rows[name] = self.report.rows.get(name, 0) + got.num_rows
        self.report.filters[name] = str(row_filter)
        return got


def read_for(lake: Any, scans: list[Scan]) -> tuple[dict[str, pa.Table], ScanReport]:
    """The visible rows the ``scans`` need, every lake table by name in the stored
    schema (a table no scan reads is empty), and what was read."""
    reader = _Reader(lake, scans)
    schemas = lake_tables()
    used = {s.table for s in scans}
    columns = {name: set().union(*(s.columns for s in scans if s.table == name)) for name in used}
    con = duckdb.connect()
    out: dict[str, pa.Table] = {}
    try:
        # The traces the other tables' visibility needs, with the query's own traces rows.
        wanted: set[str] | None = set()
        everything = "episodes" in used  # an episode row is visible through any of its traces
        for name in used:
            if per_trace(name, schemas[name]) and name != "traces":
                _, keys = reader.restriction(name)
                has_join_to_traces = all(
                    any(reader.scans[o].table == "traces" and c == "trace_id" for c, o, _ in s.joins)
                    for s in scans
                    if s.table == name
                )
                if keys.get("trace_id") is None and not has_join_to_traces:
                    everything = True
                elif keys.get("trace_id") is not None and wanted is not None:
                    wanted |= keys["trace_id"]
        own, _ = reader.restriction("traces") if "traces" in used else (AlwaysFalse(), {})
        if everything:
            trace_filter: BooleanExpression = AlwaysTrue()
        else:
            trace_filter = Or(own, In("trace_id", sorted(wanted))) if wanted else own
        trace_columns = {"trace_id", BATCH, "episode_id", "seq", *columns.get("traces", ())}
        vis = reader.scan("traces", trace_filter, trace_columns)  # the visible rows
        con.register("vis", vis)
        reader.read["traces"] = vis
        out["traces"] = vis
        if used & {"credit", "trace_credit"}:
            used = used | {"credit_sets"}  # credit values show only with their set's row
        for name in sorted(used - {"traces"}, key=_order):
            if name == "segments":
                continue
            row_filter, keys_of = reader.restriction(name)
            if name in ("rejects", "credit_sets"):
                row_filter = AlwaysTrue()  # deduplicated over all their columns: read whole (small)
            keys = {"trace_id", BATCH} if per_trace(name, schemas[name]) else {"episode_id", BATCH}
            keys |= {"credit_set"} & set(schemas[name].names)  # credit values show with their set's row
            need = columns.get(name, set()) | (
                keys if name not in ("rejects", "credit_sets") else set(schemas[name].names)
            )
            held = keys_of.get("trace_id") if per_trace(name, schemas[name]) else None
            raw = reader.scan(name, row_filter, need, keys=None if held is None else ("trace_id", held))
            out[name] = read.visible_rows(con, name, raw)
            if name == "credit_sets":
                con.register(read.VISIBLE_SETS, out[name].select(["name"]))
            reader.read[name] = out[name]
        if "segments" in used:
            out["segments"] = _segments(con, reader, columns["segments"])
    finally:
        con.close()
    return {name: read.stored(name, out.get(name)) for name in schemas}, reader.report


def _segments(con: duckdb.DuckDBPyConnection, reader: _Reader, columns: set[str]) -> pa.Table:
    """The segments the scans need: used by a visible node, each once; when every scan of
    segments joins a nodes scan on segment_id, only those nodes' segments."""
    row_filter, keys = reader.restriction("segments")
    used = keys.get("segment_id")
    if used is None:  # every visible node's segments (read.visible's rule)
        traces = reader.scan("traces", AlwaysTrue(), ("trace_id", BATCH))
        con.register("all_traces", traces)
        nodes = reader.scan("nodes", AlwaysTrue(), ("trace_id", BATCH, "segment_id"))
        con.register("all_nodes", nodes)
        found = con.sql(
            f"SELECT DISTINCT n.segment_id FROM all_nodes n SEMI JOIN all_traces t "
            f"ON n.trace_id = t.trace_id AND n.{BATCH} = t.{BATCH}"
        ).to_arrow_table()
        used = set(found.column("segment_id").to_pylist())
        if len(used) <= KEY_SCAN_MIN:  # more are read by key (reader.scan), not through a filter
            row_filter = And(row_filter, In("segment_id", sorted(used))) if used else AlwaysFalse()
    if not used:
        row_filter = AlwaysFalse()
    raw = reader.scan("segments", row_filter, columns | {"segment_id"}, keys=("segment_id", used))
    return read.visible_segments(con, raw, used)


__all__ = ["KEYS", "REDUCTION_LIMIT", "Scan", "ScanReport", "plan", "read_for", "run"]
