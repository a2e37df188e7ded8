"""Validated, atomic write-back of per-token streams onto nodes.

Credit lives on the node: a node shared by several branches has one value, and every
layout a caller may hold (per node, per trace, per branch) is turned into per-node rows
before anything is written. Every row is checked first (the node exists, the lengths
agree, the values are finite, a shared node gets one value); then all rows are written
in one transaction. A write either applies entirely or not at all.

A named set stored per trace (``layout='trace'``, :mod:`tracedb.credit_sets`) holds one
value per trace, which every sampled node of the trace reads: it takes per-trace scalars
only (``write_traces`` with ``value``, a ``(trace_id, value)`` stamp) and refuses per-node,
per-branch and per-token writes; a per-node set refuses a per-trace stamp.

``None`` clears a stream back to unassigned; zeros are zeros.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from tracedb import credit_sets
from tracedb.credit_sets import DEFAULT_SET
from tracedb.errors import NotFound, WriteError
from tracedb.handle import Handle
from tracedb.records import BIT, COMPACT_STREAMS
from tracedb.sqltext import quote_identifier
from tracedb.views.nodes import load_nodes

FULL_STREAMS = ("loss_weights",)
STREAMS = (*COMPACT_STREAMS[1:], *FULL_STREAMS)
"""Streams a consumer may write: compact ``advantages``, ``reference_logprobs``,
``trainer_logprobs``, ``entropies`` and the full-layout named ``loss_weights``."""


def as_arrow(data: Any) -> pa.Table:
    """Arrow from a pyarrow/polars/pandas table, a list of row dicts or a dict of columns."""
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    if hasattr(data, "to_arrow"):  # polars
        return data.to_arrow()
    if isinstance(data, Mapping):
        return pa.table(dict(data))
    if isinstance(data, Sequence):
        return pa.Table.from_pylist(list(data))
    if hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas
        return pa.Table.from_pandas(data, preserve_index=False)
    raise TypeError(f"cannot read rows from {type(data).__name__}")


def _require(table: pa.Table, columns: Sequence[str], layout: str) -> None:
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise WriteError(f"{layout} write needs columns {list(columns)}; missing {missing}")


def _check_stream(stream: str, credit: str | None, name: str | None) -> None:
    if stream not in STREAMS:
        raise WriteError(f"cannot write stream {stream!r}; writable streams are {list(STREAMS)}")
    if credit not in (None, DEFAULT_SET) and stream != "advantages":
        raise WriteError(f"credit sets hold advantages only, not {stream!r}")
    if stream == "loss_weights" and not name:
        raise WriteError("loss_weights writes need a stream name (name=...)")


def _values_column(table: pa.Table, column: str = "values") -> pa.ChunkedArray:
    col = table.column(column)
    if pa.types.is_list(col.type) or pa.types.is_large_list(col.type):
        return col.cast(pa.list_(pa.float32()))
    if pa.types.is_null(col.type):
        return col.cast(pa.list_(pa.float32()))
    raise WriteError(f"column {column!r} must hold lists of floats (or nulls to clear), not {col.type}")


# --------------------------------------------------------------------------- nodes


def write_nodes(
    db: Handle, data: Any, *, stream: str = "advantages", credit: str | None = None, name: str | None = None
) -> int:
    """Write ``(trace_id, node_index, values)`` rows; returns the number of nodes written.

    Compact streams need ``len(values) == node's sampled tokens``; ``loss_weights``
    (with ``name``) needs ``len(values) == node's tokens``. A null clears the node.
    Instead of ``values`` a row may give ``value``: one number for every sampled token of
    the node (a named credit set stores it once).
    """
    _check_stream(stream, credit, name)
    table = as_arrow(data)
    if "value" in table.column_names and "values" not in table.column_names:
        _require(table, ("trace_id", "node_index", "value"), "per-node")
        if stream == "loss_weights":
            raise WriteError("loss_weights are per token: give values, not a value")
        with db.transaction():
            return _apply_scalars(db, table, stream, _node_set(db, credit, "per-node values"))
    _require(table, ("trace_id", "node_index", "values"), "per-node")
    stage = pa.table(
        {
            "trace_id": table.column("trace_id").cast(pa.string()),
            "node_index": table.column("node_index").cast(pa.int32()),
            "values": _values_column(table),
        }
    )
    with db.transaction():
        return _apply(db, stage, stream, _node_set(db, credit, "per-node values"), name)


def _node_set(db: Handle, credit: str | None, what: str) -> str | None:
    """The set per-node rows go to: None for the default set, else the named set, which
    must exist and be stored per node."""
    if credit in (None, DEFAULT_SET):
        return None
    if credit_sets.layout(db, credit) == "trace":
        raise _per_trace_only(credit, what)
    return credit


def _per_trace_only(credit: str, what: str) -> WriteError:
    return WriteError(
        f"credit set {credit!r} is stored per trace (layout 'trace'): it takes one value per trace "
        f"(write_traces with value); {what} need a set stored per node; nothing written"
    )


def _apply(db: Handle, stage: pa.Table, stream: str, credit: str | None, name: str | None) -> int:
    if stage.num_rows == 0:
        return 0
    con = db.con
    con.register("_tdb_stage", stage)
    try:
        size = "n.n_tokens" if stream == "loss_weights" else "n.n_sampled"
        what = f"loss_weights[{name!r}]" if stream == "loss_weights" else stream
        bad = db.row(
            f"SELECT s.trace_id, s.node_index, n.trace_id IS NULL, {size}, len(s.values), "
            "  list_bool_or(list_transform(s.values, lambda x: x IS NULL OR isnan(x) OR isinf(x))) "
            "FROM _tdb_stage s LEFT JOIN nodes n USING (trace_id, node_index) "
            f"WHERE n.trace_id IS NULL OR (s.values IS NOT NULL AND (len(s.values) <> {size} "
            "  OR list_bool_or(list_transform(s.values, lambda x: x IS NULL OR isnan(x) OR isinf(x))))) LIMIT 1"
        )
        if bad is not None:
            trace_id, node, missing, expected, got, nonfinite = bad
            if missing:
                known = db.scalar("SELECT count(*) FROM traces WHERE trace_id = ?", [trace_id])
                what_missing = f"node {node}" if known else "trace"
                raise WriteError(f"trace {trace_id}: {what_missing} not in the database; nothing written")
            if nonfinite and got == expected:
                raise WriteError(
                    f"trace {trace_id}, node {node}: {what} holds a null, NaN or infinity; nothing written"
                )
            raise WriteError(
                f"trace {trace_id}, node {node}: {what} needs {expected} values "
                f"({'tokens' if stream == 'loss_weights' else 'sampled tokens'}), got {got}; nothing written"
            )
        dup = db.row(
            "SELECT trace_id, node_index FROM _tdb_stage GROUP BY ALL "
            "HAVING count(DISTINCT coalesce(values::VARCHAR, 'NULL')) > 1 LIMIT 1"
        )
        if dup is not None:
            raise WriteError(
                f"trace {dup[0]}, node {dup[1]}: two different {what} values for one node; nothing written"
            )
        con.execute(
            "CREATE OR REPLACE TEMP TABLE _tdb_write AS SELECT DISTINCT trace_id, node_index, values FROM _tdb_stage"
        )
    finally:
        con.unregister("_tdb_stage")
    count = db.scalar("SELECT count(*) FROM _tdb_write")
    if credit is not None:
        con.execute(
            "DELETE FROM credit WHERE credit_set = ? AND (trace_id, node_index) IN "
            "(SELECT (trace_id, node_index) FROM _tdb_write)",
            [credit],
        )
        con.execute(
            "INSERT INTO credit (credit_set, trace_id, node_index, value, advantages) "
            "SELECT ?, trace_id, node_index, "
            "  CASE WHEN len(values) > 0 AND list_min(values) = list_max(values) THEN values[1] END, "
            "  CASE WHEN len(values) = 0 OR list_min(values) <> list_max(values) THEN values END "
            "FROM _tdb_write WHERE values IS NOT NULL",
            [credit],
        )
    elif stream == "loss_weights":
        bit = BIT["loss_weights"]
        con.execute(
            "UPDATE node_store SET loss_weights = tdb_loss_weights_text(w.merged), "
            f"  present = CASE WHEN w.merged IS NULL THEN present & ~{bit} ELSE present | {bit} END "
            "FROM (SELECT n.trace_id, n.node_index, "
            "        CASE WHEN len(e.entries) = 0 THEN NULL ELSE map_from_entries(e.entries) END AS merged "
            "      FROM _tdb_write s JOIN nodes n USING (trace_id, node_index), "
            "      LATERAL (SELECT list_concat("
            "          list_filter(coalesce(map_entries(n.loss_weights), []), lambda e: e.key <> ?), "
            "          CASE WHEN s.values IS NULL THEN [] ELSE [{'key': ?, 'value': s.values}] END) AS entries) e"
            ") w WHERE node_store.trace_id = w.trace_id AND node_store.node_index = w.node_index",
            [name, name],
        )
    else:
        bit = BIT[stream]
        col, listed = quote_identifier(stream), quote_identifier(f"{stream}_list")
        con.execute(  # computed values: kept as a list (their text would be decimals)
            f"UPDATE node_store SET {col} = NULL, {listed} = w.values::FLOAT[], "
            f"  present = CASE WHEN w.values IS NULL THEN present & ~{bit} ELSE present | {bit} END "
            "FROM _tdb_write w WHERE node_store.trace_id = w.trace_id AND node_store.node_index = w.node_index"
        )
    con.execute("DROP TABLE _tdb_write")
    return int(count)


def _apply_scalars(db: Handle, table: pa.Table, stream: str, credit: str | None) -> int:
    """Per-node constants: valid by construction once the node exists and the value is finite."""
    stage = pa.table(
        {
            "trace_id": table.column("trace_id").cast(pa.string()),
            "node_index": table.column("node_index").cast(pa.int32()),
            "value": table.column("value").cast(pa.float64()),
        }
    )
    if stage.num_rows == 0:
        return 0
    con = db.con
    con.register("_tdb_scalars", stage)
    try:
        bad = db.row(
            "SELECT s.trace_id, s.node_index, n.trace_id IS NULL FROM _tdb_scalars s "
            "LEFT JOIN nodes n USING (trace_id, node_index) "
            "WHERE n.trace_id IS NULL OR isnan(s.value) OR isinf(s.value) LIMIT 1"
        )
        if bad is not None:
            trace_id, node, missing = bad
            if missing:
                raise WriteError(f"trace {trace_id}: node {node} not in the database; nothing written")
            raise WriteError(f"trace {trace_id}, node {node}: {stream} value is NaN or infinite; nothing written")
        dup = db.row(
            "SELECT trace_id, node_index FROM _tdb_scalars GROUP BY ALL "
            "HAVING count(DISTINCT coalesce(value::VARCHAR, 'NULL')) > 1 LIMIT 1"
        )
        if dup is not None:
            raise WriteError(
                f"trace {dup[0]}, node {dup[1]}: two different {stream} values for one node; nothing written"
            )
        if credit is not None:
            con.execute(
                "DELETE FROM credit WHERE credit_set = ? AND (trace_id, node_index) IN "
                "(SELECT (trace_id, node_index) FROM _tdb_scalars)",
                [credit],
            )
            con.execute(
                "INSERT INTO credit (credit_set, trace_id, node_index, value) "
                "SELECT DISTINCT ?, trace_id, node_index, value::FLOAT FROM _tdb_scalars WHERE value IS NOT NULL",
                [credit],
            )
        else:
            bit = BIT[stream]
            con.execute(
                f"UPDATE node_store SET {quote_identifier(stream)} = NULL, "
                f"  {quote_identifier(stream + '_list')} = CASE WHEN w.value IS NULL THEN NULL "
                "  ELSE list_resize([]::FLOAT[], node_store.n_sampled, w.value::FLOAT) END, "
                f"  present = CASE WHEN w.value IS NULL THEN present & ~{bit} ELSE present | {bit} END "
                "FROM (SELECT DISTINCT * FROM _tdb_scalars) w "
                "WHERE node_store.trace_id = w.trace_id AND node_store.node_index = w.node_index"
            )
        return int(db.scalar("SELECT count(DISTINCT (trace_id, node_index)) FROM _tdb_scalars"))
    finally:
        con.unregister("_tdb_scalars")


def constant_rows(table: pa.Table) -> pa.Table | None:
    """``(trace_id, node_index, value)`` when every non-empty ``values`` list is one repeated
    number (as outcome- and turn-level credit is), else None. Empty and null lists keep
    their meaning, so they also return None."""
    col = _values_column(table).combine_chunks()
    if col.null_count:
        return None
    offsets = col.offsets.to_numpy()
    lengths = np.diff(offsets)
    if (lengths == 0).any():
        return None
    flat = col.values.to_numpy(zero_copy_only=False)[offsets[0] : offsets[-1]]
    starts = offsets[:-1] - offsets[0]
    first = flat[starts]
    # Constant lists change value only where a list starts (one pass, no per-list reduce);
    # NaN differs from itself, so a list holding one is not constant: the list path refuses it.
    change = np.flatnonzero(flat[1:] != flat[:-1]) + 1
    if len(change) and not np.array_equal(starts[np.searchsorted(starts, change).clip(max=len(starts) - 1)], change):
        return None
    return pa.table(
        {
            "trace_id": table.column("trace_id"),
            "node_index": table.column("node_index"),
            "value": pa.array(first.astype(np.float64)),
        }
    )


def stamp_fresh(db: Handle, credit: str, table: pa.Table, layout: str, *, created: bool = False) -> int:
    """Write an algorithm's output into credit set ``credit``, created empty in the open
    transaction: ``(trace_id, value)`` into a set stored per trace (``layout="trace"``), or
    ``(trace_id, node_index, value)`` into one stored per node (a set stored the other way
    is refused). The keys come from the database, one row each, so the checks of the
    general writers (existence, one value per node, an old value to replace) reduce to
    finiteness and key uniqueness, done in numpy, and to the keys' existence, which the one
    ``INSERT`` checks as it goes (a row it leaves out refuses the write). Returns the nodes
    the set assigns. ``created=True``: the caller created the set with ``layout`` in the
    open transaction (:func:`stamp`), so it is not looked up again."""
    with db.transaction():  # the rows of a refused stamp go with its rollback
        nodes = _insert_fresh(db, credit, table, layout)
        stored = layout if created else credit_sets.layout(db, credit)
        if stored != layout:
            shape = "one value per trace" if layout == "trace" else "values per node"
            raise WriteError(
                f"credit set {credit!r} is stored per {stored} (layout {stored!r}): a stamp of {shape} needs a set "
                f"stored per {layout} (layout={layout!r}); nothing written"
            )
        return nodes


def _insert_fresh(db: Handle, credit: str, table: pa.Table, layout: str) -> int:
    """:func:`stamp_fresh` once the set is known to be stored per ``layout``."""
    keys = ["trace_id"] if layout == "trace" else ["trace_id", "node_index"]
    value = table.column("value").cast(pa.float64())
    finite = np.isfinite(pc.fill_null(value, 0.0).to_numpy())
    if not finite.all():
        i = int(np.flatnonzero(~finite)[0])
        where = ", ".join(f"{k} {table.column(k)[i].as_py()}" for k in keys)
        raise WriteError(f"{where}: advantages value is NaN or infinite; nothing written")
    codes = pc.dictionary_encode(table.column("trace_id").cast(pa.string())).combine_chunks().indices
    key = codes.to_numpy().astype(np.int64) << 32
    if layout != "trace":
        key |= table.column("node_index").to_numpy().astype(np.int64)
    if len(np.unique(key)) != len(key):
        raise WriteError(f"credit set {credit!r}: an algorithm gave one {' and '.join(keys)} two rows")
    stage = pa.table({**{k: table.column(k) for k in keys}, "value": value})
    expected = stage.num_rows - value.null_count
    with db.transaction():
        if layout == "trace":
            # One value per trace: a few hundred rows go as bound lists (no table to register).
            kept = stage.filter(pc.is_valid(value))
            ids, values = kept.column("trace_id").to_pylist(), kept.column("value").to_pylist()
            written, nodes = db.row(_INSERT_TRACES, [credit, ids, values])
        else:
            with db.registered("_tdb_fresh", stage):
                written = nodes = db.row(_INSERT_NODES, [credit])[0]
        if written != expected:
            using = ", ".join(keys)
            with db.registered("_tdb_fresh", stage):
                stray = db.row(f"SELECT {using} FROM _tdb_fresh ANTI JOIN {layout}s USING ({using}) LIMIT 1")
            where = " ".join(f"{k} {v}" for k, v in zip(keys, stray or ("?",) * len(keys)))
            raise WriteError(f"{where} is not in the database; nothing written")
        return int(nodes)


_INSERT_TRACES = (
    "WITH s AS (SELECT unnest($2::VARCHAR[]) AS trace_id, unnest($3::DOUBLE[]) AS value), "
    "ins AS (INSERT INTO trace_credit (credit_set, trace_id, value) "
    "  SELECT $1, s.trace_id, s.value::FLOAT FROM s SEMI JOIN traces USING (trace_id) RETURNING trace_id) "
    "SELECT (SELECT count(*) FROM ins), "
    "  (SELECT count(*) FROM nodes WHERE n_sampled > 0 AND trace_id IN (SELECT trace_id FROM ins))"
)
"""Per-trace rows into a per-trace set: the rows inserted and the sampled nodes they reach."""
_INSERT_NODES = (
    "INSERT INTO credit (credit_set, trace_id, node_index, value) "
    "SELECT $1, s.trace_id, s.node_index, s.value::FLOAT FROM _tdb_fresh s JOIN traces t USING (trace_id) "
    "WHERE s.value IS NOT NULL AND s.node_index >= 0 AND s.node_index < t.n_nodes"
)
"""Per-node rows into a per-node set (a trace's nodes are 0 .. n_nodes - 1: ingest writes
every node, nothing deletes one): the rows inserted."""


def stamp(
    db: Handle,
    name: str,
    table: pa.Table,
    *,
    algorithm: str,
    params: Mapping[str, Any] | None = None,
    description: str | None = None,
    replace: bool = False,
) -> int:
    """Create credit set ``name`` and write a credit algorithm's output into it, in one
    transaction: the one path every computed set is stamped through (``tracedb.credit.run``,
    counterfactual edit credit). Returns the nodes the set assigns.

    ``table`` is ``(trace_id, value)`` (a constant per trace: the set is stored per trace,
    one row each), ``(trace_id, node_index, value)`` (a constant per node) or ``(trace_id,
    node_index, values)`` (compact lists; lists that repeat one number are stored as that
    number, the rest through the checked writer); these two make a set stored per node."""
    layout = stamp_layout(table)
    with db.transaction():
        credit_sets.create(
            db, name, algorithm=algorithm, params=params, description=description, replace=replace, layout=layout
        )
        return stamp_into(db, name, table, created=True)


def stamp_layout(table: pa.Table) -> str:
    """How a set holding a credit algorithm's output ``table`` is stored: ``"node"`` when
    it has ``node_index``, else ``"trace"``."""
    return "node" if "node_index" in table.column_names else "trace"


def stamp_into(db: Handle, name: str, table: pa.Table, *, created: bool = False) -> int:
    """Write a credit algorithm's output (as :func:`stamp` takes it) into the existing set
    ``name``, whose rows for these traces the caller has removed (a stamp on a selection:
    :mod:`tracedb.credit.selected`); ``created=True``: the caller created the set in the
    open transaction with :func:`stamp_layout`'s layout. Returns the nodes written."""
    layout = stamp_layout(table)
    with db.transaction():
        if layout == "trace" or "values" not in table.column_names:
            return stamp_fresh(db, name, table, layout, created=created)
        scalars = constant_rows(table) if table.num_rows else None
        if scalars is None:  # write_nodes refuses a set stored per trace
            return write_nodes(db, table, credit=name)
        return stamp_fresh(db, name, scalars, "node", created=created)


