"""The scanner against the legacy path on the fixture files and on hand-written lines:
adversarial lines, ragged streams (``allow_ragged``), ``strict``, records already
ingested, number texts and token ids. Each ends the same way on both paths and, where a
case says how, as it means.

The differential contract and the harness: :mod:`support.scan_harness`; the hand-written cases:
:mod:`support.scan_cases`.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from support.scan_cases import (
    ADVERSARIAL,
    BEYOND_DOUBLE,
    CHUNK,
    FIXTURE_FILES,
    FULL,
    GOOD_BARE,
    GOOD_EPISODE,
    NUMBER_TEXTS,
    RAGGED,
    TOKEN_TEXTS,
    USER,
    Case,
    around,
    episode,
    node,
)
from support.scan_harness import Batch, assert_same, check_outcome, meant_taken, scanned, write

# --------------------------------------------------------------------------- fixtures


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name.split(".")[0])
def test_fixture_file(path: Path) -> None:
    fast, _ = assert_same(path, taken=meant_taken(path.read_bytes()))
    assert fast.report is not None and fast.report["traces"] and not fast.report["rejected"]


# --------------------------------------------------------------------------- lines by hand


SHARED = [c for c in ADVERSARIAL if not c.alone]
ALONE = [c for c in ADVERSARIAL if c.alone]


@pytest.fixture(scope="module")
def adversarial(tmp_path_factory: pytest.TempPathFactory) -> Batch:
    path = tmp_path_factory.mktemp("adversarial") / "adversarial.traces.jsonl"
    return Batch.ingest(path, {c.id: c.line for c in SHARED})


@pytest.mark.parametrize("c", SHARED, ids=[c.id for c in SHARED])
def test_adversarial_line(adversarial: Batch, c: Case) -> None:
    """Rejected or accepted, each line ends the same way on both paths (a reject's file,
    line, trace id, node, field and reason included), and as the case means."""
    fast, _ = adversarial.assert_same(c.id, bool(c.taken))
    check_outcome(fast, c.outcome, adversarial.numbers[c.id])


def test_adversarial_file(adversarial: Batch) -> None:
    """All of the lines above in one file: the report's counts and the segments too."""
    adversarial.assert_whole_file_same()


@pytest.mark.parametrize("c", ALONE, ids=[c.id for c in ALONE])
def test_adversarial_line_alone(tmp_path: Path, c: Case) -> None:
    """A line that may make an ingest raise or the whole chunk fall back, between two
    good lines in a file of its own."""
    want = [False] * 4 if c.taken == CHUNK else [True, False, bool(c.taken), True]
    fast, _ = assert_same(write(tmp_path, "x.traces.jsonl", around(c.line)), taken=want)
    ids = {r["trace_id"] for r in fast.tables["traces"] if r["line"] == 3}
    check_outcome(fast.line(3, ids), c.outcome)


@pytest.fixture(scope="module")
def ragged(tmp_path_factory: pytest.TempPathFactory) -> tuple[Batch, Batch]:
    """The ragged cases ingested with and without ``allow_ragged``."""
    cases = {c.id: c.line for c in RAGGED}
    directory = tmp_path_factory.mktemp("ragged")
    return (
        Batch.ingest(directory / "ragged.traces.jsonl", cases, allow_ragged=True),
        Batch.ingest(directory / "exact.traces.jsonl", cases),
    )


@pytest.mark.parametrize("case_id, taken", [(c.id, c.taken) for c in RAGGED], ids=[c.id for c in RAGGED])
def test_allow_ragged(ragged: tuple[Batch, Batch], case_id: str, taken: bool) -> None:
    with_ragged, exact = ragged
    with_ragged.assert_same(case_id, taken)
    exact.assert_same(case_id, False)  # a ragged stream breaks the rule: the legacy path words it


def test_allow_ragged_files(ragged: tuple[Batch, Batch]) -> None:
    for batch in ragged:
        batch.assert_whole_file_same()


@pytest.mark.parametrize(
    "lines, allow_ragged",
    [
        pytest.param([GOOD_EPISODE.encode(), GOOD_BARE.encode()], False, id="all-good"),
        pytest.param([GOOD_EPISODE.encode(), b"{}", GOOD_BARE.encode()], False, id="invalid-record"),
        pytest.param([GOOD_EPISODE.encode(), episode(USER, node(',"parent":1'))], False, id="graph-rule"),
        pytest.param([episode(node(',"token_ids":[2147483648],"mask":[true]'))], False, id="int32"),
        pytest.param([GOOD_EPISODE.encode(), FULL + b"x"], True, id="trailing-garbage-ragged"),
        pytest.param([episode(node(',"token_ids":[1],"mask":[true],"logprobs":[1,2]'))], False, id="ragged-exact"),
        pytest.param([episode(node(',"token_ids":[1],"mask":[true],"logprobs":[1,2]'))], True, id="ragged-allowed"),
    ],
)
def test_strict(tmp_path: Path, lines: list[bytes], allow_ragged: bool) -> None:
    """strict=True: the first reject aborts the ingest with the same error both ways."""
    path = write(tmp_path, "x.traces.jsonl", b"\n".join(lines) + b"\n")
    fast, _ = assert_same(path, strict=True, allow_ragged=allow_ragged)
    if fast.error is None:
        assert fast.report is not None and not fast.report["rejected"]
    else:
        assert fast.error[0] == "IngestAborted" and not fast.tables["traces"]


