"""Internals of the numpy view path that the property tests reach only by chance."""

from __future__ import annotations

import pyarrow as pa

from tracedb.views.nodes import node_ordered


def table(traces: list[str], index: list[int]) -> pa.Table:
    return pa.table({"trace_id": traces, "node_index": pa.array(index, pa.int32())})


def test_node_ordered_accepts_runs_in_node_order() -> None:
    assert node_ordered(table([], []))
    assert node_ordered(table(["b", "b", "a", "a", "a"], [0, 1, 0, 1, 2]))  # trace order is free


def test_node_ordered_rejects_what_needs_a_sort() -> None:
    assert not node_ordered(table(["a", "a"], [1, 0]))
    assert not node_ordered(table(["a", "b", "a"], [0, 0, 1]))  # a trace split in two runs
    assert not node_ordered(table(["a", "a", "b"], [0, 2, 0]))  # a gap


def test_unordered_rows_give_the_same_view(fixture_db, monkeypatch) -> None:
    import tracedb.views.nodes as views

    expected = fixture_db.branches()
    fixture_db.handle.view_cache = None
    monkeypatch.setattr(views, "node_ordered", lambda nodes: False)  # force the sort
    assert fixture_db.branches().equals(expected)


def test_without_insertion_order_views_read_lists(fixture_db, monkeypatch) -> None:
    """Flat reads pair two scans by row order, which DuckDB keeps only while
    preserve_insertion_order is on; with it off the view reads lists and is still exact."""
    import tracedb.views.nodes as views

    expected = fixture_db.branches()
    fixture_db.handle.view_cache = None
    fixture_db.con.execute("SET preserve_insertion_order = false")  # instance-wide: undone below

    def refuse(*args, **kwargs):
        raise AssertionError("flat read without insertion order")

    monkeypatch.setattr(views, "read_all", refuse)
    try:
        assert fixture_db.branches().equals(expected)
    finally:
        fixture_db.con.execute("RESET preserve_insertion_order")


def test_views_inside_a_users_own_transaction(fixture_db) -> None:
    """A transaction opened with raw SQL is read inside and left open, uncommitted work and all."""
    expected = fixture_db.branches(columns=["advantages"])
    fixture_db.con.execute("BEGIN TRANSACTION")
    fixture_db.con.execute("UPDATE node_store SET advantages = NULL")
    fixture_db.handle.view_cache = None
    inside = fixture_db.branches(columns=["advantages"])
    assert inside.column("advantages").null_count == inside.num_rows  # sees the uncommitted update
    fixture_db.con.execute("ROLLBACK")  # the transaction was still the user's to end
    fixture_db.handle.view_cache = None
    assert fixture_db.branches(columns=["advantages"]).equals(expected)


def test_credit_rows_naming_no_node_are_ignored(fixture_db) -> None:
    """A credit row for a node or trace that does not exist (only raw SQL can write one)
    never lands on another node."""
    fixture_db.create_credit_set("raw")
    before = fixture_db.branches(credit="raw", columns=["advantages"])
    last = fixture_db.sql("SELECT trace_id, max(node_index) AS n FROM nodes GROUP BY ALL ORDER BY ALL LIMIT 1")
    trace_id, n = last.column("trace_id")[0].as_py(), last.column("n")[0].as_py()
    fixture_db.con.execute(
        "INSERT INTO credit (credit_set, trace_id, node_index, value) "
        "VALUES ('raw', ?, ?, 1.0), ('raw', 'nope', 0, 1.0)",
        [trace_id, n + 1],
    )
    fixture_db.handle.view_cache = None
    assert fixture_db.branches(credit="raw", columns=["advantages"]).equals(before)
    assert fixture_db.branches(trace_ids=[trace_id], credit="raw", columns=["advantages"]).equals(
        before.filter(pa.compute.equal(before.column("trace_id"), trace_id))
    )


def test_a_forked_child_builds_views(tmp_path) -> None:
    """The side-read thread pool does not survive a fork: a child (a DataLoader worker, say)
    of a process that built views builds its own."""
    import multiprocessing

    import tracedb

    from support import FIXTURES

    path = tmp_path / "f.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
        expected = db.branches().num_rows
    with tracedb.connect(path, read_only=True) as db:
        assert db.branches().num_rows == expected  # starts the pool in this process
    context = multiprocessing.get_context("fork")
    queue = context.Queue()
    child = context.Process(target=_child_view, args=(str(path), queue))
    child.start()
    child.join(120)
    if child.is_alive():
        child.kill()
        raise AssertionError("the forked child hung building a view")
    assert child.exitcode == 0 and queue.get(timeout=5) == expected