# --------------------------------------------------------------------------- traces


def write_traces(db: Handle, data: Any, *, stream: str = "advantages", credit: str | None = None) -> int:
    """Per trace: ``value`` (a scalar broadcast over every sampled token) or ``values``
    (one list over all the trace's sampled tokens, in node order). Null clears the trace.
    Nodes without sampled tokens are left as they are. Returns nodes written.

    A named set stored per trace keeps each ``value`` once (and refuses ``values``); one
    stored per node gets the value on each sampled node."""
    _check_stream(stream, credit, None)
    if stream == "loss_weights":
        raise WriteError("loss_weights are per token; write them per node or per branch")
    table = as_arrow(data)
    if "trace_id" not in table.column_names or not ({"value", "values"} & set(table.column_names)):
        raise WriteError("per-trace write needs columns trace_id and value (scalar) or values (list)")
    stage = pa.table({"trace_id": table.column("trace_id").cast(pa.string())})
    stage = stage.append_column(
        "value",
        table.column("value").cast(pa.float64())
        if "value" in table.column_names
        else pa.nulls(len(stage), pa.float64()),
    )
    stage = stage.append_column(
        "values",
        _values_column(table) if "values" in table.column_names else pa.nulls(len(stage), pa.list_(pa.float32())),
    )
    with db.transaction():
        credit_name = credit_sets.resolve(db, credit)
        layout = "node" if credit_name is None else credit_sets.layout(db, credit_name)
        scalars = pc.all(pc.is_null(stage.column("values"))).as_py()
        if layout == "trace" and not scalars:
            raise _per_trace_only(credit_name, "per-token values over a trace")
        db.con.register("_tdb_traces_in", stage)
        try:
            bad = db.row(
                "SELECT s.trace_id, t.trace_id IS NULL, t.n_sampled, len(s.values), "
                "  s.value IS NOT NULL AND s.values IS NOT NULL, isnan(s.value) OR isinf(s.value) "
                "FROM _tdb_traces_in s LEFT JOIN traces t USING (trace_id) "
                "WHERE t.trace_id IS NULL OR (s.values IS NOT NULL AND len(s.values) <> t.n_sampled) "
                "  OR (s.value IS NOT NULL AND s.values IS NOT NULL) OR isnan(s.value) OR isinf(s.value) LIMIT 1"
            )
            if bad is not None:
                trace_id, missing, expected, got, both, nonfinite = bad
                if missing:
                    raise WriteError(f"trace {trace_id} is not in the database; nothing written")
                if both:
                    raise WriteError(f"trace {trace_id}: give value or values, not both; nothing written")
                if nonfinite:
                    raise WriteError(f"trace {trace_id}: {stream} value is NaN or infinite; nothing written")
                raise WriteError(
                    f"trace {trace_id}: {stream} needs {expected} values (sampled tokens of the trace), "
                    f"got {got}; nothing written"
                )
            if credit_name is not None and scalars:
                # Scalars into a named set are valid by construction once each trace has one.
                dup = db.row(
                    "SELECT trace_id FROM _tdb_traces_in GROUP BY ALL "
                    "HAVING count(DISTINCT coalesce(value::VARCHAR, 'NULL')) > 1 LIMIT 1"
                )
                if dup is not None:
                    raise WriteError(f"trace {dup[0]}: two different {stream} values for one trace; nothing written")
                return _trace_values(db, credit_name) if layout == "trace" else _broadcast(db, credit_name)
            # Broadcast or slice onto each node's sampled tokens, in node order.
            nodes = db.sql(
                "SELECT n.trace_id, n.node_index, "
                "  CASE WHEN s.values IS NOT NULL "
                "       THEN s.values[o.offset + 1 : o.offset + n.n_sampled] "
                "       WHEN s.value IS NOT NULL THEN list_resize([]::FLOAT[], n.n_sampled, s.value::FLOAT) "
                "  END AS values "
                "FROM _tdb_traces_in s JOIN nodes n USING (trace_id) "
                "JOIN (SELECT trace_id, node_index, coalesce(sum(n_sampled) OVER (PARTITION BY trace_id "
                "      ORDER BY node_index ROWS BETWEEN UNBOUNDED PRECEDING AND 1 PRECEDING), 0) AS offset "
                "      FROM nodes SEMI JOIN _tdb_traces_in USING (trace_id)) o USING (trace_id, node_index) "
                "WHERE n.n_sampled > 0"
            )
        finally:
            db.con.unregister("_tdb_traces_in")
        return _apply(db, nodes, stream, credit_name, None)


