"""SQL over a lake reading only what the query needs (what :meth:`Lake.sql` runs).

The query's scans come from its optimized plan (:mod:`tracedb.lake.sqlplan`). Each table
is then scanned once by pyiceberg with the OR of its scans' filters as the row filter (a
trace id reaches Iceberg's ``bucket(N, trace_id)`` partitions and the files' statistics:
a one-trace query reads one file per table) and the union of their columns, large key
sets read by key (:func:`tracedb.lake.scan.scan_keys`), the visibility rule of
:mod:`tracedb.lake.read` applied to what was read, and the query runs over those tables.
Every filter is still applied by DuckDB: the tables only ever hold a superset of the rows
each scan needs, so the answers are the ones over every visible row (tested against full
materialization and the file store).

Why not a lazily scanned ``pyarrow.dataset`` of the snapshot's files under DuckDB
(projection and filters pushed into the Arrow scan): Arrow cannot prune Iceberg's
partitions (a murmur3 bucket of the trace id is not an Arrow expression) and the files'
min/max trace ids span every hash, so a one-trace filter still reads every file's
columns (measured on the 256-trace benchmark lake: a ``nodes`` file, one row group, has
a trace-id range holding 85% of the ids on average, so about 14 of its 16 files are read
whole for one trace, against 1 here); it would also have to apply delete files and
field-id mapping itself, which pyiceberg's scan does. Why not the parsed statement
(``json_serialize_sql``): a predicate outside a macro call says nothing about the
macro's tables without the macro's semantics; the optimized plan is DuckDB's own answer.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from functools import reduce
from typing import Any
from urllib.parse import unquote

import duckdb
import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.expressions import AlwaysFalse, AlwaysTrue, And, BooleanExpression, In, Or

from tracedb import sqlvalues
from tracedb.lake import files as lake_data
from tracedb.lake import read
from tracedb.lake.catalog import BATCH, lake_tables, per_trace
from tracedb.lake.scan import scan_keys, visible_traces
from tracedb.lake.sqlplan import KEYS, Scan, all_of, plan
from tracedb.sqltext import load_sql, quote_identifier

REDUCTION_LIMIT = 20_000
"""The most key values one reduction sends to a scan as an ``IN`` list (more: not reduced)."""
KEY_SCAN_MIN = 256
"""Key sets larger than this are read by key (:func:`tracedb.lake.scan.scan_keys`), not
as a pyiceberg ``In`` row filter."""


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
    con = _runner()
    try:
        for name, table in tables.items():
            con.register(name, table)
        result = con.sql(query, params=params)
        if result is None:
            return pa.table({}), report
        return (sqlvalues.portable(result) if portable else result).to_arrow_table(), report
    finally:
        con.close()


_base: dict[Any, duckdb.DuckDBPyConnection] = {}
_base_lock = threading.Lock()


def _runner() -> duckdb.DuckDBPyConnection:
    """A connection of its own for one query, on the process's database holding
    tracedb's macros over empty tables of the stored schemas (made once per schema): the
    query's tables, registered on it alone, stand in for those."""
    schemas = lake_tables()
    key = tuple(schemas.items())
    with _base_lock:
        made = _base.get(key)
        if made is None:
            made = duckdb.connect()
            for name, schema in schemas.items():
                made.register("_tdb_empty", pa.Table.from_batches([], schema=schema))
                made.execute(f"CREATE TABLE {quote_identifier(name)} AS SELECT * FROM _tdb_empty")
                made.unregister("_tdb_empty")
            made.execute(load_sql("macros.sql"))
            _base.clear()
            _base[key] = made
        return made.cursor()


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
            terms.append(all_of([scan.filter, *extra]))
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
        chosen = lake_data.pruned(table, row_filter)
        self.report.files[name] = self.report.files.get(name, 0) + len(chosen)
        if name == "traces":
            got = visible_traces(table, row_filter, [c for c in fields if c != "seq"])
        else:
            got = lake_data.read(table, chosen, fields, row_filter=row_filter)
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
    con = lake_data.duck()
    out: dict[str, pa.Table] = {}
    try:
        # The traces the other tables' visibility needs, with the query's own traces rows.
        wanted: set[str] | None = set()
        # An episode row is visible through any of its traces: a scan of episodes not held
        # to the episodes of the traces read (or pinned ones) needs every visible trace.
        everything = not all(_episodes_bounded(scans, s) for s in scans if s.table == "episodes")
        bounded = _bounded(scans)
        for name in used:
            if per_trace(name, schemas[name]) and name != "traces":
                _, keys = reader.restriction(name)
                if keys.get("trace_id") is None and not all(bounded[i] for i, s in enumerate(scans) if s.table == name):
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
            whole = name in ("rejects", "credit_sets", "policy_labels")
            if whole:
                row_filter = AlwaysTrue()  # deduplicated over their columns: read whole (small)
            keys = {"trace_id", BATCH} if per_trace(name, schemas[name]) else {"episode_id", BATCH}
            keys |= {"credit_set"} & set(schemas[name].names)  # credit values show with their set's row
            need = columns.get(name, set()) | (keys if not whole else set(schemas[name].names))
            if name == "episodes" and not everything:
                out[name] = _episodes(con, reader, vis, keys_of.get("episode_id"), need)
                reader.read[name] = out[name]
                continue
            held = keys_of.get("trace_id") if per_trace(name, schemas[name]) else None
            if held is None and per_trace(name, schemas[name]) and not everything:
                # Every scan of it joins (through others) the traces read or pinned ones:
                # only the rows of the visible traces read are needed.
                held = set(vis.column("trace_id").to_pylist())
                row_filter = And(row_filter, In("trace_id", sorted(held))) if held else AlwaysFalse()
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