def _child_view(path: str, queue) -> None:
    import tracedb

    with tracedb.connect(path, read_only=True) as db:
        queue.put(db.branches().num_rows)


def test_selection_segments_by_lookup_or_join(fixture_db, knobs) -> None:
    """A selection's segments come by a literal IN list (few) or a join (many): same view."""
    ids = sorted(set(fixture_db.branches(columns=[]).column("trace_id").to_pylist()))[:3]
    by_lookup = fixture_db.branches(trace_ids=ids)
    fixture_db.handle.view_cache = None
    knobs(segment_lookup=0)
    assert fixture_db.branches(trace_ids=ids).equals(by_lookup)
    assert fixture_db.branches(trace_ids=["no-such-trace"]).num_rows == 0


def test_kernels_compile_without_a_writable_cache() -> None:
    """Where numba finds no writable cache location it refuses cache=True at decoration;
    the kernels then compile per process and still spread correctly."""
    import subprocess
    import sys

    script = """
import numba, numpy as np
real = numba.njit
def njit(*args, **kwargs):
    if kwargs.get("cache"):
        raise RuntimeError("cannot cache function: no locator available")
    return real(*args, **kwargs)
numba.njit = njit
from tracedb.views import _kernels
out = np.empty(4, np.float32)
i64 = lambda *v: np.array(v, np.int64)
_kernels.spread_stream(0, 1, i64(0, 1), i64(0), i64(0, 4), i64(4), i64(1), i64(0), np.zeros(0, np.int32),
                       i64(0), i64(2), np.array([5, 6, 7], np.float32), out)
print(out.tolist())
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[0.0, 5.0, 6.0, 0.0]"  # prefix 1, two values taken, the rest zero


def test_flat_reads_in_many_small_batches_give_the_same_view(fixture_db, knobs) -> None:
    expected = fixture_db.branches()
    fixture_db.handle.view_cache = None
    knobs(stream_rows=7)  # every flat column arrives in many batches
    assert fixture_db.branches().equals(expected)


def test_flat_read_refuses_values_that_do_not_fit_the_lengths(fixture_db) -> None:
    """Lengths and values come from two scans; if they ever disagreed the read must fail,
    not hand out shifted values."""
    import numpy as np
    import pytest

    from tracedb.views.nodes import flat_column

    con = fixture_db.con
    lengths = con.sql("SELECT n_tokens FROM segments").to_arrow_table().column(0)
    values, offsets, _ = flat_column(con, "SELECT unnest(token_ids) FROM segments", lengths, np.int32)
    assert len(values) == offsets[-1] == sum(lengths.to_pylist())
    short = pa.chunked_array([pa.array([n - (i == 0) for i, n in enumerate(lengths.to_pylist())], pa.int32())])
    long = pa.chunked_array([pa.array([n + (i == 0) for i, n in enumerate(lengths.to_pylist())], pa.int32())])
    for wrong in (short, long):
        with pytest.raises(RuntimeError, match="other than the"):
            flat_column(con, "SELECT unnest(token_ids) FROM segments", wrong, np.int32)


def test_segments_kept_as_lists_and_as_text_read_in_row_order() -> None:
    """Batches store their segments each the smaller way (``tracedb.codec.token_form``):
    a read of rows of both kinds gives every row its own ids, in row order."""
    import numpy as np

    from tracedb import codec
    from tracedb.views.nodes import segment_tokens

    rows = [[5, 6, 7], [151_000, 2], [], [9], [0, 1, 2, 3]]
    as_text = [True, False, True, True, False]
    text = codec.token_text(
        np.array([t for r, k in zip(rows, as_text, strict=True) if k for t in r], np.int32),
        np.cumsum([0] + [len(r) for r, k in zip(rows, as_text, strict=True) if k]),
    ).to_pylist()
    it = iter(text)
    segments = pa.table(
        {
            "n_tokens": pa.array([len(r) for r in rows], pa.int32()),
            "token_ids": pa.array([None if k else r for r, k in zip(rows, as_text, strict=True)], pa.list_(pa.int32())),
            "tokens": pa.array([next(it) if k else None for k in as_text], pa.string()),
        }
    )
    listed = [r if not k else [] for r, k in zip(rows, as_text, strict=True)]
    flat = (np.array([t for r in listed for t in r], np.int32), np.cumsum([0] + [len(r) for r in listed]))
    for given in (None, flat):  # lists read with the rows, or flat (the whole-database read)
        values, offsets, valid = segment_tokens(segments, given)
        assert [values[offsets[i] : offsets[i + 1]].tolist() for i in range(len(rows))] == rows
        assert valid.all() and values.dtype == np.int32