def _broadcast(db: Handle, credit: str) -> int:
    """Per-trace scalars (registered as _tdb_traces_in) onto a set stored per node, one row
    per sampled node."""
    db.con.execute(
        "DELETE FROM credit WHERE credit_set = ? AND trace_id IN (SELECT trace_id FROM _tdb_traces_in)", [credit]
    )
    return int(
        db.scalar(
            "WITH ins AS (INSERT INTO credit (credit_set, trace_id, node_index, value) "
            "SELECT ?, n.trace_id, n.node_index, s.value::FLOAT "
            "FROM (SELECT DISTINCT trace_id, value FROM _tdb_traces_in) s JOIN nodes n USING (trace_id) "
            "WHERE n.n_sampled > 0 AND s.value IS NOT NULL RETURNING 1) SELECT count(*) FROM ins",
            [credit],
        )
    )


def _trace_values(db: Handle, credit: str) -> int:
    """Per-trace scalars (registered as _tdb_traces_in) into a set stored per trace, one row
    per trace (a null clears it); returns the sampled nodes they assign."""
    db.con.execute(
        "DELETE FROM trace_credit WHERE credit_set = ? AND trace_id IN (SELECT trace_id FROM _tdb_traces_in)",
        [credit],
    )
    db.con.execute(
        "INSERT INTO trace_credit (credit_set, trace_id, value) "
        "SELECT DISTINCT ?, trace_id, value::FLOAT FROM _tdb_traces_in WHERE value IS NOT NULL",
        [credit],
    )
    return int(
        db.scalar(
            "SELECT count(*) FROM nodes WHERE n_sampled > 0 AND trace_id IN "
            "(SELECT trace_id FROM _tdb_traces_in WHERE value IS NOT NULL)"
        )
    )


