"""Internals of the numpy view path that the property tests reach only by chance."""

from __future__ import annotations

import pyarrow as pa

from tracedb.views import _node_ordered


def table(traces: list[str], index: list[int]) -> pa.Table:
    return pa.table({"trace_id": traces, "node_index": pa.array(index, pa.int32())})


def test_node_ordered_accepts_runs_in_node_order() -> None:
    assert _node_ordered(table([], []))
    assert _node_ordered(table(["b", "b", "a", "a", "a"], [0, 1, 0, 1, 2]))  # trace order is free


def test_node_ordered_rejects_what_needs_a_sort() -> None:
    assert not _node_ordered(table(["a", "a"], [1, 0]))
    assert not _node_ordered(table(["a", "b", "a"], [0, 0, 1]))  # a trace split in two runs
    assert not _node_ordered(table(["a", "a", "b"], [0, 2, 0]))  # a gap


def test_unordered_rows_give_the_same_view(fixture_db, monkeypatch) -> None:
    import tracedb.views as views

    expected = fixture_db.branches()
    fixture_db._cache = None
    monkeypatch.setattr(views, "_node_ordered", lambda nodes: False)  # force the sort
    assert fixture_db.branches().equals(expected)
