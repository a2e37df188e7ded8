"""The bad records of the rejection tests (``tests/ingest/test_rejects.py`` and
``tests/ingest/test_parse_fast_slow.py``), one :class:`Case` each.

Each bad record is a small mutation of a real verifiers record (``linear``: node 2 is a
sampled assistant turn with 28 tokens, 25 of them sampled), written between two good
lines of ``groups.traces.jsonl``.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tracedb.records import COMPACT_STREAMS

from support import FIXTURES

BASE: dict[str, Any] = json.loads((FIXTURES / "linear.traces.jsonl").read_text())
BASE_TRACE = BASE["traces"][0]["id"]
GOOD_LINES = (FIXTURES / "groups.traces.jsonl").read_text().splitlines()
GOOD = [json.loads(line) for line in GOOD_LINES]
N = 2  # the node the mutations touch
N_TOKENS = len(BASE["traces"][0]["nodes"][N]["token_ids"])
N_SAMPLED = sum(BASE["traces"][0]["nodes"][N]["mask"])
assert (N_TOKENS, N_SAMPLED) == (28, 25)


def node(e: dict[str, Any], i: int = N) -> dict[str, Any]:
    return e["traces"][0]["nodes"][i]


def set_node(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(e: dict[str, Any]) -> None:
        node(e)[key] = value

    return mutate


def set_token(i: int, value: Any, key: str = "token_ids") -> Callable[[dict[str, Any]], None]:
    def mutate(e: dict[str, Any]) -> None:
        node(e)[key][i] = value

    return mutate


@dataclass
class Case:
    id: str
    mutate: Callable[[dict[str, Any]], None] | None = None  # on a copy of BASE
    raw: bytes | None = None  # or the bad line itself
    field: str | None = None
    node: int | None = N
    trace_id: str | None = BASE_TRACE
    needles: tuple[str, ...] = ()  # must appear in the reason: the lengths / values that disagree
    layout: bool = False  # a length or graph rule (checked on parsed columns), not a type

    def line(self) -> bytes:
        if self.raw is not None:
            return self.raw
        e = copy.deepcopy(BASE)
        assert self.mutate is not None
        self.mutate(e)
        return json.dumps(e).encode()


def _drop(key: str, where: str = "node") -> Callable[[dict[str, Any]], None]:
    def mutate(e: dict[str, Any]) -> None:
        del (node(e) if where == "node" else e["traces"][0])[key]

    return mutate


def _stream_cases() -> list[Case]:
    out = []
    for name in COMPACT_STREAMS:
        for delta, label in ((1, "one_too_long"), (-1, "one_too_short")):
            k = N_SAMPLED + delta
            out.append(
                Case(
                    f"{name}_{label}",
                    set_node(name, [round(-0.01 * (j + 1), 4) for j in range(k)]),
                    field=name,
                    needles=(str(k), str(N_SAMPLED)),
                    layout=True,
                )
            )
    return out


def _mask_with_one(e: dict[str, Any]) -> None:
    assert node(e)["mask"][5] is True
    node(e)["mask"][5] = 1  # same truth value, wrong type


def _is_content_with_zero(e: dict[str, Any]) -> None:
    node(e)["is_content"] = [False] * 3 + [0] + [True] * (N_TOKENS - 4)


def _nested(key: str) -> Callable[[dict[str, Any]], None]:
    def mutate(e: dict[str, Any]) -> None:
        values = node(e)[key]
        node(e)[key] = [values[0], [values[1]], *values[2:]]  # same length, one value nested

    return mutate


def _set_trace(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(e: dict[str, Any]) -> None:
        e["traces"][0][key] = value

    return mutate


def _message_with(value: Any) -> Callable[[dict[str, Any]], None]:
    def mutate(e: dict[str, Any]) -> None:
        node(e)["message"]["x_score"] = value

    return mutate


def _literal(mutate: Callable[[dict[str, Any]], None], literal: str) -> bytes:
    """BASE changed by ``mutate`` (which writes the string ``"@@"`` once), then ``"@@"``
    replaced by ``literal`` as written (``1e400``: a number JSON allows, beyond the doubles)."""
    e = copy.deepcopy(BASE)
    mutate(e)
    text = json.dumps(e)
    assert text.count('"@@"') == 1
    return text.replace('"@@"', literal).encode()


NAN, INF = float("nan"), float("inf")
NON_FINITE: list[Case] = [
    # Free-form JSON holds no NaN or infinity either (verifiers never writes one; JSON has none):
    # rejected naming the path down to the number, on both parse paths.
    Case("metrics_nan", _set_trace("metrics", {"turns": NAN}), field="metrics.turns", node=None, needles=("finite",)),
    Case(
        "info_nested_infinity",
        _set_trace("info", {"a": [1, {"b": INF}]}),
        field="info.a.1.b",
        node=None,
        needles=("finite",),
    ),
    Case(
        "timing_minus_infinity",
        _set_trace("timing", {"agent": {"start": 0.0, "end": -INF}}),
        field="timing.agent.end",
        node=None,
        needles=("finite",),
    ),
    Case(
        "metrics_1e400",
        raw=_literal(_set_trace("metrics", {"turns": 5.0, "big": "@@"}), "1e400"),
        field="metrics.big",
        node=None,
        needles=("finite",),
    ),
    Case(
        "info_minus_1e400_in_a_list",
        raw=_literal(_set_trace("info", {"xs": [0.5, "@@"]}), "-1e400"),
        field="info.xs.1",
        node=None,
        needles=("finite",),
    ),
    Case("message_nan", _message_with(NAN), field="message.x_score", needles=("finite",)),
    Case("message_1e400", raw=_literal(_message_with("@@"), "1e400"), field="message.x_score", needles=("finite",)),
    Case("unknown_node_field_infinity", set_node("x_note", {"v": [INF]}), field="x_note.v.0", needles=("finite",)),
    Case(
        "episode_field_nan",
        lambda e: e.__setitem__("x_episode_score", NAN),
        field="x_episode_score",
        node=None,
        trace_id=None,
        needles=("finite",),
    ),
]


CASES: list[Case] = [
    # per-token layouts
    Case(
        "mask_shorter_than_token_ids",
        set_node("mask", BASE["traces"][0]["nodes"][N]["mask"][:-1]),
        field="mask",
        needles=(str(N_TOKENS - 1), str(N_TOKENS)),
        layout=True,
    ),
    Case(
        "mask_longer_than_token_ids",
        set_node("mask", BASE["traces"][0]["nodes"][N]["mask"] + [True]),
        field="mask",
        needles=(str(N_TOKENS + 1), str(N_TOKENS)),
        layout=True,
    ),
    Case(
        "is_content_wrong_length",
        set_node("is_content", [True] * (N_TOKENS - 1)),
        field="is_content",
        needles=(str(N_TOKENS - 1), str(N_TOKENS)),
        layout=True,
    ),
    *_stream_cases(),
    Case(
        "loss_weights_stream_misaligned",
        set_node("loss_weights", {"kl": [1.0] * N_TOKENS, "w": [0.5] * (N_TOKENS + 1)}),
        field="loss_weights.w",
        needles=(str(N_TOKENS + 1), str(N_TOKENS)),
        layout=True,
    ),
    Case(
        "loss_weights_stream_short",
        set_node("loss_weights", {"w": [0.5] * N_SAMPLED}),
        field="loss_weights.w",
        needles=(str(N_SAMPLED), str(N_TOKENS)),
        layout=True,
    ),
    # graph
    Case("parent_points_forward", set_node("parent", 5), field="parent", needles=("5",), layout=True),
    Case("parent_points_past_the_end", set_node("parent", 99), field="parent", needles=("99",), layout=True),
    Case("parent_points_at_itself", set_node("parent", N), field="parent", needles=(str(N),), layout=True),
    Case("parent_negative", set_node("parent", -1), field="parent", needles=("-1",)),
    Case("parent_is_a_string", set_node("parent", "1"), field="parent"),
    Case(
        "semantic_parent_forward",
        set_node("semantic_parents", [{"node": 7, "type": "compaction"}]),
        field="semantic_parents",
        needles=("7",),
        layout=True,
    ),
    Case(
        "semantic_parent_itself",
        set_node("semantic_parents", [{"node": N, "type": "x_unknown_edge"}]),
        field="semantic_parents",
        needles=(str(N),),
        layout=True,
    ),
    # types
    Case("token_id_2_pow_31", set_token(0, 2**31), field="token_ids", needles=(str(2**31),)),
    Case("token_id_below_int32", set_token(3, -(2**31) - 1), field="token_ids", needles=(str(-(2**31) - 1),)),
    Case("token_id_2_pow_64", set_token(0, 2**64), field="token_ids", needles=(str(2**64),)),
    Case("string_in_token_ids", set_token(0, "x"), field="token_ids"),
    Case("numeric_string_in_token_ids", set_token(4, "17"), field="token_ids"),
    Case("float_in_token_ids", set_token(4, 1.5), field="token_ids"),
    Case("nested_list_in_token_ids", _nested("token_ids"), field="token_ids"),
    Case("nested_list_in_logprobs", _nested("logprobs"), field="logprobs"),
    Case("nested_list_in_mask", _nested("mask"), field="mask"),
    Case("bool_list_containing_a_number", _mask_with_one, field="mask"),
    Case("is_content_containing_a_number", _is_content_with_zero, field="is_content"),
    Case("null_in_mask", set_token(0, None, key="mask"), field="mask"),
    Case("missing_message", _drop("message"), field="message"),
    Case("message_not_an_object", set_node("message", "hello"), field="message"),
    Case("trace_without_id", _drop("id", where="trace"), field="id", node=None, trace_id=None),
    # line level
    Case(
        "invalid_json",
        raw=json.dumps(BASE).encode()[:-7],
        field=None,
        node=None,
        trace_id=None,
        needles=("JSON",),
    ),
    Case("json_array_line", raw=b"[1, 2, 3]", field=None, node=None, trace_id=None, needles=("object", "list")),
    Case("json_string_line", raw=b'"traces"', field=None, node=None, trace_id=None, needles=("object",)),
    *NON_FINITE,
]
CASE_IDS = [c.id for c in CASES]
LAYOUT = [c for c in CASES if c.layout]
