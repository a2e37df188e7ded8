"""The list arrays both parse paths build from offsets, values and a null mask."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from tracedb.ingest.columns import list_array, numpy_lists


@pytest.mark.parametrize("nulls", [[], [0], [1, 3], [0, 1, 2, 3, 4]])
def test_list_array_equals_arrows_own(nulls):
    offsets = np.array([0, 2, 2, 5, 5, 6], np.int64)
    values = pa.array([1, 2, 3, 4, 5, 6], pa.int32())
    null = np.zeros(5, bool)
    null[nulls] = True
    mask = pa.array(null) if null.any() else None
    expected = pa.ListArray.from_arrays(pa.array(offsets.astype(np.int32)), values, mask=mask)
    got = list_array(offsets, values, null)
    assert got.type == pa.list_(pa.int32()) and got.null_count == len(nulls)
    assert got.equals(expected) and got.to_pylist() == expected.to_pylist()


def test_list_array_of_structs_and_a_null_at_a_bitmap_byte_edge():
    n = 17
    offsets = np.arange(n + 1, dtype=np.int64)
    values = pa.StructArray.from_arrays([pa.array(range(n), pa.int32()), pa.array(["t"] * n)], names=["node", "type"])
    null = np.zeros(n, bool)
    null[[7, 8, 16]] = True
    got = list_array(offsets, values, null)
    assert [i for i, v in enumerate(got.to_pylist()) if v is None] == [7, 8, 16]
    assert got[9].as_py() == [{"node": 9, "type": "t"}]


def test_list_array_refuses_offsets_past_the_values():
    with pytest.raises(pa.ArrowInvalid):
        list_array(np.array([0, 4], np.int64), pa.array([1, 2], pa.int32()), np.zeros(1, bool))


def test_numpy_lists_keeps_none_as_null():
    got = numpy_lists([np.array([1.5, 2.0]), None, np.array([], np.float32)], pa.float32())
    assert got.to_pylist() == [[1.5, 2.0], None, []]


NEEDLE = b'"weight_versions"'
TEXTS = [
    '{"weight_versions":[]}',
    None,
    "",
    '{"a":"weight_versions"}',  # the word, not the key
    '{"b":1,"weight_versions":null}',
    'x"weight_versions',  # the needle cut by the end of the value ...
    '"weight_versions"...',  # ... and the next value holding it whole
    '"weight_versions""weight_versions"',
]


@pytest.mark.parametrize("kind", [pa.string(), pa.large_string()])
@pytest.mark.parametrize("cut", [(0, None), (1, None), (2, 5), (5, None)])
def test_holding_equals_match_substring(kind, cut):
    """The rows split_weight_versions rewrites, found on the column's buffers, are the
    ones pyarrow.compute.match_substring finds: nulls, a needle across two values, a
    sliced and a chunked column."""
    import pyarrow.compute as pc

    from tracedb.ingest.rows import holding

    start, stop = cut
    whole = pa.array(TEXTS * 3, kind)
    part = whole[start:stop]
    column = pa.chunked_array([part, pa.array([None, '{"weight_versions":[1]}'], kind), part[:0], part])
    expected = np.flatnonzero(pc.fill_null(pc.match_substring(column, NEEDLE.decode()), False).to_numpy()).tolist()
    assert holding(column, NEEDLE) == expected and expected
    assert holding(pa.chunked_array([], kind), NEEDLE) == []
    assert holding(pa.chunked_array([pa.array([None, None], kind)]), NEEDLE) == []
