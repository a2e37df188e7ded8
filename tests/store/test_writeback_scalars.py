"""Per-node constants: ``write_nodes`` with ``value`` and the compaction of constant lists."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from tracedb.errors import WriteError
from tracedb.writeback import constant_rows


def sampled_nodes(db, limit: int = 4) -> list[tuple[str, int, int]]:
    return [
        tuple(r.values())
        for r in db.sql(
            "SELECT trace_id, node_index, n_sampled FROM nodes WHERE n_sampled > 0 ORDER BY ALL LIMIT ?", [limit]
        ).to_pylist()
    ]


@pytest.mark.parametrize("credit", [None, "s"])
def test_value_broadcasts_over_sampled_tokens(fixture_db, credit) -> None:
    if credit:
        fixture_db.create_credit_set(credit)
    nodes = sampled_nodes(fixture_db)
    written = fixture_db.write_nodes(
        [{"trace_id": t, "node_index": i, "value": 0.25 * k} for k, (t, i, _) in enumerate(nodes)], credit=credit
    )
    assert written == len(nodes)
    for k, (t, i, n) in enumerate(nodes):
        record = fixture_db.trace(t, credit=credit)
        assert record["nodes"][i]["advantages"] == [0.25 * k] * n  # zero stays zero (k = 0)


def test_value_rows_are_checked_whole(fixture_db) -> None:
    (t, i, _), *_ = sampled_nodes(fixture_db)
    before = fixture_db.trace(t)
    with pytest.raises(WriteError, match="node 999 not in the database"):
        fixture_db.write_nodes(
            [{"trace_id": t, "node_index": i, "value": 1.0}, {"trace_id": t, "node_index": 999, "value": 1.0}]
        )
    with pytest.raises(WriteError, match="NaN or infinite"):
        fixture_db.write_nodes([{"trace_id": t, "node_index": i, "value": float("inf")}])
    with pytest.raises(WriteError, match="two different"):
        fixture_db.write_nodes(
            [{"trace_id": t, "node_index": i, "value": 1.0}, {"trace_id": t, "node_index": i, "value": 2.0}]
        )
    with pytest.raises(WriteError, match="per token"):
        fixture_db.write_nodes([{"trace_id": t, "node_index": i, "value": 1.0}], stream="loss_weights", name="w")
    assert fixture_db.trace(t) == before


def test_null_value_clears(fixture_db) -> None:
    (t, i, _), *_ = sampled_nodes(fixture_db)
    fixture_db.write_nodes([{"trace_id": t, "node_index": i, "value": 0.0}])
    fixture_db.write_nodes(pa.table({"trace_id": [t], "node_index": [i], "value": pa.nulls(1, pa.float64())}))
    assert "advantages" not in fixture_db.trace(t)["nodes"][i]


def test_constant_rows() -> None:
    table = pa.table(
        {
            "trace_id": ["a", "a", "b"],
            "node_index": [1, 3, 2],
            "values": pa.array([[0.5, 0.5], [-1.0], [2.0, 2.0, 2.0]], pa.list_(pa.float32())),
        }
    )
    rows = constant_rows(table)
    assert rows.column("value").to_pylist() == [0.5, -1.0, 2.0]
    assert rows.column("node_index").to_pylist() == [1, 3, 2]
    varying = table.set_column(2, "values", pa.array([[0.5, 0.25], [-1.0], [2.0]], pa.list_(pa.float32())))
    assert constant_rows(varying) is None
    empty = table.set_column(2, "values", pa.array([[0.5], [], [2.0]], pa.list_(pa.float32())))
    assert constant_rows(empty) is None  # an empty list is not "no value"
    nulls = table.set_column(2, "values", pa.array([[0.5], None, [2.0]], pa.list_(pa.float32())))
    assert constant_rows(nulls) is None
    assert (
        np.isnan(np.float32("nan"))
        and constant_rows(
            table.set_column(2, "values", pa.array([[np.nan, np.nan], [1.0], [2.0]], pa.list_(pa.float32())))
        )
        is None
    )


def test_credit_set_views_agree_on_every_read_path(fixture_db) -> None:
    """A named set holding lists, broadcast values, ragged lists and cleared nodes reads the
    same through the whole-database view (flat reads), per-trace views (list reads), the
    export batches and the SQL macro; unwritten nodes are null, zeros stay zeros."""
    fixture_db.create_credit_set("mix")
    rows = fixture_db.sql(
        "SELECT trace_id, node_index, n_sampled FROM nodes WHERE n_sampled > 0 ORDER BY ALL"
    ).to_pylist()
    rng = np.random.default_rng(5)
    lists = [r for k, r in enumerate(rows) if k % 3 == 0]
    scalars = [r for k, r in enumerate(rows) if k % 3 == 1]
    fixture_db.write_nodes(
        [
            {
                "trace_id": r["trace_id"],
                "node_index": r["node_index"],
                "values": rng.normal(size=r["n_sampled"]).tolist(),
            }
            for r in lists
        ],
        credit="mix",
    )
    fixture_db.write_nodes(
        [
            {"trace_id": r["trace_id"], "node_index": r["node_index"], "value": float(k % 2)}
            for k, r in enumerate(scalars)
        ],
        credit="mix",
    )
    if scalars:  # one written then cleared: unassigned again
        r = scalars[0]
        fixture_db.write_nodes(
            pa.table(
                {"trace_id": [r["trace_id"]], "node_index": [r["node_index"]], "value": pa.nulls(1, pa.float64())}
            ),
            credit="mix",
        )
    whole = fixture_db.branches(credit="mix", columns=["advantages"])
    ids = sorted(set(whole.column("trace_id").to_pylist()))
    per_trace = pa.concat_tables(fixture_db.branches(trace_ids=[t], credit="mix", columns=["advantages"]) for t in ids)
    assert per_trace.equals(whole)
    batches = pa.concat_tables(fixture_db.iter_branches(credit="mix", columns=["advantages"], batch_tokens=1))
    assert batches.equals(whole)
    sql = fixture_db.sql(
        "SELECT trace_id, branch_index, advantages FROM branch_tokens(credit := 'mix') ORDER BY trace_id, branch_index"
    )
    assert sql.column("advantages").to_pylist() == whole.column("advantages").to_pylist()
    assert whole.column("advantages").null_count > 0  # some branches hold no credit of the set


def test_constant_rows_sees_nan_and_unequal_lists() -> None:
    table = pa.table(
        {
            "trace_id": ["a", "a", "b"],
            "node_index": pa.array([0, 1, 0], pa.int32()),
            "values": pa.array([[1.0, 1.0], [2.0], [3.0, 3.0, 3.0]], pa.list_(pa.float32())),
        }
    )
    assert constant_rows(table).column("value").to_pylist() == [1.0, 2.0, 3.0]
    for odd in ([1.0, float("nan")], [float("nan"), float("nan")], [1.0, 1.5]):
        bad = table.set_column(2, "values", pa.array([odd, [2.0], [3.0, 3.0, 3.0]], pa.list_(pa.float32())))
        assert constant_rows(bad) is None


@pytest.mark.parametrize("layout", ["trace", "node"])
def test_stamp_fresh_checks_finite_values_and_unique_keys(fixture_db, monkeypatch, layout) -> None:
    """What credit.run writes into a just-created set is checked for NaN/inf and duplicate
    keys; a refused stamp leaves no set and no credit behind."""
    import tracedb.credit
    from tracedb.credit import ALGORITHMS, Algorithm

    (t, i, n), (t2, i2, n2), *_ = sampled_nodes(fixture_db, 2)
    rows: dict = {"trace_id": [t, t2], "value": [0.5, float("nan")]}
    if layout == "node":
        rows["node_index"] = pa.array([i, i2], pa.int32())
    sizes = {(t, i): n, (t2, i2): n2}
    module = type(tracedb)("fake_credit")
    module.algo = lambda db: pa.table(rows) if layout == "trace" else _as_lists(pa.table(rows), sizes)
    monkeypatch.setitem(__import__("sys").modules, "tracedb.credit.fake", module)
    monkeypatch.setitem(ALGORITHMS, "fake", Algorithm("fake", "fake:algo", layout, "test"))
    before = fixture_db.credit_sets().num_rows
    with pytest.raises(WriteError, match="NaN"):  # per-node NaN lists are not constant: the list writer refuses
        tracedb.credit.run(fixture_db, "fake", "f")
    rows["value"] = [0.5, 0.5]
    rows["trace_id"] = [t, t]
    if layout == "node":
        rows["node_index"] = pa.array([i, i], pa.int32())
        sizes[(t2, i2)] = n
    with pytest.raises(WriteError, match="two rows"):
        tracedb.credit.run(fixture_db, "fake", "f")
    assert fixture_db.credit_sets().num_rows == before
    for table in ("credit", "trace_credit"):
        assert fixture_db.sql(f"SELECT count(*) AS n FROM {table}").column("n")[0].as_py() == 0


def _as_lists(table: pa.Table, sizes: dict) -> pa.Table:
    """Per-node constant lists (what turn-level algorithms return) from (trace, node, value)."""
    keys = zip(table.column("trace_id").to_pylist(), table.column("node_index").to_pylist())
    values = [[v] * sizes[k] for v, k in zip(table.column("value").to_pylist(), keys)]
    return pa.table(
        {
            "trace_id": table.column("trace_id"),
            "node_index": table.column("node_index"),
            "values": pa.array(values, pa.list_(pa.float32())),
        }
    )


@pytest.mark.parametrize("layout", ["trace", "node"])
def test_stamp_fresh_refuses_keys_not_in_the_database(fixture_db, layout) -> None:
    from tracedb.writeback import stamp_fresh

    rows = {"trace_id": ["nope"], "value": [0.5]}
    if layout == "node":
        (t, _, _), *_ = sampled_nodes(fixture_db, 1)
        rows = {"trace_id": [t], "node_index": pa.array([10_000], pa.int32()), "value": [0.5]}
    fixture_db.create_credit_set("s")
    with pytest.raises(WriteError, match="not in the database"):
        stamp_fresh(fixture_db.handle, "s", pa.table(rows), layout)
