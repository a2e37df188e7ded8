"""Moving traces between a file store and a lake: rows of a file store handed to the
lake's writer (``push``; also what a Ray ingest task hands over), and a lake's visible
rows written into a file store (``pull``; also what a Ray view worker computes on).

A push also brings the credit a file store holds for traces the lake shows already (a
credit set written after its traces were pushed): see :func:`push`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.expressions import In

from tracedb import policy
from tracedb.database import Database
from tracedb.errors import WriteError
from tracedb.lake import labels
from tracedb.lake.catalog import BATCH, lake_tables, per_trace
from tracedb.lake.scan import visible_traces
from tracedb.lake.write import AppendReport, append, lake_rows
from tracedb.sqltext import quote_identifier
from tracedb.tables import ENCODED, STORED, encode_rows

PUSH_TRACES = 5_000
"""Traces per lake write when pushing a file store (each write is one traces commit)."""


def file_rows(db: Database, trace_ids: Sequence[str], *, rejects: bool = True) -> dict[str, pa.Table]:
    """The rows of ``trace_ids`` in every table the lake mirrors that ``db`` has (its
    episodes and segments; all credit sets; all rejects when ``rejects``), by name."""
    handle = db.handle
    present = handle.table_names()
    out: dict[str, pa.Table] = {}
    chosen = "SELECT trace_id FROM _tdb_push"
    with handle.registered("_tdb_push", pa.table({"trace_id": pa.array(list(trace_ids), pa.string())})):
        for name, schema in lake_tables().items():
            if name not in present:
                continue
            table = quote_identifier(name)
            if per_trace(name, schema):
                query = f"SELECT * FROM {table} WHERE trace_id IN ({chosen})"
            elif name == "episodes":
                query = (
                    f"SELECT * FROM {table} WHERE episode_id IN "
                    f"(SELECT episode_id FROM traces WHERE trace_id IN ({chosen}))"
                )
            elif name == "segments":
                query = (
                    f"SELECT * FROM {table} WHERE segment_id IN "
                    f"(SELECT segment_id FROM nodes WHERE trace_id IN ({chosen}))"
                )
            elif name == "rejects" and not rejects:
                continue
            else:
                query = f"SELECT * FROM {table}"
            out[name] = handle.sql(query)
    return out


def file_chunks(db: Database, size: int = PUSH_TRACES) -> Iterator[dict[str, pa.Table]]:
    """:func:`file_rows` of all of ``db``'s traces, ``size`` traces at a time in sequence
    order (rejects with the first chunk)."""
    ids = db.sql("SELECT trace_id FROM traces ORDER BY seq, trace_id").column("trace_id").to_pylist()
    if not ids:
        yield file_rows(db, [])
        return
    for start in range(0, len(ids), size):
        yield file_rows(db, ids[start : start + size], rejects=start == 0)


CREDIT_TABLES = {"credit": ("credit_set", "trace_id", "node_index"), "trace_credit": ("credit_set", "trace_id")}
"""The tables holding a credit set's values, by the key of one value."""

_SET_FIELDS = ("algorithm", "params", "layout")
"""What two credit sets of one name must agree on (besides their values) to be one."""


