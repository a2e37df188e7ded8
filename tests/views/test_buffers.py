"""View columns in mappings that go back to a pool when Arrow lets go (tracedb/views/_buffers.py)."""

from __future__ import annotations

import gc
from typing import Any

import numpy as np
import pyarrow as pa
import pytest

from tracedb import runtime
from tracedb.views import _buffers


@pytest.fixture
def pool(knobs: Any) -> None:
    """Every column through the pool, starting empty."""
    gc.collect()  # mappings of earlier tests go back before the pool is emptied
    runtime.idle_mappings().clear()
    knobs(buffer_min_bytes=0, buffer_pool_bytes=64 << 20)


def address(values: np.ndarray) -> int:
    return values.__array_interface__["data"][0]


def test_a_mapping_comes_back_once_arrow_lets_go(pool: None) -> None:
    values = _buffers.empty(1000, np.int32)
    values[:] = np.arange(1000)
    first = address(values)
    array = pa.Array.from_buffers(pa.int32(), 1000, [None, values.base])
    del values
    gc.collect()
    assert _buffers.idle_bytes() == 0  # Arrow still holds it
    assert array.to_pylist()[-1] == 999
    del array
    gc.collect()
    assert _buffers.idle_bytes() == 1 << 20  # one MiB grain
    again = _buffers.empty(900, np.float32)
    assert address(again) == first  # the same pages, reused
    assert again.flags.writeable
    assert _buffers.idle_bytes() == 0


def test_sizes_far_apart_do_not_share(pool: None) -> None:
    small = _buffers.empty(1 << 18, np.int32)  # 1 MiB
    small_at = address(small)
    del small
    gc.collect()
    big = _buffers.empty(1 << 20, np.int32)  # 4 MiB: the idle 1 MiB mapping is too small
    assert address(big) != small_at
    assert _buffers.idle_bytes() == 1 << 20
    big_at = address(big)
    del big
    gc.collect()
    small = _buffers.empty(1 << 18, np.int32)  # 1 MiB: takes the 1 MiB one, not the 4 MiB one
    assert address(small) == small_at
    assert _buffers.idle_bytes() == 4 << 20 and address(small) != big_at


def test_taking_trims_the_pool_to_its_budget(pool: None, knobs: Any) -> None:
    before = _buffers.idle_bytes()
    held = [_buffers.empty((1 << 20) // 4, np.int32) for _ in range(6)]  # six 1 MiB mappings
    del held
    gc.collect()
    assert _buffers.idle_bytes() - before >= 6 << 20
    knobs(buffer_pool_bytes=3 << 20)  # a smaller budget from now on
    big = _buffers.empty((8 << 20) // 4, np.int32)  # a request none fits: the pool is trimmed on the way
    assert _buffers.idle_bytes() <= 3 << 20
    assert len(big) == 2 << 20


def test_pool_off_uses_arrows_allocator(knobs: Any) -> None:
    knobs(buffer_pool_bytes=0)
    values = _buffers.empty(1 << 20, np.int32)
    assert isinstance(values.base, pa.Buffer) and values.flags.writeable
    assert not isinstance(np.frombuffer(values.base, np.uint8), _buffers._Owner)


def test_views_stay_exact_on_reused_dirty_memory(fixture_db, pool: None) -> None:
    """Columns are written whole: a view built on pages an earlier, different view left
    behind equals the same view built on fresh memory."""
    shapes = [
        {},
        {"columns": ["token_ids", "logprobs"]},
        {"trainable": True},
        {"train_once": True},
        {"columns": ["advantages", "sampled_mask"], "trainable": False},
    ]
    expected = []
    with runtime.configure(buffer_pool_bytes=0):
        for shape in shapes:
            fixture_db.handle.view_cache = None
            expected.append(fixture_db.branches(**shape))
    for _ in range(3):
        for shape, want in zip(shapes, expected, strict=True):
            fixture_db.handle.view_cache = None
            got = fixture_db.branches(**shape)
            assert got.equals(want), shape
            del got
            gc.collect()  # mappings go back to the pool, dirty
    assert _buffers.idle_bytes() > 0  # the views' columns went through the pool and came back


def test_release_keeps_the_pool_within_budget(pool: None, knobs: Any) -> None:
    knobs(buffer_pool_bytes=3 << 20)
    held = [_buffers.empty((1 << 20) // 4, np.int32) for _ in range(8)]  # eight 1 MiB mappings
    del held
    gc.collect()
    assert _buffers.idle_bytes() <= 3 << 20  # the others were dropped as they came back


def test_an_empty_column_through_the_pool(pool: None) -> None:
    values = _buffers.empty(0, np.float32)
    assert len(values) == 0 and isinstance(values.base, pa.Buffer)


def _child_checks(view: pa.Table, digest: int, go, queue) -> None:
    go.wait(60)
    queue.put(hash(view.column("token_ids").combine_chunks().values.to_numpy().tobytes()) == digest)


def test_a_forked_childs_view_is_not_overwritten_by_its_parent(fixture_db, pool: None) -> None:
    """Pooled mappings are private: after fork, the parent reusing a mapping for its next
    view must not change the view the child inherited (and the other way round)."""
    import multiprocessing

    if "fork" not in multiprocessing.get_all_start_methods():
        pytest.skip("needs fork")
    view = fixture_db.branches()
    digest = hash(view.column("token_ids").combine_chunks().values.to_numpy().tobytes())
    ctx = multiprocessing.get_context("fork")
    go, queue = ctx.Event(), ctx.Queue()
    child = ctx.Process(target=_child_checks, args=(view, digest, go, queue))
    child.start()
    del view
    gc.collect()  # the parent's mappings go back to its pool...
    for shape in ({"columns": ["token_ids"], "trainable": True}, {}, {"columns": ["token_ids"]}):
        fixture_db.handle.view_cache = None
        fixture_db.branches(**shape)  # ...and are written again
    go.set()
    child.join(60)
    assert child.exitcode == 0 and queue.get(timeout=5) is True
