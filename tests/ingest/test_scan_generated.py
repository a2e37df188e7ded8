"""The scanner against the legacy path on generated records (:mod:`support.strategies`
episodes with non-ASCII text, escapes, floats and unknown fields, written in several JSON
styles) and on lines a few bytes away from good records, many of them broken.

The differential contract and the harness: :mod:`support.scan_harness`; the hand-written cases:
:mod:`support.scan_cases`.
"""

from __future__ import annotations

import copy
import json
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from support.scan_cases import MUTATION_SEEDS, MUTATION_TEXT
from support.scan_harness import assert_same, unique, write
from support.strategies import episodes

# --------------------------------------------------------------------------- generated records

ROLES = ["user", "assistant", "system", "tool", "usér", "助手", "r\u00f4le\u2028"]
UNICODE = st.text(st.characters(exclude_categories=("Cs",)), max_size=6)
ASCII = st.text(st.characters(max_codepoint=127), max_size=6)


def _unknown_values(*, floats: bool) -> st.SearchStrategy[Any]:
    leaves = st.none() | st.booleans() | st.integers(-(2**40), 2**40)
    if floats:
        leaves |= st.floats(allow_nan=False, allow_infinity=False)
    return st.recursive(
        leaves,
        lambda inner: (
            st.lists(inner, max_size=3) | st.dictionaries(st.sampled_from(["a", "b", "c"]), inner, max_size=3)
        ),
        max_leaves=6,
    )


def _ascii(value: Any) -> Any:
    if isinstance(value, str):
        return "".join(c for c in value if ord(c) < 128)
    if isinstance(value, dict):
        return {_ascii(k): _ascii(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_ascii(v) for v in value]
    return value


@st.composite
def generated(draw: st.DrawFn, *, ascii_only: bool, ragged: bool = False, floats: bool = True) -> list[dict[str, Any]]:
    """Episodes of :func:`strategies.episodes` with more to them: roles, message fields
    and unknown fields (node, trace, episode) holding non-ASCII text, escapes and
    (with ``floats``) floats, and most lines without ``loss_weights`` objects so that the
    scanner takes them."""
    text = ASCII if ascii_only else UNICODE
    unknown_value = _unknown_values(floats=floats)
    eps = draw(episodes(ragged=ragged))
    for ep in eps:
        keep_weights = draw(st.integers(0, 3)) == 0
        if draw(st.booleans()):
            ep["x_" + draw(text)] = {"note": draw(text), "v": draw(unknown_value)}
        for trace in ep["traces"]:
            if draw(st.booleans()):
                trace["x_trace"] = draw(unknown_value)
            for n in trace["nodes"]:
                if not keep_weights and isinstance(n.get("loss_weights"), dict):
                    del n["loss_weights"]
                if draw(st.integers(0, 3)) == 0:
                    n["message"]["role"] = draw(st.sampled_from(ROLES))
                if draw(st.integers(0, 3)) == 0:
                    n["message"]["content"] = draw(text)
                    n["message"]["x_msg"] = draw(unknown_value)
                if draw(st.integers(0, 3)) == 0:
                    n["x_" + draw(text)] = {draw(text): draw(unknown_value)}
    return _ascii(eps) if ascii_only else eps


STYLES = {
    "compact": {"separators": (",", ":"), "ensure_ascii": False},
    "default": {},
    "spaced-unicode": {"ensure_ascii": False},
}
"""``json.dumps`` styles: compact UTF-8, Python's default (", ", ": ", \\u escapes), spaced UTF-8."""


def _escaped(text: str, style: dict[str, Any]) -> bool:
    return json.dumps(text, **style)[1:-1] != text


def _huge(value: Any) -> bool:
    """A float of decimal order 308 or more anywhere in ``value`` (the scanner leaves such
    a number to the parser: it may read as an infinity, which no record may hold)."""
    if isinstance(value, float):
        return abs(value) >= 1e308
    if isinstance(value, dict):
        return any(_huge(v) for v in value.values())
    if isinstance(value, list):
        return any(_huge(v) for v in value)
    return False


def _meant(ep: dict[str, Any], style: dict[str, Any]) -> bool:
    """Whether the scanner is meant to take the episode written in ``style``: not with a
    ``loss_weights`` object, nor with an escaped key in the episode, a trace, a node, a
    message or a link, nor with an escaped role or link type, nor with a float of order 308
    or more."""
    if any(_escaped(k, style) for k in ep) or _huge(ep):
        return False
    for trace in ep["traces"]:
        if any(_escaped(k, style) for k in trace):
            return False
        for n in trace["nodes"]:
            role = n["message"].get("role")
            links = n.get("semantic_parents") or []
            if (
                isinstance(n.get("loss_weights"), dict)
                or any(_escaped(k, style) for k in [*n, *n["message"]])
                or (isinstance(role, str) and _escaped(role, style))
                or any(_escaped(link["type"], style) for link in links)
            ):
                return False
    return True


def _relabelled(ep: dict[str, Any], tag: str) -> dict[str, Any]:
    ep = copy.deepcopy(ep)
    ep["id"] += tag
    for trace in ep["traces"]:
        trace["id"] += tag
    return ep


GENERATED = settings(
    max_examples=15,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # An example costs two ingests and shrinking a failure could take minutes: the
    # assertion names the table, row and column that differ.
    phases=[Phase.explicit, Phase.reuse, Phase.generate],
)


def _check_generated(eps: list[dict[str, Any]], styles: Sequence[str], *, allow_ragged: bool = False) -> None:
    """The episodes written in each style (ids tagged with it), one file, both ways."""
    lines, taken = [], []
    for style in styles:
        for ep in eps:
            ep = _relabelled(ep, "/" + style)
            lines.append(json.dumps(ep, **STYLES[style]) + "\n")
            taken.append(_meant(ep, STYLES[style]))
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp), "gen.traces.jsonl", "".join(lines))
        assert_same(path, taken=taken, allow_ragged=allow_ragged)


