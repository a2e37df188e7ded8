"""Dose-matched comparison of credit sets: how much credit each set gives, where, and how
two sets agree, over the same frozen rollouts; and rescaling an algorithm's output to the
dose of another set.

The dose of a set in a trace is read over the trace's sampled tokens, each node once, as
the spread reads them (``credit_dose`` in ``schema/macros.sql``): tokens assigned and
credited (nonzero), coverage (assigned / sampled), the signed, absolute and squared masses
``sum A``, ``sum |A|``, ``sum A^2``, and the concentration ``n * sum A^2 / (sum |A|)^2`` over
the trace's ``n`` sampled tokens (1 for uniform credit, ``L/m`` for equal credit on ``m``
of ``L`` tokens: the squared-mass ratio of the dose-matching papers). Between two sets
(``credit_agreement``): the tokens both assign, the share whose signs agree, and their
Pearson correlation. A trace a set leaves unassigned has no masses (None, not zero).

``matched_to``: :func:`match` rescales an algorithm's output per trace so that its
``sum |A|`` over the trace's tokens equals the reference set's; a trace where either side
is 0 (or the reference leaves it unassigned) is left as it is, and counted.
"""

from __future__ import annotations

from collections.abc import Sequence
from itertools import combinations
from typing import Any

import numpy as np
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc

from tracedb import credit_sets
from tracedb.errors import NotFound
from tracedb.handle import Handle, HandleOf, handle_of

SUMS = ("sampled_tokens", "assigned_nodes", "assigned_tokens", "credited_tokens", "mass", "abs_mass", "sq_mass")
"""The per-trace figures that add up over traces."""


def _sets(db: Handle, sets: Sequence[str]) -> list[str]:
    if isinstance(sets, str) or not sets:
        raise ValueError("name one or more credit sets to compare")
    for name in sets:
        credit_sets.resolve(db, name)  # NotFound naming the sets there are
    return list(sets)


def _traces(db: Handle, trace_ids: Sequence[str] | None) -> list[str] | None:
    """The traces asked for (None: every trace), each one in the database."""
    if trace_ids is None:
        return None
    if isinstance(trace_ids, str) or not trace_ids:
        raise ValueError("trace_ids: name one or more traces (or pass None for every trace)")
    ids = list(dict.fromkeys(trace_ids))
    found = db.sql("SELECT trace_id FROM traces WHERE list_contains(?, trace_id)", [ids]).column("trace_id")
    missing = sorted(set(ids) - set(found.to_pylist()))
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise NotFound(f"trace_ids: no trace {', '.join(map(repr, missing[:5]))}{more}")
    return ids


def dose(
    db: HandleOf, sets: Sequence[str], *, per_trace: bool = False, trace_ids: Sequence[str] | None = None
) -> pa.Table:
    """The dose of each set in ``sets`` (``"default"`` is the ingested credit): per trace
    (``per_trace=True``: set, trace_id, group_id, reward and ``credit_dose``'s figures) or
    per set (the figures summed over every trace; coverage and concentration over all the
    sampled tokens; ``traces_assigned`` counts the traces the set assigns). ``trace_ids``:
    only those traces (each must exist), as if the database held no others."""
    handle = handle_of(db)
    ids = _traces(handle, trace_ids)
    tables = [
        handle.sql("SELECT ?::VARCHAR AS credit_set, * FROM credit_dose(credit := ?)", [name, name])
        for name in _sets(handle, sets)
    ]
    per = pl.from_arrow(pa.concat_tables(tables))
    if ids is not None:
        per = per.filter(pl.col("trace_id").is_in(ids))
    if per_trace:
        return per.to_arrow()
    masses = ("mass", "abs_mass", "sq_mass")
    total = per.group_by("credit_set", maintain_order=True).agg(
        pl.col("trace_id").count().alias("traces"),
        pl.col("mass").is_not_null().sum().alias("traces_assigned"),
        *(pl.col(c).sum() for c in SUMS if c not in masses),
        # None when no trace is assigned: a sum over nothing is not zero credit.
        *(pl.when(pl.col(c).is_not_null().any()).then(pl.col(c).sum()).alias(c) for c in masses),
    )
    return total.with_columns(
        coverage=pl.when(pl.col("sampled_tokens") > 0).then(pl.col("assigned_tokens") / pl.col("sampled_tokens")),
        concentration=pl.when(pl.col("abs_mass") > 0).then(
            pl.col("sampled_tokens") * pl.col("sq_mass") / pl.col("abs_mass") ** 2
        ),
    ).to_arrow()


def agreement(
    db: HandleOf, sets: Sequence[str], *, per_trace: bool = False, trace_ids: Sequence[str] | None = None
) -> pa.Table:
    """Each pair of ``sets`` (in the order given): the tokens both assign, their sign
    agreement and correlation, per trace or over every token (``credit_agreement``);
    ``trace_ids``: over those traces' tokens only."""
    handle = handle_of(db)
    names = _sets(handle, sets)
    ids = _traces(handle, trace_ids)
    if len(names) < 2:
        raise ValueError("agreement needs two or more credit sets")
    tables = [
        handle.sql(
            "SELECT ?::VARCHAR AS set_a, ?::VARCHAR AS set_b, * "
            "FROM credit_agreement(?, ?, per_trace := ?, trace_ids := ?::VARCHAR[]) ORDER BY trace_id",
            [a, b, a, b, per_trace, ids],
        )
        for a, b in combinations(names, 2)
    ]
    out = pa.concat_tables(tables)
    return out if per_trace else out.drop_columns(["trace_id"])