# --------------------------------------------------------------------------- branches


def write_branches(
    db: Handle,
    data: Any,
    *,
    stream: str = "advantages",
    credit: str | None = None,
    name: str | None = None,
) -> int:
    """Per branch ``(trace_id, branch_index, values)`` in full layout (aligned to the
    branch's ``token_ids``), projected onto its nodes. Compact streams take the values on
    sampled positions and require zeros elsewhere; ``loss_weights`` take every position.
    A node on several written branches must get the same values from each. Null clears
    every node of the branch. Returns nodes written."""
    _check_stream(stream, credit, name)
    table = as_arrow(data)
    _require(table, ("trace_id", "branch_index", "values"), "per-branch")
    trace_ids = table.column("trace_id").cast(pa.string()).to_pylist()
    branch_index = table.column("branch_index").cast(pa.int32()).to_pylist()
    values = _values_column(table)
    data_nodes = load_nodes(db, sorted(set(trace_ids)), [])
    paths = {
        (t, b): p
        for t, b, p in zip(
            data_nodes.branches.column("trace_id").to_pylist(),
            data_nodes.branches.column("branch_index").to_pylist(),
            data_nodes.branches.column("path").to_pylist(),
        )
    }
    compact = stream != "loss_weights"
    rows: dict[tuple[str, int], tuple[Any, tuple[str, int]]] = {}
    for i, (tid, bi) in enumerate(zip(trace_ids, branch_index)):
        path = paths.get((tid, bi))
        if path is None:
            raise WriteError(f"trace {tid}: branch {bi} is not in the database; nothing written")
        base = data_nodes.base[tid]
        starts = data_nodes.starts
        length = sum(int(starts[base + n + 1] - starts[base + n]) for n in path)
        scalar = values[i]
        vals = None if not scalar.is_valid else np.asarray(scalar.values.to_numpy(zero_copy_only=False), np.float32)
        if vals is not None and len(vals) != length:
            raise WriteError(
                f"trace {tid}, branch {bi}: {stream} needs {length} values (the branch's tokens), "
                f"got {len(vals)}; nothing written"
            )
        offset = 0
        for node in path:
            a, b = int(starts[base + node]), int(starts[base + node + 1])
            n_tok = b - a
            piece = None
            if vals is not None:
                piece = vals[offset : offset + n_tok]
                if compact:
                    sampled = data_nodes.mask[a:b]
                    stray = np.flatnonzero((piece != 0) & ~sampled)
                    if len(stray):
                        raise WriteError(
                            f"trace {tid}, branch {bi}, node {node}: {stream} is {piece[stray[0]]:g} on unsampled "
                            f"token {offset + int(stray[0])} of the branch; only sampled tokens take values; "
                            "nothing written"
                        )
                    piece = piece[sampled]
                if not np.isfinite(piece).all():
                    raise WriteError(f"trace {tid}, branch {bi}, node {node}: {stream} holds NaN or infinity")
            offset += n_tok
            key = (tid, node)
            if key in rows:
                prior, where = rows[key]
                same = (prior is None and piece is None) or (
                    prior is not None and piece is not None and np.array_equal(prior, piece)
                )
                if not same:
                    raise WriteError(
                        f"trace {tid}, node {node}: branches {where[1]} and {bi} give it different {stream}; "
                        "one node, one value; nothing written"
                    )
                continue
            rows[key] = (piece, (tid, bi))
    stage = pa.table(
        {
            "trace_id": pa.array([k[0] for k in rows], pa.string()),
            "node_index": pa.array([k[1] for k in rows], pa.int32()),
            "values": pa.array([None if v[0] is None else v[0] for v in rows.values()], pa.list_(pa.float32())),
        }
    )
    with db.transaction():
        return _apply(db, stage, stream, _node_set(db, credit, "per-branch values"), name)


