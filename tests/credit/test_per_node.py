"""What ``run`` stamps for a turn-level algorithm registered with ``per_node`` (returns,
gae): the credit of its list form (``compute``), one value per node, never expanded into
lists and collapsed again; the stamped set reads exactly as the lists would."""

from __future__ import annotations

import pyarrow as pa
import pytest

import tracedb
import tracedb.credit
from tracedb.credit import ALGORITHMS
from tracedb.credit.layouts import NODE_VALUE

CASES = [
    ("gae", {}),
    ("gae", {"gamma": 0.9, "lam": 0.7, "include_failed": True}),
    ("returns", {"gamma": 0.8}),
    ("returns", {"terminal_reward": False, "subtract_values": True}),
]


@pytest.mark.parametrize(("algorithm", "params"), CASES)
def test_per_node_table_is_the_list_table_one_value_per_node(fixture_db, algorithm, params):
    algo = ALGORITHMS[algorithm]
    lists = algo.func(fixture_db.handle, **params)
    scalars = algo.stamp_func(fixture_db.handle, **params)
    assert scalars.schema == NODE_VALUE and scalars.num_rows == lists.num_rows > 0
    assert scalars.select(["trace_id", "node_index"]).equals(lists.select(["trace_id", "node_index"]))
    expanded = [[v] * len(vs) for v, vs in zip(scalars.column("value").to_pylist(), lists.column("values").to_pylist())]
    assert pa.array(expanded, pa.list_(pa.float32())).equals(lists.column("values").combine_chunks())


@pytest.mark.parametrize(("algorithm", "params"), CASES)
def test_the_stamped_set_reads_as_the_lists(fixture_db, algorithm, params):
    lists = tracedb.credit.compute(fixture_db, algorithm, **params)
    lists = lists.sort_by([("trace_id", "ascending"), ("node_index", "ascending")])
    result = tracedb.credit.run(fixture_db, algorithm, "s", **params)
    stored = fixture_db.sql(
        "SELECT trace_id, node_index, advantages AS values FROM credit_advantages('s') "
        "WHERE advantages IS NOT NULL ORDER BY trace_id, node_index"
    )
    assert result["nodes"] == lists.num_rows == stored.num_rows
    assert stored.column("values").to_pylist() == lists.column("values").to_pylist()
    assert fixture_db.sql("SELECT count(*) AS n FROM credit WHERE credit_set = 's' AND value IS NULL").to_pylist() == [
        {"n": 0}
    ]  # stored once per node


def test_no_turns_and_unknown_parameters(fixture_db):
    empty = ALGORITHMS["gae"].stamp_func(fixture_db.handle, reward="no-such-reward")
    assert empty.schema == NODE_VALUE and empty.num_rows == 0
    with pytest.raises(TypeError, match="bogus"):
        tracedb.credit.run(fixture_db, "gae", "x", bogus=1)
    with pytest.raises(ValueError, match="lam must be within"):
        tracedb.credit.run(fixture_db, "gae", "x", lam=2.0)
    assert not fixture_db.has_credit_set("x")