def _episodes_bounded(scans: list[Scan], scan: Scan) -> bool:
    """Whether an episodes scan needs only the episodes of the traces read: its episode id
    pinned, or joined on it to a ``traces`` scan (whose rows are among those read)."""
    joined = any(c == oc == "episode_id" and scans[o].table == "traces" for c, o, oc in scan.joins)
    return joined or "episode_id" in scan.pins


def _episodes(
    con: duckdb.DuckDBPyConnection, reader: _Reader, vis: pa.Table, held: set[Any] | None, columns: set[str]
) -> pa.Table:
    """The visible episode rows of the episode ids ``held`` (None: those of the traces read,
    ``vis``). Every row of those ids is read (by key: the table is bucketed on it), and
    which one shows is decided as over every visible trace (:func:`read.visible_episodes`)."""
    names = lake_tables()["episodes"].names
    if held is None:  # too many to send as a reduction: those of the traces read, and any pinned
        held = set(pc.unique(vis.column("episode_id").drop_null()).to_pylist())
        held |= set().union(*(s.pins.get("episode_id", set()) for s in reader.scans if s.table == "episodes"))
    need = columns | {"episode_id", BATCH} | ({"ingested_at"} & set(names))
    keys = ("episode_id", held)
    raw = reader.scan("episodes", In("episode_id", sorted(held)) if held else AlwaysFalse(), need, keys=keys)
    return read.visible_episodes(con, reader.lake, raw, vis)


def _bounded(scans: list[Scan]) -> list[bool]:
    """Per scan: whether the trace ids of the rows it needs are among those of the traces
    read (its trace id pinned, or joined on it to a ``traces`` scan or to a scan that is
    bounded, through any number of such joins)."""
    out = [s.table == "traces" or "trace_id" in s.pins for s in scans]
    changed = True
    while changed:
        changed = False
        for i, scan in enumerate(scans):
            if not out[i] and any(c == "trace_id" and oc == "trace_id" and out[o] for c, o, oc in scan.joins):
                out[i] = changed = True
    return out


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
    nodes = reader.read.get("nodes")
    users = None
    if used and nodes is not None and {"trace_id", "segment_id"} <= set(nodes.column_names):
        wanted = pa.array(sorted(used), pa.binary())
        using = nodes.filter(pc.is_in(nodes.column("segment_id"), value_set=wanted))
        if pc.count_distinct(using.column("segment_id")).as_py() == len(wanted):
            users = using
    if users is not None:  # the nodes using them were read: their traces' buckets hold them
        files: list[str] = []
        batches = users.column(BATCH) if BATCH in users.column_names else None
        segments = reader.lake.table("segments")
        raw = read.trace_segments(
            segments, users.column("trace_id"), wanted, sorted(columns | {"segment_id"}), files, batches
        )
        reader.report.files["segments"] = reader.report.files.get("segments", 0) + len(files)
        reader.report.rows["segments"] = reader.report.rows.get("segments", 0) + raw.num_rows
        traces = pc.count_distinct(users.column("trace_id")).as_py()
        reader.report.filters["segments"] = f"segment_id in {len(used)} keys, of {traces} traces"
    else:
        raw = reader.scan("segments", row_filter, columns | {"segment_id"}, keys=("segment_id", used))
    return read.visible_segments(con, raw, used)


__all__ = ["KEYS", "REDUCTION_LIMIT", "Scan", "ScanReport", "plan", "read_for", "run"]