def compare(
    db: HandleOf, sets: Sequence[str], *, per_trace: bool = False, trace_ids: Sequence[str] | None = None
) -> dict[str, pa.Table]:
    """:func:`dose` of every set and :func:`agreement` of every pair (none for one set),
    over ``trace_ids`` only when given."""
    handle = handle_of(db)
    names = _sets(handle, sets)
    out = {"dose": dose(handle, names, per_trace=per_trace, trace_ids=trace_ids)}
    if len(names) > 1:
        out["agreement"] = agreement(handle, names, per_trace=per_trace, trace_ids=trace_ids)
    return out


def match(db: HandleOf, table: pa.Table, reference: str) -> tuple[pa.Table, dict[str, Any]]:
    """``table`` (a credit algorithm's output in any of its shapes) rescaled per trace to
    the ``sum |A|`` over tokens that set ``reference`` gives the trace. A trace whose
    ``sum |A|`` is 0 on either side, or that the reference leaves unassigned, keeps its
    values. Returns the table (same columns and types) and what was done: ``matched_to``,
    ``rescaled`` (traces), ``left_as_is`` (traces in the table: zero mass on either side
    or unassigned by the reference) and, of those, ``unassigned_in_reference``."""
    handle = handle_of(db)
    try:
        credit_sets.resolve(handle, reference)
    except NotFound as e:
        raise NotFound(f"matched_to: {e}") from None
    ref = handle.sql("SELECT trace_id, abs_mass, sampled_tokens FROM credit_dose(credit := ?)", [reference])
    trace_ids = table.column("trace_id").combine_chunks().cast(pa.string())
    # Each row's trace, numbered; its row in the reference's dose (-1: not in the database).
    codes = pc.dictionary_encode(trace_ids).indices.to_numpy().astype(np.int64)
    firsts = np.unique(codes, return_index=True)[1] if len(codes) else np.zeros(0, np.int64)
    at = pc.index_in(trace_ids.take(pa.array(firsts)), value_set=ref.column("trace_id").combine_chunks())
    at = pc.fill_null(at, -1).to_numpy().astype(np.int64)
    reference_mass = np.append(pc.fill_null(ref.column("abs_mass"), np.nan).to_numpy(), np.nan)[at]
    if "node_index" in table.column_names:
        row_mass = _row_mass(handle, table)
    else:  # one value per trace, over the trace's sampled tokens
        sampled = np.append(ref.column("sampled_tokens").to_numpy().astype(np.float64), 0.0)[at][codes]
        row_mass = np.abs(pc.fill_null(table.column("value").cast(pa.float64()), 0.0).to_numpy()) * sampled
    mass = np.bincount(codes, weights=row_mass, minlength=len(firsts))
    unassigned = np.isnan(reference_mass)
    rescale = ~unassigned & (mass > 0) & (np.nan_to_num(reference_mass) > 0)
    factor = np.ones(len(mass))
    factor[rescale] = reference_mass[rescale] / mass[rescale]
    summary = {
        "matched_to": reference,
        "rescaled": int(rescale.sum()),
        "left_as_is": int((~rescale).sum()),
        "unassigned_in_reference": int(unassigned.sum()),
    }
    return _scaled(table, factor[codes]), summary


def _row_mass(db: Handle, table: pa.Table) -> np.ndarray:
    """``sum |A|`` of each row of a per-node table (``values`` lists, or a ``value`` over the
    node's sampled tokens)."""
    if "values" in table.column_names:
        lists = table.column("values").combine_chunks()
        offsets = lists.offsets.to_numpy().astype(np.int64)
        flat = np.abs(lists.values.to_numpy(zero_copy_only=False).astype(np.float64))[offsets[0] : offsets[-1]]
        sums = np.add.reduceat(flat, offsets[:-1] - offsets[0]) if len(flat) else np.zeros(len(lists))
        sums[np.diff(offsets) == 0] = 0.0  # reduceat reads the next list for an empty one
        return np.where(lists.is_valid().to_numpy(zero_copy_only=False), sums, 0.0)
    keys = table.select(["trace_id", "node_index"])
    with db.registered("_tdb_match", keys):
        sizes = db.sql(
            "SELECT k.i, n.n_sampled FROM (SELECT row_number() OVER () - 1 AS i, * FROM _tdb_match) k "
            "JOIN nodes n USING (trace_id, node_index) ORDER BY k.i"
        )
    n_sampled = np.zeros(table.num_rows)
    n_sampled[sizes.column("i").to_numpy()] = sizes.column("n_sampled").to_numpy()
    return np.abs(pc.fill_null(table.column("value").cast(pa.float64()), 0.0).to_numpy()) * n_sampled


def _scaled(table: pa.Table, factor: np.ndarray) -> pa.Table:
    """``table`` with each row's value(s) times its ``factor``, types kept."""
    if "values" in table.column_names:
        i = table.column_names.index("values")
        lists = table.column("values").combine_chunks()
        offsets = lists.offsets.to_numpy().astype(np.int64)
        flat = lists.values.to_numpy(zero_copy_only=False).astype(np.float64)[offsets[0] : offsets[-1]]
        flat = flat * np.repeat(factor, np.diff(offsets))
        values = pa.ListArray.from_arrays(
            pa.array((offsets - offsets[0]).astype(np.int32)),
            pa.array(flat.astype(np.float32)),
            mask=pc.invert(lists.is_valid()),
        )
        return table.set_column(i, table.schema.field(i), values.cast(table.schema.field(i).type))
    i = table.column_names.index("value")
    value = table.column("value").combine_chunks()
    scaled = pc.multiply(value.cast(pa.float64()), pa.array(factor)).cast(value.type)
    return table.set_column(i, table.schema.field(i), scaled)
