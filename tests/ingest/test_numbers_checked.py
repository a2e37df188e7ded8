"""``records.NUMBERS_CHECKED``: the scanned path validates a line's metadata without walking
its free-form JSON for NaN and infinities again, which holds only because the scanner
never takes a line holding one (the parser rejects it naming the path)."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest

from tracedb import records
from tracedb.ingest import scanned
from tracedb.ingest.files import Chunk

NON_FINITE_META = [
    ',"info":{"a":[1,{"b":NaN}]}',
    ',"metrics":{"turns":Infinity}',
    ',"timing":{"end":-1.5e400}',
    ',"x_extra":0.1e310',
    ',"rewards":{"r":{"score":1e999}}',
]


def _line(trace_extra: str) -> bytes:
    node = '{"message":{"role":"user","content":"hi"},"token_ids":[1,2],"mask":[false,true],"logprobs":[-0.5]}'
    return ('{"id":"ep","traces":[{"id":"tr","nodes":[' + node + "]" + trace_extra + "}]}").encode()


@pytest.mark.parametrize("extra", NON_FINITE_META)
def test_the_scanner_never_takes_a_non_finite_number(extra):
    data = _line(extra) + b"\n"
    chunk = Chunk(data, np.zeros(1, np.int64), np.array([len(data) - 1], np.int64), np.ones(1, np.int64))
    _, lines = scanned.scan_chunk(chunk)
    assert lines == [None]  # the parser's to word
    finite = _line(',"info":{"a":[1,{"b":0.5}]}') + b"\n"
    ok = Chunk(finite, np.zeros(1, np.int64), np.array([len(finite) - 1], np.int64), np.ones(1, np.int64))
    assert scanned.scan_chunk(ok)[1][0] is not None


@pytest.mark.parametrize(
    "trace",
    [
        {"id": "t", "info": {"a": [1, {"b": float("nan")}]}},
        {"id": "t", "x_extra": float("inf")},
        {"id": "t", "nodes": [{"message": {"role": "user", "n": float("-inf")}}]},
    ],
)
def test_only_the_checked_context_skips_the_walk(trace):
    with pytest.raises(pydantic.ValidationError, match="finite"):
        records.Trace.model_validate(trace)
    records.Trace.model_validate(trace, context=records.NUMBERS_CHECKED)
    with pytest.raises(pydantic.ValidationError, match="finite"):
        records.Trace.model_validate(trace, context={"numbers_finite": "yes"})  # only the flag itself