# --------------------------------------------------------------------------- clear


def clear(
    db: Handle,
    *,
    stream: str = "advantages",
    credit: str | None = None,
    trace_ids: Sequence[str] | None = None,
    name: str | None = None,
) -> int:
    """Return every node (of ``trace_ids``, or all) to unassigned for ``stream``."""
    _check_stream(stream, credit, name)
    where = "" if trace_ids is None else "WHERE trace_id IN (SELECT unnest(?::VARCHAR[]))"
    params = [] if trace_ids is None else [list(trace_ids)]
    if trace_ids is not None:
        missing = set(trace_ids) - db.existing("traces", "trace_id", trace_ids)
        if missing:
            raise NotFound(f"trace(s) {sorted(missing)} not in the database; nothing cleared")
    with db.transaction():
        named = credit_sets.resolve(db, credit)
        if named is not None and credit_sets.layout(db, named) == "trace":
            # A trace's row holds all its credit: dropping it clears every node.
            db.con.execute(
                f"DELETE FROM trace_credit WHERE credit_set = ? {where.replace('WHERE', 'AND')}", [named, *params]
            )
            return int(db.scalar(f"SELECT count(*) FROM nodes {where}", params))
        rows = db.sql(f"SELECT trace_id, node_index FROM nodes {where}", params)
        stage = rows.append_column("values", pa.nulls(rows.num_rows, pa.list_(pa.float32())))
        return _apply(db, stage, stream, named, name)