def test_same_records_again(tmp_path: Path) -> None:
    """Records already ingested (earlier in the file, or the same file again) are
    skipped the same way."""
    lines = [FULL, GOOD_BARE.encode(), FULL, GOOD_EPISODE.encode(), GOOD_BARE.encode()]
    path = write(tmp_path, "x.traces.jsonl", b"\n".join(lines) + b"\n")
    fast, _ = assert_same([path, path], taken=None)
    assert fast.report is not None and fast.report["skipped"] == 7 and fast.report["traces"] == 3
    assert scanned(path) == [True] * 5


# --------------------------------------------------------------------------- numbers


def _number_line(text: str) -> bytes:
    """One trace whose timestamp, compact streams and a metadata field hold the number
    ``text`` as written."""
    template = (
        '{"id":"ep-num","traces":[{"id":"tr-num","score":<t>,"nodes":[{"message":{"role":"assistant"},"sampled":true,'
        '"timestamp":<t>,"token_ids":[1,2],"mask":[true,true],"logprobs":[<t>,0.5],"advantages":[-1,<t>],'
        '"reference_logprobs":[<t>,1],"trainer_logprobs":[2,<t>],"entropies":[<t>,<t>]}]}]}'
    )
    return template.replace("<t>", text).encode()


def _bits32(values: list[float] | None) -> list[int] | None:
    if values is None:
        return None
    with np.errstate(over="ignore"):
        return np.array(values, dtype=np.float64).astype(np.float32).view(np.uint32).tolist()


def _fits32(value: float) -> bool:
    """``value`` is a float32 once rounded (not beyond its range)."""
    with np.errstate(over="ignore"):
        return bool(np.isfinite(np.float32(value)))


def json_float(text: str) -> float:
    """The JSON number ``text`` as a double: ``float(json.loads(text))``, so that the
    integer ``-0`` is +0.0 while ``-0.0`` is -0.0 (an integer beyond the doubles: inf)."""
    value = json.loads(text)
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def _check_number(text: str, fast: dict[str, Any], slow: dict[str, Any]) -> None:
    """The stored values are ``np.float32(float(json.loads(text)))`` (``float(json.loads(text))``
    for the timestamp) to the bit, on both paths (unless both reject the line)."""
    value = json_float(text)
    want = {
        "logprobs": [value, 0.5],
        "advantages": [-1.0, value],
        "reference_logprobs": [value, 1.0],
        "trainer_logprobs": [2.0, value],
        "entropies": [value, value],
    }
    for side in (fast, slow):
        if side["report rejected"]:  # a stream value beyond float32 is rejected (the timestamp, beyond double)
            assert not _fits32(value), side["report rejected"]
            continue
        (row,) = side["nodes"]
        assert struct.pack("<d", row["timestamp"]) == struct.pack("<d", value)
        for name, values in want.items():
            assert _bits32(row[name]) == _bits32(values), name


def _ids(texts: Sequence[str]) -> list[str]:
    return [t if len(t) < 40 else t[:20] + "..." + t[-10:] for t in texts]


@pytest.fixture(scope="module")
def numbers(tmp_path_factory: pytest.TempPathFactory) -> Batch:
    path = tmp_path_factory.mktemp("numbers") / "numbers.traces.jsonl"
    return Batch.ingest(path, {text: _number_line(text) for text in NUMBER_TEXTS})


@pytest.mark.parametrize("text", NUMBER_TEXTS, ids=_ids(NUMBER_TEXTS))
def test_number(numbers: Batch, text: str) -> None:
    # The scanner takes every number it reads exactly; a value beyond the float32 range
    # sends its line (only) to the parser, which rejects it naming the position.
    fast, slow = numbers.assert_same(text, _fits32(json_float(text)))
    _check_number(text, fast, slow)


def test_numbers_file(numbers: Batch) -> None:
    numbers.assert_whole_file_same()


@pytest.mark.parametrize("text", BEYOND_DOUBLE, ids=_ids(BEYOND_DOUBLE))
def test_number_beyond_double(tmp_path: Path, text: str) -> None:
    fast, slow = assert_same(write(tmp_path, "n.traces.jsonl", _number_line(text) + b"\n"), taken=[False])
    ids = {r["trace_id"] for r in fast.tables["traces"]}
    _check_number(text, fast.line(1, ids), slow.line(1, ids))


@pytest.fixture(scope="module")
def tokens(tmp_path_factory: pytest.TempPathFactory) -> Batch:
    path = tmp_path_factory.mktemp("tokens") / "tokens.traces.jsonl"
    lines = {
        text: episode(node(',"sampled":true,"token_ids":[7,' + text + '],"mask":[false,true],"logprobs":[-1.0]'))
        for text, _ in TOKEN_TEXTS
    }
    return Batch.ingest(path, lines)


@pytest.mark.parametrize("text, taken", TOKEN_TEXTS, ids=[t for t, _ in TOKEN_TEXTS])
def test_token_id(tokens: Batch, text: str, taken: bool) -> None:
    fast, _ = tokens.assert_same(text, taken)
    if taken:
        segment_id = fast["nodes"][0]["segment_id"]
        (segment,) = [s for s in tokens.fast.tables["segments"] if s["segment_id"] == segment_id]
        assert segment["token_ids"] == [7, int(text)]


def test_tokens_file(tokens: Batch) -> None:
    tokens.assert_whole_file_same()