def push(lake: Any, db: Database, size: int = PUSH_TRACES) -> AppendReport:
    """Push ``db``'s traces into ``lake`` (``size`` per write, see :func:`file_chunks`) and
    the credit sets the lake lacks, also for traces it shows already.

    Before anything is written, every credit set of ``db`` that the lake holds already is
    compared with the lake's over the traces both hold: another algorithm, parameters or
    layout, or other values (a value more, less or different) refuse the push with a
    :class:`~tracedb.errors.WriteError` naming the set (a lake's set is not changed by a
    push). Then the values of the sets the lake lacks are appended for the traces it
    shows (each row carrying the :data:`BATCH` of its trace's visible row, as
    :func:`tracedb.lake.credit.run` does; values already there from an interrupted push
    are not written twice), then the traces the lake lacks, each write with its values,
    and last the ``credit_sets`` rows, so a reader that sees a set sees all its values.
    Pushing twice adds nothing. ``size`` (``batch_traces``) not an int >= 1: ValueError,
    before anything is written."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"batch_traces must be an int >= 1, not {size!r}")
    report = AppendReport()
    handle = db.handle
    present = handle.table_names()
    if labels.TABLE in present:  # a label the lake maps otherwise: refused before anything is written
        labels.new_rows(lake, handle.sql(f"SELECT * FROM {labels.TABLE}"))
    sets = handle.sql("SELECT * FROM credit_sets") if "credit_sets" in present else None
    if sets is not None and sets.num_rows:
        held = _held(lake, db)
        lake_sets = _lake_sets(lake)
        new = [n for n in sets.column("name").to_pylist() if n not in lake_sets]
        _refuse_other_sets(sets, lake_sets)
        additions = {}
        with handle.registered("_tdb_held", held):
            for name in CREDIT_TABLES:
                if name in present:
                    additions[name] = _credit_rows(lake, db, name, sets.column("name").to_pylist(), new)
        for name, rows in additions.items():
            if rows.num_rows:
                stamped = lake_rows(name, rows, "")
                stamped = stamped.set_column(stamped.schema.get_field_index(BATCH), BATCH, rows.column(BATCH))
                lake.table(name).append(stamped)
                report.rows[name] = rows.num_rows
    for rows in file_chunks(db, size):
        report.merge(append(lake, {k: v for k, v in rows.items() if k != "credit_sets"}))
    if sets is not None and sets.num_rows:
        lacking = set(sets.column("name").to_pylist()) - set(_lake_sets(lake))
        if lacking:
            rows = sets.filter(pc.is_in(sets.column("name"), value_set=pa.array(sorted(lacking), pa.string())))
            lake.table("credit_sets").append(lake_rows("credit_sets", rows, ""))
            report.rows["credit_sets"] = rows.num_rows
    return report


def _held(lake: Any, db: Database) -> pa.Table:
    """``(trace_id, lake_batch)`` of the traces of ``db`` the lake shows (their visible row's batch)."""
    shown = visible_traces(lake.table("traces"), columns=["trace_id"])
    with db.handle.registered("_tdb_lake_traces", shown):
        return db.handle.sql(
            f"SELECT l.trace_id, l.{BATCH} FROM _tdb_lake_traces l SEMI JOIN traces t USING (trace_id)"
        )


def _lake_sets(lake: Any) -> dict[str, dict[str, Any]]:
    """The lake's credit sets by name (the first row of each, as readers show it)."""
    rows = lake.table("credit_sets").scan().to_arrow().sort_by([("created_at", "ascending")]).to_pylist()
    out: dict[str, dict[str, Any]] = {}
    for row in rows:
        out.setdefault(row["name"], row)
    return out


def _params(text: Any) -> Any:
    return json.loads(text) if isinstance(text, str) else text


def _refuse_other_sets(sets: pa.Table, lake_sets: dict[str, dict[str, Any]]) -> None:
    for row in sets.to_pylist():
        theirs = lake_sets.get(row["name"])
        if theirs is None:
            continue
        for key in _SET_FIELDS:
            mine, other = (_params(row[key]), _params(theirs[key])) if key == "params" else (row[key], theirs[key])
            if mine != other:
                raise WriteError(
                    f"credit set {row['name']!r}: the lake holds a set of that name with {key} {other!r}, "
                    f"this file's has {mine!r}; a push does not change a lake's set (rename or drop it here)"
                )


def _credit_rows(lake: Any, db: Database, name: str, names: list[str], new: list[str]) -> pa.Table:
    """The rows of table ``name`` (credit or trace_credit) to append for the traces the
    lake shows (``_tdb_held``): the values of the sets the lake lacks (``new``) it does not
    hold yet, with :data:`BATCH`. A set the lake holds must have the same values over
    those traces (else :class:`WriteError`)."""
    handle = db.handle
    key = CREDIT_TABLES[name]
    columns = ", ".join(quote_identifier(c) for c in lake_tables()[name].names)
    raw = lake.table(name).scan(row_filter=In("credit_set", names)).to_arrow()
    with (
        handle.registered("_tdb_lake_credit", raw),
        handle.registered("_tdb_new_sets", pa.table({"name": pa.array(new, pa.string())})),
    ):
        theirs = (
            f"SELECT {columns} FROM _tdb_lake_credit c SEMI JOIN _tdb_held h "
            f"ON c.trace_id = h.trace_id AND c.{BATCH} = h.{BATCH}"
        )
        mine = f"SELECT {columns} FROM {quote_identifier(name)} SEMI JOIN _tdb_held USING (trace_id)"
        other = handle.sql(
            f"SELECT credit_set, trace_id FROM (({mine}) EXCEPT ALL ({theirs}) UNION ALL "
            f"({theirs}) EXCEPT ALL ({mine})) WHERE credit_set NOT IN (SELECT name FROM _tdb_new_sets) "
            "ORDER BY ALL LIMIT 1"
        )
        # Values of a set the lake lacks are a write's that never committed the set (an
        # interrupted push: equal to this file's, kept; a dead writer of other values: refused).
        stale = handle.sql(
            f"SELECT credit_set, trace_id FROM (({theirs}) EXCEPT ALL ({mine})) "
            "WHERE credit_set IN (SELECT name FROM _tdb_new_sets) ORDER BY ALL LIMIT 1"
        )
        if stale.num_rows:
            found = stale.to_pylist()[0]
            raise WriteError(
                f"credit set {found['credit_set']!r}: the lake holds values of it (e.g. for trace "
                f"{found['trace_id']!r}) other than this file's, from a write that never committed the set (its "
                "writer died, or one is writing it now); `tracedb lake compact` removes them once they are older "
                "than its --grace, then push again"
            )
        if other.num_rows:
            found = other.to_pylist()[0]
            raise WriteError(
                f"credit set {found['credit_set']!r}: the lake holds it with other values than this file "
                f"(e.g. for trace {found['trace_id']!r}); a push does not change a lake's set (rename or drop it here)"
            )
        match = " AND ".join(f"x.{c} = m.{c}" for c in key)
        return handle.sql(
            f"SELECT m.*, h.{BATCH} FROM ({mine}) m JOIN _tdb_held h USING (trace_id) "
            "WHERE m.credit_set IN (SELECT name FROM _tdb_new_sets) "
            f"AND NOT EXISTS (SELECT 1 FROM ({theirs}) x WHERE {match}) ORDER BY ALL"
        )


_SAME = {
    "episodes": "x.episode_id = r.episode_id",
    "segments": "x.segment_id = r.segment_id",
    "credit_sets": "x.name = r.name",
    "policy_labels": "x.label = r.label",
    "rejects": " AND ".join(
        f"x.{c} IS NOT DISTINCT FROM r.{c}" for c in ("source", "line", "trace_id", "node", "field", "reason")
    ),
}
"""When a row of a table that is not per trace is held already (not written again)."""


def write_into(db: Database, rows: dict[str, pa.Table]) -> int:
    """Write a lake's visible rows (:func:`tracedb.lake.read.visible`) into ``db``: the
    traces it does not hold yet, in the lake's order, numbered on from its watermark
    (``seq`` counts a file's own commits), with their rows; credit sets and rejects it
    lacks. One transaction. Returns the number of traces added."""
    handle = db.handle
    present = handle.table_names()
    traces = rows["traces"]
    incoming = rows.get(labels.TABLE)
    if incoming is not None and incoming.num_rows and labels.TABLE in present:
        labels.refuse_other(policy.mapping_of(handle.con), incoming, theirs="this file", ours="the lake")
    with handle.sequencing(), handle.transaction():
        held = set(handle.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist())
        new = [t for t in traces.column("trace_id").to_pylist() if t not in held]
        numbering = handle.numbering()
        mark = numbering.take(len(new)) - 1
        with handle.registered("_tdb_new", pa.table({"trace_id": pa.array(new, pa.string())})):
            for name, schema in lake_tables().items():
                table = rows.get(name)
                if name not in present or table is None or table.num_rows == 0:
                    continue
                target = quote_identifier(name)
                with handle.registered("_tdb_rows", table):
                    if name == "traces":
                        select = (
                            f"SELECT * REPLACE ({mark} + row_number() OVER (ORDER BY seq, trace_id) AS seq) "
                            "FROM _tdb_rows WHERE trace_id IN (SELECT trace_id FROM _tdb_new)"
                        )
                    elif per_trace(name, schema):
                        select = "SELECT * FROM _tdb_rows WHERE trace_id IN (SELECT trace_id FROM _tdb_new)"
                    else:
                        select = (
                            f"SELECT * FROM _tdb_rows r WHERE NOT EXISTS (SELECT 1 FROM {target} x WHERE {_SAME[name]})"
                        )
                    if name in ENCODED:  # rows as the view reads, stored encoded
                        found = handle.sql(select)
                        stored, encoded = encode_rows(name, found.select(STORED[name].names))
                        with handle.registered("_tdb_encoded", encoded):
                            handle.con.execute(
                                f"INSERT INTO {quote_identifier(stored)} BY NAME SELECT * FROM _tdb_encoded"
                            )
                    else:
                        handle.con.execute(f"INSERT INTO {target} BY NAME {select}")
        numbering.store()
    return len(new)
