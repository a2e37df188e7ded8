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
from pyiceberg.expressions import EqualTo

from tracedb import credit as credit_lib
from tracedb.credit.outcome import trace_rewards
from tracedb.credit_sets import check_name
from tracedb.errors import WriteError
from tracedb.lake import catalog
from tracedb.lake import files as lake_files
from tracedb.lake.scan import visible_traces
from tracedb.lake.workers import quiet_data, running_ray
from tracedb.lake.write import lake_rows

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


def compute(lake: catalog.Opened, algorithm: str, **params: Any) -> pa.Table:
    """``(trace_id, value)`` of ``algorithm`` (grpo or rloo, with its parameters) over the
    lake's visible traces, by trace id; groups credited in a Ray groupby."""
    if algorithm not in GROUP_ALGORITHMS:
        raise ValueError(f"lake credit computes {list(GROUP_ALGORITHMS)}, not {algorithm!r}")
    known = credit_lib.algorithms()[algorithm].params()
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ValueError(f"lake credit {algorithm}: unknown parameters {unknown}; known: {sorted(known)}")
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


def run(lake: catalog.Opened, algorithm: str, name: str | None = None, **params: Any) -> dict[str, Any]:
    """See :meth:`tracedb.lake.Lake.credit`."""
    name = check_name(algorithm if name is None else name)
    sets = lake.table("credit_sets").scan(selected_fields=("name",)).to_arrow().column("name").to_pylist()
    if name in sets:
        raise WriteError(
            f"credit set {name!r} exists in the lake (a lake does not recompute a set yet: pick a new name)"
        )
    for table in ("trace_credit", "credit"):
        left = lake.table(table).scan(row_filter=EqualTo("credit_set", name), selected_fields=("trace_id",), limit=1)
        if left.to_arrow().num_rows:
            raise WriteError(
                f"credit set {name!r}: the lake holds {table} values of it from a write that never committed the "
                "set (its writer died, or one is writing it now); `tracedb lake compact` removes them once they "
                "are older than its --grace, then write the set again"
            )
    values = compute(lake, algorithm, **params)
    batches = _visible_traces(lake, ["trace_id"])
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
    resolved = {**credit_lib.algorithms()[algorithm].params(), **params}
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
    return {"name": name, "algorithm": algorithm, "params": resolved, "rows": stamped.num_rows}


__all__ = ["GROUP_ALGORITHMS", "compute", "run"]
