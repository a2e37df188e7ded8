"""The stored encodings (tracedb/codec): token ids and float32 streams as text, one
character per value. Each decodes to exactly what was encoded (bit for bit, the sign of
zero too), the compiled loops write and read the same text as the reference (numpy and
Python's codecs), and the SQL macros any DuckDB client uses read the same values."""

from __future__ import annotations

import duckdb
import numpy as np
import pyarrow as pa
import pytest

from tracedb import codec
from tracedb.sqltext import load_sql


def rows(values: list[list[float] | None], dtype=np.float32) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    valid = np.array([v is not None for v in values])
    lengths = [len(v) if v is not None else 0 for v in values]
    offsets = np.zeros(len(values) + 1, np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = [x for v in values if v is not None for x in v]
    return np.array(flat, dtype), offsets, valid


STREAMS = [
    [-0.0123, 0.0, -1.5, -29.3021],  # verifiers' 4 decimals, mixed signs
    [-0.0, -0.25, -3.0],  # all with the sign bit set, -0.0 among them
    [0.5, 1.0, 2.0],  # all non-negative
    [],  # empty is not null
    None,
    [0.1 * 3 + 1e-3 / 3, 0.0833333358168602],  # computed values: not fixed point
    [3.0e38, -1e-45, 123456.789],  # beyond what fixed point holds
    [float("nan"), float("inf"), -float("inf")],
]


def same_bits(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((a.view(np.uint32) == b.view(np.uint32)).all())


@pytest.mark.parametrize("compiled", [False, True])
def test_streams_round_trip_bit_for_bit(compiled, monkeypatch):
    if compiled:
        monkeypatch.setattr(codec, "KERNEL_VALUES", 0)
    values, offsets, valid = rows(STREAMS)
    text = codec.stream_text(values, offsets, valid)
    assert text.null_count == 1
    forms = [t[:1] if t is not None else None for t in text.to_pylist()]
    assert forms == ["~", "-", "+", "+", None, "=", "=", "="]
    got, got_off, got_valid = codec.stream_values(text)
    assert same_bits(got, values) and (got_off == offsets).all() and (got_valid == valid).all()


def test_the_compiled_loops_write_and_read_the_reference_text(monkeypatch):
    rng = np.random.default_rng(7)
    lists = [list(np.round(-rng.exponential(1.0, int(n)), 4)) for n in rng.integers(0, 400, 300)]
    lists[3] = list(rng.normal(size=50))  # one row of arbitrary floats
    values, offsets, valid = rows(lists)
    reference = codec.stream_text(values, offsets, valid)
    monkeypatch.setattr(codec, "KERNEL_VALUES", 0)
    assert codec.stream_text(values, offsets, valid).equals(reference)
    compiled = codec.stream_values(reference)
    monkeypatch.setattr(codec, "PARALLEL_BYTES", 0)  # rows split among threads
    threaded = codec.stream_values(reference)
    chunked = codec.stream_values(
        pa.chunked_array([reference.slice(0, 7), reference.slice(7, 200), reference.slice(207)])
    )
    tokens = codec.token_text(np.arange(5000, dtype=np.int32), np.arange(0, 5001, 50))
    assert np.array_equal(codec.token_values(tokens)[0], np.arange(5000))
    monkeypatch.undo()
    plain = codec.stream_values(reference)
    for got in (compiled, threaded, chunked):
        for a, b in zip(got, plain, strict=True):
            assert np.array_equal(a, b)
    assert same_bits(compiled[0], values)


@pytest.mark.parametrize("compiled", [False, True])
def test_token_ids_round_trip(compiled, monkeypatch):
    if compiled:
        monkeypatch.setattr(codec, "KERNEL_VALUES", 0)
    ids = np.array([0, 1, 95, 96, 127, 2047, 55_263, 55_264, 151_935, codec.UMAX, 7], np.int32)
    offsets = np.array([0, 4, 4, 11], np.int64)
    text = codec.token_text(ids, offsets)
    got, got_off, _ = codec.token_values(text)
    assert got.dtype == np.int32 and np.array_equal(got, ids) and np.array_equal(got_off, offsets)
    assert all(0x20 <= ord(ch) for t in text.to_pylist() for ch in t)  # no control character
    with pytest.raises(ValueError, match="outside"):
        codec.token_text(np.array([-1], np.int32), np.array([0, 1]))


def test_the_form_of_token_ids_follows_what_compresses():
    rng = np.random.default_rng(3)
    assert codec.token_form(rng.integers(0, 151_936, 200_000)) == "list"  # uniform ids pack better
    assert codec.token_form(rng.integers(0, 151_936, 2_000_000)) == "list"  # sampled: start, middle, end
    words = rng.zipf(1.3, 5_000) % 48_000
    assert codec.token_form(np.tile(words, 40)) == "text"  # Zipf ids, repeated spans
    assert codec.token_form(np.array([codec.UMAX + 1])) == "list"
    assert codec.token_form(np.array([-5, 3])) == "list"


def test_the_sql_macros_read_what_tracedb_writes():
    con = duckdb.connect()
    con.execute(load_sql("tables.sql"))
    con.execute(load_sql("encoded.sql"))
    values, offsets, valid = rows(STREAMS[:7])
    text = codec.stream_text(values, offsets, valid)
    ids = np.array([0, 96, 55_300, 151_935], np.int32)
    tokens = codec.token_text(ids, np.array([0, 4]))
    con.register("t", pa.table({"s": text}))
    con.register("k", pa.table({"k": tokens}))
    got = [r[0] for r in con.execute("SELECT tdb_stream(s) FROM t").fetchall()]
    for want, row in zip(STREAMS[:7], got, strict=True):
        assert row == (None if want is None else [float(np.float32(x)) for x in want])
    assert con.execute("SELECT tdb_tokens(k) FROM k").fetchall() == [(ids.tolist(),)]
    # and what the SQL writers (tracedb.writeback) store, tracedb reads
    written = con.sql("SELECT tdb_stream_text(tdb_stream(s)) FROM t").to_arrow_table().column(0)
    assert same_bits(codec.stream_values(written)[0], values)
    weights = con.sql(
        "SELECT tdb_loss_weights_text(MAP {'b': [0.5, -1.25]::FLOAT[], 'a': []::FLOAT[]}), "
        "tdb_loss_weights_text(MAP {}::MAP(VARCHAR, FLOAT[])), tdb_loss_weights_text(NULL::MAP(VARCHAR, FLOAT[]))"
    ).to_arrow_table()
    decoded = [codec.loss_weights_values(weights.column(i))[0] for i in range(3)]
    assert [(k, v.tolist()) for k, v in decoded[0]] == [("b", [0.5, -1.25]), ("a", [])]
    assert decoded[1] == [] and decoded[2] is None


def test_loss_weights_keep_their_order_and_values():
    maps = [None, {}, [("z", [0.25, -0.0]), ("a", [0.1 + 0.2])]]
    text = codec.loss_weights_text(maps)
    back = codec.loss_weights_values(text)
    assert back[0] is None and back[1] == []
    assert [k for k, _ in back[2]] == ["z", "a"]
    assert same_bits(back[2][0][1], np.array([0.25, -0.0], np.float32))
    assert same_bits(back[2][1][1], np.array([0.1 + 0.2], np.float32))


def test_stream_form_keeps_text_only_where_it_is_clearly_smaller():
    rng = np.random.default_rng(7)
    uniform = -np.round(rng.uniform(0, 3, 200_000), 4).astype(np.float32)  # a synthetic workload's
    assert codec.stream_form(uniform) == "list"
    confident = -np.round(rng.exponential(0.002, 200_000), 4).astype(np.float32)  # mostly near 0
    confident[rng.random(200_000) < 0.02] = -np.float32(12.5)
    assert codec.stream_form(confident) == "text"
    runs = np.repeat(np.round(rng.uniform(-3, 0, 200), 4), 1000).astype(np.float32)  # one value per 1,000
    assert codec.stream_form(runs) == "list"  # DuckDB keeps them run-length encoded (a value and a count)
    computed = (np.arange(50_000) / 3).astype(np.float32)  # not m / 10**d
    assert codec.stream_form(computed) == "list"
    assert codec.stream_form(np.zeros(0, np.float32)) == "list"
    text, lists = codec.stream_columns(pa.array([[0.5, -0.25], None, []], pa.list_(pa.float32())))
    assert text.null_count + lists.null_count == 4  # one column holds the rows, the other is all null
    nothing = codec.stream_columns(pa.nulls(2, pa.list_(pa.float32())))
    assert nothing[0].null_count == 2 and nothing[1].null_count == 2


def test_token_values_with_known_counts_and_with_counts_that_disagree():
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 48_000, 120_000).astype(np.int32)
    offsets = np.array([0, 1_000, 1_000, 70_000, 120_000])
    text = codec.token_text(ids, offsets)
    want = codec.token_values(text)
    assert np.array_equal(want[0], ids) and np.array_equal(want[1], offsets)
    for counts in (np.diff(offsets), np.diff(offsets) + np.array([0, 0, 5, -5])):  # n_tokens right, and not
        got = codec.token_values(text, counts)
        assert np.array_equal(got[0], ids) and np.array_equal(got[1], offsets)
