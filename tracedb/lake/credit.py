"""Group credit on a lake: grpo / rloo computed per group in a Ray groupby, appended as a set.

The driver reads the visible traces' reward columns and computes each trace's group key
and validity with the file store's own :func:`tracedb.credit.outcome.trace_rewards`; Ray
shuffles the rows by group (``groupby(...).map_groups``) and each group is credited by
the file store's algorithm itself (:func:`tracedb.credit.compute` over that group's
rows), so the values are the file store's. The set is stored per trace: its
``trace_credit`` rows carry the :data:`~tracedb.lake.catalog.BATCH` of the trace's
visible row (readers join on it) and are committed before the set's ``credit_sets`` row.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyiceberg.expressions import EqualTo

from tracedb import credit as credit_lib
from tracedb.credit.outcome import trace_rewards
from tracedb.credit.selected import SHOWN, training_selection
from tracedb.credit_sets import check_name
from tracedb.errors import WriteError
from tracedb.lake import catalog
from tracedb.lake import files as lake_files
from tracedb.lake.columns import written_with
from tracedb.lake.scan import scan_keys, visible_traces
from tracedb.lake.select import resolved as resolved_selection
from tracedb.lake.workers import quiet_data, running_ray
from tracedb.lake.write import lake_rows
from tracedb.selection import Selected, Selection

GROUP_ALGORITHMS = ("grpo", "rloo")
"""The algorithms a lake computes: one value per trace from its group's rewards."""

_GROUP = "_tdb_group"


class _Traces:
    """What the credit functions read through ``.sql``: a ``traces`` table alone."""

    def __init__(self, traces: pa.Table) -> None:
        self.con = lake_files.duck()
        self.con.register("traces", traces)

    def sql(self, query: str, params: list[Any] | None = None) -> pa.Table:
        result = self.con.sql(query, params=params or None)  # execute()'s Arrow output warns (a copy)
        return pa.table({}) if result is None else result.to_arrow_table()


def _visible_traces(lake: catalog.Opened, columns: list[str]) -> pa.Table:
    """The visible traces rows (``columns`` and :data:`BATCH`), one per trace id."""
    return visible_traces(lake.table("traces"), columns=columns).select([*columns, catalog.BATCH])


def _group_credit(group: pa.Table, algorithm: str, params: dict[str, Any]) -> pa.Table:
    """One group's credit: the file store's algorithm over the group's traces rows."""
    table = credit_lib.compute(_Traces(group.drop_columns([_GROUP])), algorithm, **params)
    return table.select(["trace_id", "value"]).cast(pa.schema([("trace_id", pa.string()), ("value", pa.float64())]))


def _checked(algorithm: str, params: dict[str, Any]) -> dict[str, Any]:
    """The parameters ``algorithm`` runs with (its defaults and ``params``); ValueError for
    an algorithm a lake does not compute or a parameter it does not take."""
    if algorithm not in GROUP_ALGORITHMS:
        raise ValueError(f"lake credit computes {list(GROUP_ALGORITHMS)}, not {algorithm!r}")
    known = credit_lib.algorithms()[algorithm].params()
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"lake credit {algorithm}: unknown parameters {unknown}; known: {sorted(known)}")
    return {**known, **params}


def compute(lake: catalog.Opened, algorithm: str, **params: Any) -> pa.Table:
    """``(trace_id, value)`` of ``algorithm`` (grpo or rloo, with its parameters) over the
    lake's visible traces, by trace id; groups credited in a Ray groupby."""
    _checked(algorithm, params)
    ray = running_ray()
    reward, group_by = params.get("reward"), params.get("group_by", "group_id")
    columns = ["trace_id", "reward", "ok", "is_timeout", "dropped", "work_type"]  # what trace_rewards decides on
    if reward is not None or str(group_by).startswith("$"):
        columns.append("record")
    if not str(group_by).startswith("$") and group_by not in columns:
        columns.append(group_by)
    traces = _visible_traces(lake, columns).drop_columns([catalog.BATCH])
    keys = trace_rewards(
        _Traces(traces),
        reward=reward,
        group_by=group_by,
        include_failed=params.get("include_failed", False),
        include_dropped=params.get("include_dropped", False),
        include_eval=params.get("include_eval", False),
    )
    keyed = lake_files.duck()
    keyed.register("t", traces)
    keyed.register("k", keys.select("trace_id", "group").to_arrow())
    rows = keyed.sql(f"SELECT t.*, coalesce(k.\"group\", '\\x00none') AS {_GROUP} FROM t JOIN k USING (trace_id)")
    table = rows.to_arrow_table()
    empty = pa.table({"trace_id": pa.array([], pa.string()), "value": pa.array([], pa.float64())})
    if table.num_rows == 0:
        return empty
    # Traces without a group all land in one Ray group; the algorithm makes each its own group.
    with quiet_data():
        ds = (
            ray.data.from_arrow(table)
            .groupby(_GROUP)
            .map_groups(_group_credit, batch_format="pyarrow", fn_kwargs={"algorithm": algorithm, "params": params})
        )
        parts = [
            pa.Table.from_batches([b]) if isinstance(b, pa.RecordBatch) else b
            for b in ds.iter_batches(batch_format="pyarrow")
        ]
    out = pa.concat_tables([empty, *[p.cast(empty.schema) for p in parts]])
    return out.sort_by("trace_id")