@GENERATED
@given(eps=generated(ascii_only=False))
def test_generated_records(eps: list[dict[str, Any]]) -> None:
    _check_generated(eps, list(STYLES))


@settings(GENERATED, derandomize=True)
@given(eps=generated(ascii_only=True))
def test_generated_records_ascii(eps: list[dict[str, Any]]) -> None:
    _check_generated(eps, ["compact", "default"])


@GENERATED
@given(eps=generated(ascii_only=True, ragged=True))
def test_generated_records_ragged(eps: list[dict[str, Any]]) -> None:
    _check_generated(eps, ["compact"], allow_ragged=True)


@GENERATED
@given(eps=generated(ascii_only=True, floats=False))
def test_generated_records_plain(eps: list[dict[str, Any]]) -> None:
    """ASCII text and no floats in messages or unknown fields (the text the scanner keeps
    as written then reads as plainly as it can; the other tests bring the rest)."""
    _check_generated(eps, ["compact", "spaced-unicode"])


@GENERATED
@given(eps=generated(ascii_only=True, ragged=True, floats=False))
def test_generated_records_plain_ragged(eps: list[dict[str, Any]]) -> None:
    _check_generated(eps, ["spaced-unicode"], allow_ragged=True)


@st.composite
def mutated(draw: st.DrawFn) -> bytes:
    """A seed line with one to three bytes runs deleted, inserted or replaced."""
    line = bytearray(draw(st.sampled_from(MUTATION_SEEDS)))
    for _ in range(draw(st.integers(1, 3))):
        i = draw(st.integers(0, len(line)))
        j = min(len(line), i + draw(st.integers(1, 4)))
        kind = draw(st.sampled_from(["delete", "insert", "replace"]))
        if kind == "delete":
            del line[i:j]
        else:
            line[i : i if kind == "insert" else j] = draw(st.sampled_from(MUTATION_TEXT))
    return bytes(line).replace(b"\n", b" ")


@settings(GENERATED, max_examples=10, derandomize=True)
@given(lines=st.lists(mutated(), min_size=1, max_size=40))
def test_mutated_lines(lines: list[bytes]) -> None:
    """Lines a few bytes away from good records, many of them broken, in one file."""
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp), "m.traces.jsonl", b"".join(unique(line, k) + b"\n" for k, line in enumerate(lines)))
        assert_same(path)
