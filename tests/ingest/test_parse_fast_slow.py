"""The two halves of the legacy parser agree: the fast path (simdjson) and the slow path
(``json`` + pydantic) parse every fixture line to the same columns, and the fast path
never vouches for a bad record (:mod:`support.reject_cases`) that the slow path rejects.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

import numpy as np
import pytest
import simdjson

from tracedb.errors import Location, RecordError
from tracedb.ingest.parse import Fallback, check_trace, parse_fast, parse_slow

from support.ingested import FIXTURE_FILES
from support.reject_cases import BASE, CASE_IDS, CASES, N_TOKENS, node


def _norm(x: Any) -> Any:
    """A comparable form of parsed columns: arrays keep their dtype, scalars their type."""
    if isinstance(x, np.ndarray):
        return ("ndarray", x.dtype.str, x.tolist())
    if dataclasses.is_dataclass(x):
        return {f.name: _norm(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, dict):
        return {k: _norm(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_norm(v) for v in x]
    return (type(x).__name__, x)


def _agreement_lines() -> list[tuple[str, bytes]]:
    out = []
    for f in FIXTURE_FILES:
        for i, raw in enumerate(f.read_bytes().splitlines(), 1):
            out.append((f"{f.name.split('.')[0]}:{i}", raw))
    # a bare Trace line, and a record with unknown fields, unicode and nested extras
    out.append(("bare-trace", json.dumps(BASE["traces"][0]).encode()))
    e = copy.deepcopy(BASE)
    e["x_episode"] = {"a": [1, [2]]}
    e["traces"][0]["x_trace"] = [[1], []]
    node(e)["x_node"] = {"k": [[1, 2], []], "n": None}
    node(e)["message"]["content"] = 'héllo "q" \\ ✓ 😀'
    node(e)["message"]["x_message"] = [[0]]
    node(e)["semantic_parents"] = [{"node": 1, "type": "x_custom"}]
    node(e)["advantages"] = None
    node(e)["loss_weights"] = {"w": [0.25] * N_TOKENS}
    node(e, 4)["mask"] = [True, False] * (len(node(e, 4)["token_ids"]) // 2)  # not canonical
    node(e, 4)["logprobs"] = [-0.5] * (len(node(e, 4)["token_ids"]) // 2)
    out.append(("unknown-fields", json.dumps(e, ensure_ascii=False).encode()))
    return out


AGREEMENT = _agreement_lines()


@pytest.mark.parametrize("raw", [r for _, r in AGREEMENT], ids=[n for n, _ in AGREEMENT])
def test_fast_and_slow_paths_agree(raw):
    fast = parse_fast(simdjson.Parser(), raw)
    slow = parse_slow(raw, Location("x.jsonl", 1))
    assert _norm(fast) == _norm(slow)
    for t in fast.traces:
        check_trace(t, Location("x.jsonl", 1))


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_fast_path_never_vouches_for_a_bad_line(case):
    """The fast path hands every bad line to the slow path (raises ``Fallback``), which
    reports it. A length or graph rule is checked on parsed columns by ``check_trace``
    after either path; there the fast path may parse the line, but the check must then
    fail exactly as it does on the slow path's columns."""
    raw = case.line()
    where = Location("bad.jsonl", 2)

    def slow_error() -> RecordError:
        with pytest.raises(RecordError) as info:
            line = parse_slow(raw, where)
            for t in line.traces:
                check_trace(t, where)
        return info.value

    try:
        fast = parse_fast(simdjson.Parser(), raw)
    except Fallback:
        slow_error()
        return
    assert case.layout, f"the fast path accepted a {case.id} line"
    with pytest.raises(RecordError) as info:
        for t in fast.traces:
            check_trace(t, where)
    slow = slow_error()
    assert info.value.reason == slow.reason
    assert info.value.location == slow.location