def run(
    lake: catalog.Opened,
    algorithm: str,
    name: str | None = None,
    selection: Selection | None = None,
    **params: Any,
) -> dict[str, Any]:
    """See :meth:`tracedb.lake.Lake.credit`."""
    name = check_name(algorithm if name is None else name)
    resolved = _checked(algorithm, params)
    held_set = _set_row(lake, name)
    if held_set is not None and selection is None:
        raise WriteError(
            f"credit set {name!r} exists in the lake (a lake does not recompute a set: pick a new name, or "
            "add the traces it lacks with a selection)"
        )
    if held_set is None:
        _refuse_leftovers(lake, name)
    else:
        _check_same(name, held_set, algorithm, resolved)
    picked: Selected | None = None
    ids: list[str] | None = None
    if selection is not None:  # resolved before the credit is read: every selected trace is in what it reads
        ids, picked = resolved_selection(lake, training_selection(selection, resolved))
    values = compute(lake, algorithm, **params)
    batches = _visible_traces(lake, ["trace_id"])
    if ids is not None:
        chosen = pa.array(ids, pa.string())
        values = values.filter(pc.is_in(values.column("trace_id"), value_set=chosen))
        if held_set is not None:
            _refuse_held(lake, name, chosen, batches)
    con = lake_files.duck()
    con.register("v", values)
    con.register("b", batches)
    stamped = con.sql(
        f"SELECT ? AS credit_set, v.trace_id, v.value::FLOAT AS value, b.{catalog.BATCH} "
        "FROM v JOIN b USING (trace_id) ORDER BY v.trace_id",
        params=[name],
    ).to_arrow_table()
    if stamped.num_rows:
        rows = lake_rows("trace_credit", stamped, "")
        rows = rows.set_column(rows.schema.get_field_index(catalog.BATCH), catalog.BATCH, stamped.column(catalog.BATCH))
        lake.table("trace_credit").append(rows)
    if held_set is None:  # the set's row last: readers see its values whole or not at all
        entry = pa.table(
            {
                "name": [name],
                "algorithm": [algorithm],
                "params": [json.dumps(resolved, sort_keys=True, default=str)],
                "description": pa.array([None], pa.string()),
                "created_at": pa.array([datetime.now(UTC).replace(tzinfo=None)], pa.timestamp("us")),
                "layout": ["trace"],
            }
        )
        lake.table("credit_sets").append(lake_rows("credit_sets", entry, ""))
    out: dict[str, Any] = {"name": name, "algorithm": algorithm, "params": resolved, "rows": stamped.num_rows}
    if picked is not None and ids is not None:
        out.update(traces=len(ids), watermark=picked.watermark, selection=picked.report)
    return out


def _set_row(lake: catalog.Opened, name: str) -> dict[str, Any] | None:
    """The ``credit_sets`` row of set ``name`` in the lake (None: no such set)."""
    rows = lake.table("credit_sets").scan(row_filter=EqualTo("name", name)).to_arrow()
    return rows.to_pylist()[0] if rows.num_rows else None


def _refuse_leftovers(lake: catalog.Opened, name: str) -> None:
    """Refuse a new set ``name`` while the lake holds values of it that no set row owns."""
    for table in ("trace_credit", "credit"):
        left = lake.table(table).scan(row_filter=EqualTo("credit_set", name), selected_fields=("trace_id",), limit=1)
        if left.to_arrow().num_rows:
            raise WriteError(
                f"credit set {name!r}: the lake holds {table} values of it from a write that never committed the "
                "set (its writer died, or one is writing it now); `tracedb lake compact` removes them once they "
                "are older than its --grace, then write the set again"
            )


def _check_same(name: str, row: dict[str, Any], algorithm: str, resolved: dict[str, Any]) -> None:
    """Refuse to add to set ``name`` credit of another algorithm, parameters or layout."""
    stored = json.loads(row["params"]) if row["params"] else {}
    given = json.loads(json.dumps(resolved, sort_keys=True, default=str))
    if row["layout"] != "trace" or (row["algorithm"], stored) != (algorithm, given):
        raise WriteError(
            f"credit set {name!r} holds {row['algorithm']} with {json.dumps(stored, sort_keys=True)} (per "
            f"{row['layout']}), not {algorithm} with {json.dumps(given, sort_keys=True)}: a set holds one "
            "algorithm's credit with one set of parameters (name another set); nothing written"
        )


def _refuse_held(lake: catalog.Opened, name: str, chosen: pa.Array, batches: pa.Table) -> None:
    """Refuse to stamp selected traces set ``name`` already holds values of (visible ones:
    written with the trace's visible row), naming them."""
    columns = ["trace_id", "credit_set", catalog.BATCH]
    rows = scan_keys(lake.table("trace_credit"), "trace_id", chosen.to_pylist(), columns)
    rows = written_with(rows.filter(pc.equal(rows.column("credit_set"), name)), batches)
    held = sorted(set(rows.column("trace_id").to_pylist()))
    if held:
        shown = ", ".join(held[:SHOWN]) + (f" and {len(held) - SHOWN} more" if len(held) > SHOWN else "")
        raise WriteError(
            f"credit set {name!r} already holds {len(held)} of the selected traces ({shown}): a lake does not "
            "recompute a trace's credit (select the traces it lacks, e.g. --after the last step's watermark); "
            "nothing written"
        )


__all__ = ["GROUP_ALGORITHMS", "compute", "run"]
