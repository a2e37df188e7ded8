"""Differential tests of ingest's two parse paths.

:func:`tracedb.ingest.ingest_files` scans whole chunks with the compiled scanner
(:mod:`tracedb.ingest._scan` through :func:`tracedb.ingest.scanned.scan_chunk`) and sends every line the
scanner does not take through the legacy parser (:func:`tracedb.ingest.parse.parse_line`:
simdjson, then ``json`` + pydantic). The contract: for every input, ingest with the
scanner leaves exactly the database content and the report (rejects and their wording
included) that ingest with the legacy path alone leaves.

Each test ingests the same file twice into fresh ``:memory:`` databases, once as it is
and once with the ``scanner`` setting ``never``, which sends every line
the legacy way, and compares every table (rows in key order, the ingest's clock columns
left out, floats by their bits so that -0.0 is not 0.0), the report and ``db.trace`` of
every trace. Two columns are compared by value, not by text: ``nodes.message`` and
``nodes.extra`` hold JSON text whose form is not part of the contract (the scanner keeps
the message and the unknown fields as written, minified; the legacy path writes them
again), so both sides are read with ``json.loads`` and compared as values (floats by
their bits, keys in their order). Where a test means the scanner to take a line, or not, it checks which
lines :func:`~tracedb.ingest.scanned.scan_chunk` took: a case cannot pass only because every
line fell back.

Hand-written cases share files to keep the module fast: a :class:`Batch` writes many
cases as the lines of one file (each with ids of its own), ingests it once each way, and
each case compares what came of its line (its rejects, episode, traces, their nodes,
branches and records); one more test compares the whole file. Cases that may make an
ingest raise, or make the whole chunk fall back, get a file of their own. A case may also
say how its line is meant to end (accepted, or rejected with a reason and a location),
which is checked on top of the two paths agreeing.
"""

from __future__ import annotations

import contextlib
import copy
import json
import math
import re
import struct
import subprocess
import sys
import tempfile
import textwrap
from collections.abc import Sequence
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import zstandard
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import tracedb
from tracedb import runtime
from tracedb.ingest import read_lines
from tracedb.ingest.files import Chunk, read_chunks
from tracedb.ingest.scanned import Scanner, scan_chunk

from support import FIXTURES, REPO
from support.strategies import episodes

FIXTURE_FILES = sorted(FIXTURES.glob("*.traces.jsonl"))

TABLES = {
    "episodes": "episode_id",
    "traces": "trace_id",
    "nodes": "trace_id, node_index",
    "branches": "trace_id, branch_index",
    "segments": "segment_id",
    "rejects": "source, line, trace_id, node, field, reason",
}
"""Every table ingest writes, with the key that orders its rows."""
CLOCK_COLUMNS = {"ingested_at", "rejected_at"}
"""Columns that hold the time of the ingest: never equal between two runs."""
JSON_COLUMNS = {"nodes": ("message", "extra")}
"""JSON text columns whose text form is not part of the contract (the scanner keeps the
text as written, minified; the legacy path writes the value again): compared by value."""


# --------------------------------------------------------------------------- harness


@dataclass(frozen=True)
class _Key:
    name: Any


def canon(value: Any) -> list[tuple[str, Any]]:
    """A flat, comparable form of a nested value, built without recursion (records may
    nest deeper than Python's recursion limit): floats by their bits (-0.0 is not 0.0,
    NaN equals NaN), containers by kind and size, dict keys in their order."""
    out: list[tuple[str, Any]] = []
    stack = [value]
    while stack:
        x = stack.pop()
        if isinstance(x, _Key):
            out.append(("key", x.name))
        elif isinstance(x, float):
            out.append(("float", struct.pack("<d", x).hex()))
        elif isinstance(x, dict):
            out.append(("dict", len(x)))
            for k, v in reversed(list(x.items())):
                stack.append(v)
                stack.append(_Key(k))
        elif isinstance(x, (list, tuple)):
            out.append((type(x).__name__, len(x)))
            stack.extend(reversed(x))
        else:
            out.append((type(x).__name__, x))
    return out


def json_value(text: str | None) -> Any:
    """A JSON text column's value, as compared: None stays None; else ``("json", value)``
    (read by ``json.loads``; :func:`canon` then compares floats by their bits), or
    ``("not JSON", error, text)`` when it cannot be read."""
    if text is None:
        return None
    try:
        return ("json", json.loads(text))
    except (ValueError, RecursionError) as e:
        return ("not JSON", type(e).__name__, text)


def _error(e: BaseException) -> tuple[str, str]:
    # Python words a RecursionError by where it struck (decoding or encoding JSON), which
    # is not part of the contract: only its type is compared.
    return (type(e).__name__, "" if isinstance(e, RecursionError) else str(e))


@dataclass
class Outcome:
    """What one ingest did: its error or report, the tables, ``db.trace`` per trace."""

    error: tuple[str, str] | None
    report: dict[str, Any] | None
    tables: dict[str, list[dict[str, Any]]]
    records: dict[str, Any] = field(default_factory=dict)

    def whole(self) -> dict[str, Any]:
        report = None if self.report is None else {k: v for k, v in self.report.items() if k != "rejected"}
        return {
            "ingest error": self.error,
            "report": report,
            "report rejected": None if self.report is None else self.report["rejected"],
            **self.tables,
            "db.trace": self.records,
        }

    def line(self, number: int, trace_ids: set[str]) -> dict[str, Any]:
        """What came of one line of the file: its rejects, episode and traces (by line
        number), the nodes, branches and records of ``trace_ids``."""
        t = self.tables
        return {
            "ingest error": self.error,
            "report rejected": [r for r in (self.report or {}).get("rejected", []) if r["line"] == number],
            "episodes": [r for r in t["episodes"] if r["line"] == number],
            "traces": [r for r in t["traces"] if r["line"] == number],
            "nodes": [r for r in t["nodes"] if r["trace_id"] in trace_ids],
            "branches": [r for r in t["branches"] if r["trace_id"] in trace_ids],
            "rejects": [r for r in t["rejects"] if r["line"] == number],
            "db.trace": {k: v for k, v in self.records.items() if k in trace_ids},
        }


def run_ingest(paths: Path | Sequence[Path], *, legacy: bool, **kwargs: Any) -> Outcome:
    """Ingest into a fresh in-memory database, with the scanner or the legacy path only."""
    with contextlib.ExitStack() as stack:
        if legacy:
            stack.enter_context(runtime.configure(scanner="never"))
        db = stack.enter_context(tracedb.connect(":memory:"))
        error = report = None
        try:
            result = db.ingest(paths, **kwargs)
        except Exception as e:
            error = _error(e)
        else:
            report = result.to_dict()
            report.pop("seconds")
        tables = {}
        for table, order in TABLES.items():
            columns = [c for c in db.sql(f"SELECT * FROM {table} LIMIT 0").column_names if c not in CLOCK_COLUMNS]
            rows = db.sql(f"SELECT {', '.join(columns)} FROM {table} ORDER BY {order}").to_pylist()
            for row in rows:
                for column in JSON_COLUMNS.get(table, ()):
                    row[column] = json_value(row[column])
            tables[table] = rows
        records: dict[str, Any] = {}
        for (trace_id,) in db.con.execute("SELECT trace_id FROM traces ORDER BY trace_id").fetchall():
            try:
                records[trace_id] = db.trace(trace_id)
            except Exception as e:
                records[trace_id] = ("db.trace raised", *_error(e))
        return Outcome(error, report, tables, records)


def _show(value: Any, limit: int = 300) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


ROW_KEYS = {
    "report rejected": ("file", "line"),
    "episodes": ("episode_id",),
    "traces": ("trace_id",),
    "nodes": ("trace_id", "node_index"),
    "branches": ("trace_id", "branch_index"),
    "segments": ("segment_id",),
    "rejects": ("source", "line"),
}
"""The columns that name a row, to pair the rows of the two sides."""


def _paired(name: str, a: list[Any], b: list[Any]) -> tuple[list[str], list[tuple[Any, Any, Any]]]:
    """(rows of one side only, (row name, scanner row, legacy row) of both sides)."""
    columns = ROW_KEYS.get(name)
    rows = [*a, *b]
    if columns and all(isinstance(r, dict) for r in rows):
        ka = {tuple(r[c] for c in columns): r for r in a}
        kb = {tuple(r[c] for c in columns): r for r in b}
        if len(ka) == len(a) and len(kb) == len(b):
            only = [f"{name}: only the scanner has {k}" for k in ka if k not in kb]
            only += [f"{name}: only the legacy path has {k}" for k in kb if k not in ka]
            return only, [(k, ka[k], kb[k]) for k in ka if k in kb]
    only = [f"{name}: scanner has {len(a)} rows, legacy {len(b)}"] if len(a) != len(b) else []
    return only, [(f"row {i}", x, y) for i, (x, y) in enumerate(zip(a, b))]


def differences(fast: dict[str, Any], slow: dict[str, Any]) -> list[str]:
    """How the scanner's side differs from the legacy side, part by part (empty: not)."""
    out = []
    for name, a in fast.items():
        b = slow[name]
        if canon(a) == canon(b):
            continue
        if isinstance(a, list) and isinstance(b, list):
            only, pairs = _paired(name, a, b)
            out += only[:6]
            rows = [(k, x, y) for k, x, y in pairs if canon(x) != canon(y)]
            for k, x, y in rows[:4]:
                if isinstance(x, dict) and isinstance(y, dict):
                    out += [
                        f"{name} {k} {c}: scanner {_show(x[c])}, legacy {_show(y.get(c))}"
                        for c in x
                        if canon(x[c]) != canon(y.get(c))
                    ]
                else:
                    out.append(f"{name} {k}: scanner {_show(x)}, legacy {_show(y)}")
        elif isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=str):
                u, v = canon(a.get(k)), canon(b.get(k))
                if u == v:
                    continue
                if len(_show(a.get(k), 10**6)) + len(_show(b.get(k), 10**6)) < 400:
                    out.append(f"{name}[{k!r}]: scanner {_show(a.get(k))}, legacy {_show(b.get(k))}")
                else:
                    at = next((i for i, (p, q) in enumerate(zip(u, v)) if p != q), min(len(u), len(v)))
                    out.append(f"{name}[{k!r}] from item {at}: scanner {_show(u[at : at + 4])}, legacy {_show(v[at : at + 4])}")  # fmt: skip  # noqa: E501
        else:
            out.append(f"{name}: scanner {_show(a)}, legacy {_show(b)}")
    return out


def _assert_no_differences(fast: dict[str, Any], slow: dict[str, Any], what: str = "") -> None:
    problems = differences(fast, slow)
    if problems:
        raise AssertionError(f"the scanner path differs from the legacy path{what}:\n  " + "\n  ".join(problems))


def scanned(path: Path, *, allow_ragged: bool = False) -> list[bool] | tuple[str, str]:
    """Per line of the file (blank lines too): did the scanner take it? One Scanner for
    the whole file, as ingest has. The error instead when the scan raised."""
    scanner = Scanner()
    out: list[bool] = []
    try:
        for chunk in read_chunks(path):
            _, parsed = scan_chunk(chunk, scanner, allow_ragged=allow_ragged)
            out += [p is not None for p in parsed]
    except Exception as e:
        return _error(e)
    return out


def assert_same(
    paths: Path | Sequence[Path], *, taken: Sequence[bool] | None = None, **kwargs: Any
) -> tuple[Outcome, Outcome]:
    """Ingest ``paths`` both ways and assert the same outcome; with ``taken`` (``paths``
    one file), also which of its lines the scanner takes."""
    fast = run_ingest(paths, legacy=False, **kwargs)
    slow = run_ingest(paths, legacy=True, **kwargs)
    _assert_no_differences(fast.whole(), slow.whole())
    if taken is not None:
        assert isinstance(paths, Path)
        got = scanned(paths, allow_ragged=kwargs.get("allow_ragged", False))
        assert got == list(taken), f"lines taken by the scanner: {got}, meant {list(taken)}"
    return fast, slow


def unique(line: bytes, k: int) -> bytes:
    """The line with its ids ``ep-*`` and ``tr-*`` made ``ep<k>-*``, ``tr<k>-*``."""
    tag = str(k).encode()
    return line.replace(b'"ep-', b'"ep' + tag + b"-").replace(b'"tr-', b'"tr' + tag + b"-")


@dataclass
class Batch:
    """Cases as the lines of one file (ids made unique per line), ingested once each way."""

    path: Path
    numbers: dict[str, int]
    fast: Outcome
    slow: Outcome
    taken: list[bool] | tuple[str, str]

    @classmethod
    def ingest(cls, path: Path, cases: dict[str, bytes], **kwargs: Any) -> Batch:
        numbers = {case_id: k + 1 for k, case_id in enumerate(cases)}
        path.write_bytes(b"".join(unique(line, k + 1) + b"\n" for k, line in enumerate(cases.values())))
        fast = run_ingest(path, legacy=False, **kwargs)
        slow = run_ingest(path, legacy=True, **kwargs)
        return cls(path, numbers, fast, slow, scanned(path, allow_ragged=kwargs.get("allow_ragged", False)))

    def assert_same(self, case_id: str, taken: bool | None = None) -> tuple[dict[str, Any], dict[str, Any]]:
        """Assert the same outcome for the case's line (and whether the scanner took it)."""
        number = self.numbers[case_id]
        assert self.slow.error is None, f"the legacy ingest of {self.path.name} raised {self.slow.error}"
        ids = {r["trace_id"] for o in (self.fast, self.slow) for r in o.tables["traces"] if r["line"] == number}
        fast, slow = self.fast.line(number, ids), self.slow.line(number, ids)
        _assert_no_differences(fast, slow, f" on line {number} of {self.path.name} ({case_id})")
        if taken is not None:
            assert not isinstance(self.taken, tuple), f"the scan raised {self.taken}"
            assert self.taken[number - 1] == taken, f"the scanner took line {number}: {self.taken[number - 1]}"
        return fast, slow

    def assert_whole_file_same(self) -> None:
        _assert_no_differences(self.fast.whole(), self.slow.whole(), f" for the whole of {self.path.name}")


def write(directory: Path, name: str, data: bytes | str) -> Path:
    path = directory / name
    path.write_bytes(data.encode() if isinstance(data, str) else data)
    return path


def meant_taken(data: bytes) -> list[bool]:
    """Per line of well-formed verifiers records: taken unless blank or holding a
    ``loss_weights`` object (the scanner leaves those to the legacy path)."""
    lines = data.split(b"\n")
    if data.endswith(b"\n"):
        lines.pop()
    return [bool(line.strip()) and b'"loss_weights":{' not in line for line in lines]


def compact(value: Any, **kwargs: Any) -> str:
    return json.dumps(value, separators=(",", ":"), **kwargs)


# --------------------------------------------------------------------------- fixtures


def _lines(path: Path) -> list[bytes]:
    return [line for line in path.read_bytes().splitlines() if line.strip()]


@pytest.mark.parametrize("path", FIXTURE_FILES, ids=lambda p: p.name.split(".")[0])
def test_fixture_file(path: Path) -> None:
    fast, _ = assert_same(path, taken=meant_taken(path.read_bytes()))
    assert fast.report is not None and fast.report["traces"] and not fast.report["rejected"]


FIRST_LINES = [_lines(path)[0] for path in FIXTURE_FILES]
"""The first line of every fixture (the whole files are ingested above)."""
WHITESPACE_LINES = [b"", b"   ", b"\t", b"\r", b" \x0b ", b"\x0c", b" \t\r ", b"\x0b\x0c"]


def _fixture_variant(variant: str) -> tuple[str, bytes]:
    """(file name, bytes) of the fixture lines written another way."""
    lines = FIRST_LINES
    if variant == "crlf":
        data = b"".join(line + b"\r\n" for line in lines)
    elif variant == "whitespace-lines":
        parts = [WHITESPACE_LINES[0]]
        for i, line in enumerate(lines):
            parts += [line, WHITESPACE_LINES[(i + 1) % len(WHITESPACE_LINES)]]
        data = b"\n".join(parts) + b"\n"
    elif variant == "no-final-newline":
        data = b"\n".join(lines)
    elif variant == "zst":
        data = b"\n".join(lines) + b"\n"
    elif variant == "zst-crlf-whitespace-no-final-newline":
        data = b"\r\n \x0c\r\n\r\n".join(lines)
    else:
        raise AssertionError(variant)
    return ("all.traces.jsonl.zst" if variant.startswith("zst") else "all.traces.jsonl"), data


@pytest.mark.parametrize(
    "variant", ["crlf", "whitespace-lines", "no-final-newline", "zst", "zst-crlf-whitespace-no-final-newline"]
)
def test_fixture_lines_written_otherwise(tmp_path: Path, variant: str) -> None:
    name, data = _fixture_variant(variant)
    raw = zstandard.ZstdCompressor().compress(data) if name.endswith(".zst") else data
    fast, _ = assert_same(write(tmp_path, name, raw), taken=meant_taken(data))
    assert fast.report is not None and fast.report["traces"] > 0 and not fast.report["rejected"]


def test_fixture_traces_pretty_printed_as_json_files(tmp_path: Path) -> None:
    """The first trace of every fixture as a bare Trace in a ``.json`` file, indent=2."""
    paths = []
    for path, line in zip(FIXTURE_FILES, FIRST_LINES):
        trace = json.loads(line)["traces"][0]
        out = write(tmp_path, path.name.split(".")[0] + ".json", json.dumps(trace, indent=2) + "\n")
        want = [not any(isinstance(n.get("loss_weights"), dict) for n in trace["nodes"])]
        assert scanned(out) == want, out.name
        paths.append(out)
    fast, _ = assert_same(paths)
    assert fast.report is not None and fast.report["traces"] == len(paths) and not fast.report["rejected"]


# --------------------------------------------------------------------------- lines by hand

GOOD_EPISODE = compact(
    {
        "id": "ep-good",
        "group": {"id": "g"},
        "traces": [
            {
                "id": "tr-good",
                "nodes": [
                    {"message": {"role": "user", "content": "hi"}, "token_ids": [1, 2], "mask": [False, False]},
                    {
                        "parent": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "sampled": True,
                        "timestamp": 1.5,
                        "token_ids": [3, 4],
                        "mask": [True, True],
                        "logprobs": [-0.5, -0.25],
                    },
                ],
            }
        ],
    }
)
GOOD_BARE = compact({"id": "tr-bare", "nodes": [{"message": {"role": "system"}, "token_ids": [9], "mask": [False]}]})

USER = '{"message":{"role":"user","content":"q"},"token_ids":[1,2],"mask":[false,false]}'
"""Node 0 of the hand-written lines."""
REPLY = '{"parent":0,"message":{"role":"assistant","content":"a"},"sampled":true,"token_ids":[3],"mask":[true],"logprobs":[-0.5]}'  # noqa: E501
"""Node 1 of the hand-written lines."""


def episode(*nodes: str, episode_extra: str = "", trace_extra: str = "") -> bytes:
    """An episode line ``ep-x`` with one trace ``tr-x`` of the node texts given."""
    text = '{"id":"ep-x"' + episode_extra + ',"traces":[{"id":"tr-x"' + trace_extra + ',"nodes":[' + ",".join(nodes)
    return (text + "]}]}").encode()


def node(body: str) -> str:
    """A node with a plain message and ``body`` (more fields, comma-led when not empty)."""
    return '{"message":{"role":"user"}' + body + "}"


FULL = episode(USER, REPLY)


def user_in(template: str) -> str:
    """The template with :data:`USER` in place of ``<U>``."""
    return template.replace("<U>", USER)


def nest(depth: int, leaf: str = "0") -> str:
    return "[" * depth + leaf + "]" * depth


def around(line: bytes) -> bytes:
    """The line as line 3 of a file: a good episode, a blank line before it, a good
    bare trace after it."""
    return b"\n".join([GOOD_EPISODE.encode(), b"", line, GOOD_BARE.encode()]) + b"\n"


CHUNK = "chunk"
"""``taken`` of a case whose bytes make the whole chunk fall back (text that is not UTF-8
in a column the block validates): no line of the file is taken."""


ANY: Any = "<any>"
"""A part of a reject that a case leaves unchecked."""


class Rejected(NamedTuple):
    """The one reject meant for a case's line: a regex its reason matches (re.search),
    its field, node and trace id (an id as the line writes it: ``tr-x``, not ``tr<k>-x``)."""

    reason: str
    field: str | None = ANY
    node: int | None = ANY
    trace: str | None = ANY


ACCEPTED = "accepted"
"""``outcome`` of a case whose line is meant to be ingested: no reject, its records
stored, ``db.trace`` reads each of its traces."""
SURROGATE = "lone UTF-16 surrogate"
"""What the reason of a reject for a lone surrogate says."""
TOO_DEEP = "^nested too deeply"
"""How the reason of a reject for a value Python's ``json`` cannot read begins."""


class Case(NamedTuple):
    id: str
    line: bytes
    taken: bool | str
    alone: bool
    outcome: Rejected | str | None


def case(
    id: str,
    line: bytes | str,
    taken: bool | str = False,
    *,
    alone: bool = False,
    outcome: Rejected | str | None = None,
) -> Case:
    """A line, whether the scanner is meant to take it, whether it needs a file of its
    own, and (when the case says) how it is meant to end: :data:`ACCEPTED` or
    :class:`Rejected` (else only the same way on both paths)."""
    return Case(id, line.encode() if isinstance(line, str) else line, taken, alone or taken == CHUNK, outcome)


def _tagged(name: str | None, k: int | None) -> str | None:
    """An id as :func:`unique` writes it on line ``k`` of a batch (None: as written)."""
    if name is None or k is None:
        return name
    return unique(json.dumps(name).encode(), k).decode()[1:-1]


def check_outcome(got: dict[str, Any], outcome: Rejected | str | None, k: int | None = None) -> None:
    """What came of a line (:meth:`Outcome.line`) ends as the case means; ``k``: the
    line's number in a :class:`Batch` (its ids tagged), None for a file of its own."""
    if outcome is None:
        return
    assert got["ingest error"] is None, f"the ingest raised {got['ingest error']}"
    rejected = got["report rejected"]
    if outcome == ACCEPTED:
        assert not rejected, rejected
        assert got["episodes"] or got["traces"], "nothing stored"
        failed = {k: v for k, v in got["db.trace"].items() if isinstance(v, tuple) and v[:1] == ("db.trace raised",)}
        assert not failed, failed
        return
    assert isinstance(outcome, Rejected)
    assert len(rejected) == 1, f"rejects of the line: {rejected}"
    (r,) = rejected
    assert re.search(outcome.reason, r["reason"]), f"reason {r['reason']!r}, meant to match {outcome.reason!r}"
    trace = outcome.trace if outcome.trace is ANY else _tagged(outcome.trace, k)
    for part, want in [("field", outcome.field), ("node", outcome.node), ("trace_id", trace)]:
        if want is not ANY:
            assert r[part] == want, f"the reject's {part} is {r[part]!r}, meant {want!r}: {r}"
    assert not got["episodes"] and not got["traces"], "a rejected line stored records"


def bad(line: bytes, raw: bytes) -> bytes:
    """The line with its ``@@`` replaced by bytes that are not UTF-8."""
    return line.replace(b"@@", raw)


def _eat(line: bytes, at: bytes, keep: int) -> bytes:
    return line[: line.index(at) + keep]


IN_MESSAGE = Rejected(SURROGATE, "message", 0, "tr-x")
"""The reject of a line whose node 0 holds a lone surrogate in its message."""
TOO_DEEP_LINE = Rejected(TOO_DEEP, None, None, None)
"""The reject of a line too deep for Python's json (the line as a whole)."""
LOGPROBS_NULL = Rejected("", "logprobs", 0, "tr-x")
"""The reject of a line whose node 0 has ``"logprobs": null`` (pydantic words it)."""

ADVERSARIAL = [
    # text that is not one JSON object
    case("truncated-half", FULL[: len(FULL) // 2]),
    case("truncated-last-brace", FULL[:-1]),
    case("truncated-in-string", _eat(FULL, b'"q"', 2)),
    case("truncated-in-number", _eat(FULL, b"-0.5", 3)),
    case("truncated-after-key", _eat(FULL, b'"logprobs"', 11)),
    case("trailing-garbage", FULL + b"x"),
    case("trailing-second-record", FULL + b" {}"),
    case("trailing-comma", FULL + b","),
    case("trailing-nul", FULL + b"\x00"),
    case("trailing-whitespace", FULL + b" \t\r", True),
    case("leading-bom", b"\xef\xbb\xbf" + FULL),
    case("leading-form-feed", b"\x0c" + FULL),
    case("leading-vertical-tab", b"\x0b" + FULL),
    case("empty-object", "{}"),
    case("array", "[]"),
    case("array-of-episode", b"[" + FULL + b"]"),
    case("string", '"ep-x"'),
    case("number", "1"),
    case("null", "null"),
    case("true", "true"),
    # lines of whitespace only (bytes.strip() takes \x0b and \x0c for whitespace, JSON does not)
    case("spaces", "   "),
    case("tab", "\t"),
    case("carriage-return", "\r\r"),
    case("vertical-tab", "\x0b"),
    case("form-feed", "\x0c"),
    case("mixed-whitespace", " \x0b\t\x0c "),
    # record shapes
    case("episode-and-bare-trace", user_in('{"id":"ep-x","traces":[],"nodes":[<U>]}')),
    case("bare-trace-and-episode", user_in('{"id":"tr-x","nodes":[<U>],"traces":[]}')),
    case("episode-without-traces", '{"id":"ep-x"}', outcome=ACCEPTED),  # an episode with no traces
    case("nul-in-episode-key", episode(USER, episode_extra=',"x\\u0000":1')),
    case("nul-in-trace-key", episode(USER, trace_extra=',"x\\u0000":1')),
    case("nul-in-node-key", episode(node(',"x\\u0000":1'))),
    case("nul-in-message-key", episode('{"message":{"a\\u0000":1}}')),
    case("episode-traces-empty", '{"id":"ep-x","traces":[]}', True),
    case("episode-traces-null", '{"id":"ep-x","traces":null}'),
    case("episode-traces-object", '{"id":"ep-x","traces":{}}'),
    case("episode-id-number", '{"id":5,"traces":[]}'),
    case("episode-without-id", user_in('{"traces":[{"id":"tr-x","nodes":[<U>]}]}')),
    case("episode-group-string", episode(USER, episode_extra=',"group":"g"')),
    case("episode-group-without-id", episode(USER, episode_extra=',"group":{}')),
    case("episode-ok-string", episode(USER, episode_extra=',"ok":"yes"')),
    case("episode-env", episode(USER, episode_extra=',"env":{"id":"e"},"group":{"id":"g","n":1}'), True),
    case("trace-version-string", episode(USER, trace_extra=',"version":"1"')),
    case("trace-rewards", episode(USER, trace_extra=',"rewards":{"a":{"score":0.5,"weight":2},"b":null}'), True),
    case("trace-rewards-score-string", episode(USER, trace_extra=',"rewards":{"a":{"score":"1"}}')),
    case("trace-flags", episode(USER, trace_extra=',"ok":true,"is_completed":true,"stop_condition":"done"'), True),
    case("second-trace-without-id", user_in('{"id":"ep-x","traces":[{"id":"tr-x","nodes":[<U>]},{"nodes":[]}]}')),
    case("two-traces", user_in('{"id":"ep-x","traces":[{"id":"tr-x","nodes":[<U>]},{"id":"tr-y"}]}'), True),
    case("two-traces-one-id", user_in('{"id":"ep-x","traces":[{"id":"tr-x","nodes":[<U>]},{"id":"tr-x"}]}'), True),
    case("trace-not-object", '{"id":"ep-x","traces":[1]}'),
    case("trace-empty-object", '{"id":"ep-x","traces":[{}]}'),
    case("trace-without-id", user_in('{"id":"ep-x","traces":[{"nodes":[<U>]}]}')),
    case("trace-without-nodes", '{"id":"ep-x","traces":[{"id":"tr-x"}]}', True),
    case("trace-nodes-null", '{"id":"ep-x","traces":[{"id":"tr-x","nodes":null}]}'),
    case("bare-trace-nodes-empty", '{"id":"tr-x","nodes":[]}', True),
    case("bare-trace-nodes-null", '{"id":"tr-x","nodes":null}'),
    case("bare-trace-without-id", user_in('{"nodes":[<U>]}')),
    case("node-not-object", episode("1")),
    case("node-list", episode("[]")),
    case("node-empty-object", episode("{}")),
    case("node-without-message", episode('{"token_ids":[1],"mask":[true]}')),
    case("message-string", episode('{"message":"hi"}')),
    case("message-list", episode('{"message":[]}')),
    case("message-null", episode('{"message":null}')),
    case("message-number", episode('{"message":5}')),
    case("message-empty", episode('{"message":{}}'), True),
    case("role-number", episode('{"message":{"role":5}}'), True),
    case("role-null", episode('{"message":{"role":null}}'), True),
    case("role-non-ascii", episode('{"message":{"role":"usér"}}'), True),
    case("role-escaped", episode('{"message":{"role":"us\\u0065r"}}')),
    case("role-nested-only", episode('{"message":{"x":{"role":"user"}}}'), True),
    # duplicate keys
    case("duplicate-token_ids", episode(node(',"token_ids":[1],"mask":[true],"token_ids":[2]'))),
    case("duplicate-mask", episode(node(',"token_ids":[1],"mask":[true],"mask":[false]'))),
    case("duplicate-message", episode('{"message":{"role":"user"},"message":{"role":"tool"}}')),
    case("duplicate-parent", episode(USER, node(',"parent":0,"parent":0'))),
    case("duplicate-logprobs", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[1],"logprobs":[2]'))),
    case("duplicate-role", episode('{"message":{"role":"user","role":"assistant"}}')),
    case("duplicate-message-content", episode('{"message":{"role":"user","content":"a","content":"b"}}'), True),
    case("duplicate-traces", b'{"id":"ep-x","traces":[],"traces":[{"id":"tr-x","nodes":[]}]}'),
    case("duplicate-nodes", user_in('{"id":"ep-x","traces":[{"id":"tr-x","nodes":[],"nodes":[<U>]}]}')),
    case("duplicate-bare-nodes", user_in('{"id":"tr-x","nodes":[],"nodes":[<U>]}')),
    case("duplicate-bare-trace-id", user_in('{"id":"tr-x","id":"tr-y","nodes":[<U>]}')),
    case("duplicate-episode-id", user_in('{"id":"ep-x","id":"ep-y","traces":[{"id":"tr-x","nodes":[<U>]}]}')),
    case("duplicate-trace-id", user_in('{"id":"ep-x","traces":[{"id":"tr-x","id":"tr-y","nodes":[<U>]}]}')),
    case("duplicate-episode-field", episode(USER, episode_extra=',"ok":true,"ok":false')),
    case("duplicate-key-inside-episode-field", episode(USER, episode_extra=',"env":{"id":"a","id":"b"}')),
    case("duplicate-unknown-node-field", episode(node(',"x_note":1,"x_note":2'))),
    case("duplicate-trace-field", episode(USER, trace_extra=',"ok":true,"ok":false')),
    case("duplicate-key-inside-trace-field", episode(USER, trace_extra=',"rewards":{"a":{"score":1,"score":2}}')),
    case("duplicate-key-deep-in-episode-field", episode(USER, episode_extra=',"x":[1,[{"a":{"b":1,"b":1}}]]')),
    case("duplicate-bare-trace-field", user_in('{"id":"tr-x","x":1,"nodes":[<U>],"x":2}')),
    case("duplicate-key-inside-unknown-node-field", episode(node(',"x_meta":{"a":1,"b":{"c":1,"c":2}}'))),
    case("duplicate-key-deep-in-unknown-node-field", episode(node(',"x_meta":[[{"a":[{"d":null,"d":null}]}]]'))),
    case("duplicate-link-node", episode(USER, node(',"semantic_parents":[{"node":0,"node":0,"type":"x"}]'))),
    # a repeated key inside a message (other than "role") is not one the scanner looks
    # for: it keeps the text as written, which reads as the value the legacy path writes
    case("duplicate-key-inside-message", episode('{"message":{"role":"user","c":{"a":1,"a":2}}}'), True),
    # escaped keys
    case("escaped-token_ids-key", episode(node(',"\\u0074oken_ids":[1],"mask":[true]'))),
    case("escaped-nodes-key", user_in('{"id":"ep-x","traces":[{"id":"tr-x","\\u006eodes":[<U>]}]}')),
    case("escaped-traces-key", user_in('{"id":"ep-x","\\u0074races":[{"id":"tr-x","nodes":[<U>]}]}')),
    case("escaped-bare-nodes-key", user_in('{"id":"tr-x","\\u006eodes":[<U>]}')),
    case("escaped-id-key", user_in('{"\\u0069d":"ep-x","traces":[{"id":"tr-x","nodes":[<U>]}]}')),
    case("escaped-role-key", episode('{"message":{"\\u0072ole":"user"}}')),
    case("escaped-link-key", episode(USER, node(',"semantic_parents":[{"\\u006eode":0,"type":"x"}]'))),
    case("escaped-unknown-node-key", episode(node(',"x\\u005fnote":1'))),
    case("escaped-key-inside-message", episode('{"message":{"role":"user","c":{"\\u0061":1}}}'), True),
    case("escaped-key-inside-unknown-field", episode(node(',"x_note":{"\\u0061":1}')), True),
    # nested lists where numbers or booleans belong
    case("nested-token_ids", episode(node(',"token_ids":[[1]],"mask":[true]'))),
    case("nested-token_ids-tail", episode(node(',"token_ids":[1,[2]],"mask":[true,true]'))),
    case("nested-logprobs", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[[-0.5]]'))),
    case("nested-advantages", episode(node(',"token_ids":[1,2],"mask":[true,true],"advantages":[0.5,[1]]'))),
    case("nested-mask", episode(node(',"token_ids":[1],"mask":[[true]]'))),
    case("nested-is_content", episode(node(',"token_ids":[1],"mask":[true],"is_content":[[true]]'))),
    # values of the wrong type
    case("token_ids-string-item", episode(node(',"token_ids":["1"],"mask":[true]'))),
    case("token_ids-null-item", episode(node(',"token_ids":[null],"mask":[true]'))),
    case("token_ids-bool-item", episode(node(',"token_ids":[true],"mask":[true]'))),
    case("token_ids-string", episode(node(',"token_ids":"12","mask":[true,true]'))),
    case("token_ids-null", episode(node(',"token_ids":null'))),
    case("logprobs-string-item", episode(node(',"token_ids":[1],"mask":[true],"logprobs":["0.5"]'))),
    case("logprobs-null-item", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[null]'))),
    case("logprobs-bool-item", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[true]'))),
    case("logprobs-string", episode(node(',"token_ids":[1],"mask":[true],"logprobs":"x"'))),
    case("advantages-null", episode(node(',"token_ids":[1],"mask":[true],"advantages":null')), True),
    case("reference_logprobs-null", episode(node(',"token_ids":[1],"mask":[true],"reference_logprobs":null')), True),
    case("trainer_logprobs-null", episode(node(',"token_ids":[1],"mask":[true],"trainer_logprobs":null')), True),
    case("entropies-null", episode(node(',"token_ids":[1],"mask":[true],"entropies":null')), True),
    case(
        "optional-streams-null",
        episode(
            node(',"token_ids":[],"mask":[],"advantages":null,"reference_logprobs":null,"trainer_logprobs":null'),
            node(',"entropies":null,"logprobs":[]'),
        ),
        True,
        outcome=ACCEPTED,
    ),
    # logprobs is a list, empty when unknown: null is rejected (the scanner leaves the wording to the legacy path)
    case("logprobs-null", episode(node(',"token_ids":[1],"mask":[true],"logprobs":null')), outcome=LOGPROBS_NULL),
    case(
        "logprobs-null-second-node-of-bare-trace",
        user_in('{"id":"tr-x","nodes":[<U>,{"parent":0,"message":{"role":"a"},"logprobs":null}]}'),
        outcome=Rejected("", "logprobs", 1, "tr-x"),
    ),
    case("logprobs-null-no-tokens", episode(node(',"logprobs":null')), outcome=LOGPROBS_NULL),
    case("timestamp-string", episode(node(',"timestamp":"5"'))),
    case("timestamp-bool", episode(node(',"timestamp":true'))),
    case("timestamp-null", episode(node(',"timestamp":null'))),
    case("timestamp-object", episode(node(',"timestamp":{}'))),
    case("parent-string", episode(USER, node(',"parent":"0"'))),
    case("parent-bool", episode(USER, node(',"parent":true'))),
    case("parent-fraction", episode(USER, node(',"parent":0.5'))),
    case("parent-float-integral", episode(USER, node(',"parent":0.0'))),
    case("parent-exponent", episode(USER, USER, node(',"parent":1e0'))),
    case("parent-null", episode(node(',"parent":null')), True),
    case("parent-negative-zero", episode(USER, node(',"parent":-0')), True),
    case("sampled-string", episode(node(',"sampled":"true"'))),
    case("sampled-number", episode(node(',"sampled":1'))),
    case("sampled-null", episode(node(',"sampled":null'))),
    case("mask-number-item", episode(node(',"token_ids":[1],"mask":[1]'))),
    case("mask-null-item", episode(node(',"token_ids":[1],"mask":[null]'))),
    case("mask-null", episode(node(',"token_ids":[1],"mask":null'))),
    case("mask-string-item", episode(node(',"token_ids":[1],"mask":["true"]'))),
    case("mask-truncated-literal", episode(node(',"token_ids":[1],"mask":[fals]'))),
    case("is_content-null", episode(node(',"token_ids":[1],"mask":[true],"is_content":null'))),
    case("semantic_parents-null", episode(USER, node(',"semantic_parents":null'))),
    case("semantic_parents-object", episode(USER, node(',"semantic_parents":{}'))),
    case("semantic_parents-string", episode(USER, node(',"semantic_parents":"x"'))),
    # layout and graph rules
    case("mask-shorter-than-tokens", episode(node(',"token_ids":[1,2],"mask":[true]'))),
    case("mask-without-tokens", episode(node(',"mask":[true]'))),
    case("is_content-length", episode(node(',"token_ids":[1,2],"mask":[true,true],"is_content":[true]'))),
    case("is_content-empty", episode(node(',"token_ids":[1,2],"mask":[true,true],"is_content":[]')), True),
    case("logprobs-longer-than-sampled", episode(node(',"token_ids":[1,2],"mask":[false,true],"logprobs":[1,2]'))),
    case("entropies-shorter-than-sampled", episode(node(',"token_ids":[1,2],"mask":[true,true],"entropies":[1]'))),
    case("noncanonical-mask", episode(node(',"token_ids":[1,2,3],"mask":[true,false,true],"logprobs":[1,2]')), True),
    case("parent-own-index", episode(node(',"parent":0'))),
    case("parent-later-node", episode(USER, node(',"parent":5'))),
    case("parent-minus-one", episode(USER, node(',"parent":-1'))),
    case("parent-huge", episode(USER, node(',"parent":99999999999'))),
    case("link-forward", episode(node(',"semantic_parents":[{"node":1,"type":"x"}]'), USER)),
    case("link-to-itself", episode(USER, node(',"semantic_parents":[{"node":1,"type":"x"}]'))),
    case("link-negative", episode(USER, node(',"semantic_parents":[{"node":-1,"type":"x"}]'))),
    case("link-extra-key", episode(USER, node(',"semantic_parents":[{"node":0,"type":"x","w":1}]'))),
    case("link-without-node", episode(USER, node(',"semantic_parents":[{"type":"x"}]'))),
    case("link-without-type", episode(USER, node(',"semantic_parents":[{"node":0}]'))),
    case("link-empty-object", episode(USER, node(',"semantic_parents":[{}]'))),
    case("link-node-string", episode(USER, node(',"semantic_parents":[{"node":"0","type":"x"}]'))),
    case("link-node-fraction", episode(USER, node(',"semantic_parents":[{"node":0.0,"type":"x"}]'))),
    case("link-type-number", episode(USER, node(',"semantic_parents":[{"node":0,"type":1}]'))),
    case("link-type-non-ascii", episode(USER, node(',"semantic_parents":[{"type":"sü","node":0}]')), True),
    case("link-type-escaped", episode(USER, node(',"semantic_parents":[{"node":0,"type":"\\u0078"}]'))),
    case("link-not-object", episode(USER, node(',"semantic_parents":[0]'))),
    # loss_weights
    case("loss_weights-object", episode(node(',"token_ids":[1,2],"mask":[false,true],"loss_weights":{"rl":[1,0.5]}'))),
    case("loss_weights-empty-object", episode(node(',"loss_weights":{}'))),
    case("loss_weights-length", episode(node(',"token_ids":[1,2],"mask":[false,true],"loss_weights":{"rl":[1]}'))),
    case("loss_weights-null", episode(node(',"loss_weights":null')), True),
    case("loss_weights-list", episode(node(',"loss_weights":[]'))),
    case("loss_weights-null-stream", episode(node(',"loss_weights":{"rl":null}'))),
    # unknown fields
    case("unknown-nested", episode(node(',"x_meta":{"a":[1,{"b":null}],"c":"d","e":[true,false,[]]}')), True),
    case("unknown-nested-non-ascii", episode(node(',"x_meta":{"c":"dé","ü":[1]}')), True),
    case("unknown-number-forms", episode(node(',"x_meta":[1.50,1E3,-0,1e-7]')), True),
    case("unknown-escapes", episode(node(',"x_meta":"a\\/b\\u00e9"')), True),
    case(
        "unknown-trace-and-episode-fields",
        episode(USER, episode_extra=',"x":{"é":[1.50]}', trace_extra=',"y":-0'),
        True,
    ),  # noqa: E501
    # message text, kept as written by the scanner (compared by value)
    case("message-escapes", episode('{"message":{"role":"user","content":"a\\n\\t\\"\\\\b\\u0000"}}'), True),
    case("message-short-escapes", episode('{"message":{"role":"user","content":"\\b\\f\\r\\u0001\\u001f"}}'), True),
    case("message-unicode-escape", episode('{"message":{"role":"user","content":"\\u00e9"}}'), True),
    case("message-escaped-slash", episode('{"message":{"role":"user","content":"a\\/b"}}'), True),
    case("message-uppercase-escape", episode('{"message":{"role":"user","content":"\\u001F"}}'), True),
    case("message-non-ascii", episode('{"message":{"role":"user","content":"é😀"}}'), True),
    case("message-number-forms", episode('{"message":{"role":"user","n":[1.50,1E3,-0,1e-7]}}'), True),
    case("message-whitespace", episode('{"message": { "role" : "user" , "content" : [ 1 , { } ] } }'), True),
    # text that is not UTF-8 (the whole chunk falls back: alone), control characters, lone surrogates
    case("role-invalid-utf8", bad(episode(node("")).replace(b'"user"', b'"us@@er"'), b"\xff"), CHUNK),
    case("message-truncated-utf8", bad(episode('{"message":{"role":"user","content":"@@"}}'), b"\xc3"), CHUNK),
    case("message-overlong-utf8", bad(episode(USER).replace(b'"q"', b'"@@"'), b"\xc0\xaf"), CHUNK),
    case("unknown-key-invalid-utf8", bad(episode(node(',"x@@":1')), b"\xff"), CHUNK),
    case("unknown-value-invalid-utf8", bad(episode(node(',"x":["@@"]')), b"\xfe"), CHUNK),
    case(
        "link-type-invalid-utf8",
        bad(episode(USER, node(',"semantic_parents":[{"node":0,"type":"@@"}]')), b"\xff"),
        CHUNK,
    ),  # noqa: E501
    case("episode-field-invalid-utf8", bad(episode(USER, episode_extra=',"x":"@@"'), b"\xff")),
    case("trace-field-invalid-utf8", bad(episode(USER, trace_extra=',"x":"@@"'), b"\x80")),
    case("message-control-character", episode('{"message":{"role":"user","content":"a\x01b"}}')),
    case("message-raw-tab", episode('{"message":{"role":"user","content":"a\tb"}}')),
    case("episode-control-character", episode(USER, episode_extra=',"x":"\x1f"')),
    case("key-control-character", episode(node(',"x\x1f":1'))),
    # lone UTF-16 surrogates, escaped or encoded as UTF-8 (ED A0..BF ..): not Unicode text, so
    # the line is rejected both ways, naming the top-level key of the episode, trace or node
    # that holds one (a path that misses one fails when DuckDB stores the text: a trace id,
    # written into the reject too, and bytes the scanner copies alone)
    case("message-lone-surrogate", episode('{"message":{"role":"user","content":"\\ud800"}}'), outcome=IN_MESSAGE),
    case("message-high-surrogate-then-letter", episode('{"message":{"content":"\\ud800\\u0041"}}'), outcome=IN_MESSAGE),
    case("message-low-then-high-surrogate", episode('{"message":{"content":"\\udc00\\ud800"}}'), outcome=IN_MESSAGE),
    case(
        "message-high-surrogate-at-end", episode('{"message":{"role":"user","content":"a\\udbff"}}'), outcome=IN_MESSAGE
    ),
    case("message-key-lone-surrogate", episode('{"message":{"role":"user","c\\udc00":1}}'), outcome=IN_MESSAGE),
    case("role-lone-surrogate", episode('{"message":{"role":"\\uDBFF"}}'), outcome=IN_MESSAGE),
    case(
        "unknown-lone-surrogate", episode(node(',"x_note":"\\udc00"')), outcome=Rejected(SURROGATE, "x_note", 0, "tr-x")
    ),
    case(
        "unknown-nested-lone-surrogate",
        episode(node(',"x_n":{"a":[1,{"b":"\\ud800"}]}')),
        outcome=Rejected(SURROGATE, "x_n", 0, "tr-x"),
    ),
    case(
        "link-type-lone-surrogate",
        episode(USER, node(',"semantic_parents":[{"node":0,"type":"\\ud800"}]')),
        outcome=Rejected(SURROGATE, "semantic_parents", 1, "tr-x"),
    ),
    case(
        "episode-field-lone-surrogate",
        episode(USER, episode_extra=',"x":"\\ud800"'),
        outcome=Rejected(SURROGATE, "x", None, None),
    ),
    case(
        "episode-id-lone-surrogate",
        user_in('{"id":"ep-\\ud800","traces":[{"id":"tr-x","nodes":[<U>]}]}'),
        outcome=Rejected(SURROGATE, "id", None, None),
    ),
    case(
        "trace-field-lone-surrogate",
        episode(USER, trace_extra=',"y":["\\udfff"]'),
        outcome=Rejected(SURROGATE, "y", None),
    ),
    case(
        "bare-trace-field-lone-surrogate",
        user_in('{"id":"tr-x","y":"\\ud800","nodes":[<U>]}'),
        outcome=Rejected(SURROGATE, "y", None),
    ),
    case(
        "trace-id-lone-surrogate",
        episode(USER).replace(b'"tr-x"', b'"tr-\\udfff"'),
        alone=True,
        outcome=Rejected(SURROGATE, "id", None),
    ),
    case(
        "bare-trace-id-lone-surrogate",
        user_in('{"id":"tr-\\ud800","nodes":[<U>]}'),
        alone=True,
        outcome=Rejected(SURROGATE, "id", None),
    ),
    # a key of its own that holds one: rejected both ways (pydantic words it: such a key
    # is no field name to report)
    case(
        "episode-key-lone-surrogate",
        episode(USER, episode_extra=',"x\\udc00":1'),
        outcome=Rejected("", node=None, trace=None),
    ),
    case("trace-key-lone-surrogate", episode(USER, trace_extra=',"x\\udc00":1'), outcome=Rejected("", node=None)),
    case("node-key-lone-surrogate", episode(node(',"x\\ud800":1')), outcome=Rejected("", node=0, trace="tr-x")),
    # encoded as UTF-8 (the whole chunk falls back when the bytes are in a node)
    case(
        "message-utf8-surrogate",
        bad(episode(USER).replace(b'"q"', b'"@@"'), b"\xed\xa0\x80"),
        CHUNK,
        outcome=IN_MESSAGE,
    ),
    case("role-utf8-surrogate", bad(episode('{"message":{"role":"@@"}}'), b"\xed\xbf\xbf"), CHUNK, outcome=IN_MESSAGE),
    case(
        "message-key-utf8-surrogate", bad(episode('{"message":{"c@@":1}}'), b"\xed\xa0\x80"), CHUNK, outcome=IN_MESSAGE
    ),
    case(
        "unknown-utf8-surrogate",
        bad(episode(node(',"x_note":["@@"]')), b"\xed\xb0\x80"),
        CHUNK,
        outcome=Rejected(SURROGATE, "x_note", 0, "tr-x"),
    ),
    case(
        "node-key-utf8-surrogate", bad(episode(node(',"x@@":1')), b"\xed\xa0\x80"), CHUNK, outcome=Rejected("", node=0)
    ),
    case(
        "episode-field-utf8-surrogate",
        bad(episode(USER, episode_extra=',"x":"@@"'), b"\xed\xa0\x80"),
        alone=True,
        outcome=Rejected(SURROGATE, "x", None, None),
    ),
    case(
        "episode-key-utf8-surrogate",
        bad(episode(USER, episode_extra=',"x@@":1'), b"\xed\xa0\x80"),
        alone=True,
        outcome=Rejected("", node=None, trace=None),
    ),
    case(
        "trace-field-utf8-surrogate",
        bad(episode(USER, trace_extra=',"x":"@@"'), b"\xed\xa0\x80"),
        alone=True,
        outcome=Rejected(SURROGATE, "x", None),
    ),
    case(
        "bare-trace-field-utf8-surrogate",
        bad(user_in('{"id":"tr-x","x":"@@","nodes":[<U>]}').encode(), b"\xed\xa0\x80"),
        alone=True,
        outcome=Rejected(SURROGATE, "x", None),
    ),
    case(
        "trace-id-utf8-surrogate",
        episode(USER).replace(b'"tr-x"', b'"tr-\xed\xa0\x80"'),
        alone=True,
        outcome=Rejected(SURROGATE, "id", None),
    ),
    # a high and a low surrogate escaped as a pair are one code point: fine
    case("message-surrogate-pair", episode('{"message":{"role":"user","content":"\\ud83d\\ude00"}}'), True),
    case(
        "message-surrogate-pair-uppercase", episode('{"message":{"content":"\\uD83D\\uDE00"}}'), True, outcome=ACCEPTED
    ),
    case("unknown-surrogate-pair", episode(node(',"x_note":["\\udbff\\udfff"]')), True, outcome=ACCEPTED),
    case("unknown-key-surrogate-pair", episode(node(',"x\\ud83d\\ude00":1')), outcome=ACCEPTED),  # an escaped key
    # NaN and infinities
    case("logprobs-nan", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[NaN]'))),
    case("logprobs-infinity", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[Infinity]'))),
    case("logprobs-minus-infinity", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[-Infinity]'))),
    case("timestamp-nan", episode(node(',"timestamp":NaN'))),
    case("episode-field-nan", episode(USER, episode_extra=',"x":NaN')),
    case("message-infinity", episode('{"message":{"role":"user","n":Infinity}}')),
    case("unknown-nan", episode(node(',"x_note":NaN'))),
    # deep nesting: the scanner takes values up to 512 levels deep (a message's value
    # counts its own level) and leaves deeper ones to the legacy path, which reads what
    # Python's json reads (about 900 levels, depending on the stack) and rejects the rest
    case("unknown-field-512-deep", episode(node(',"x_deep":' + nest(512))), True, outcome=ACCEPTED),
    case("unknown-field-513-deep", episode(node(',"x_deep":' + nest(513))), outcome=ACCEPTED),
    case("message-512-deep", episode('{"message":{"role":"user","c":' + nest(511) + "}}"), True, outcome=ACCEPTED),
    case("message-513-deep", episode('{"message":{"role":"user","c":' + nest(512) + "}}"), outcome=ACCEPTED),
    case("episode-field-512-deep", episode(USER, episode_extra=',"x":' + nest(512)), True, outcome=ACCEPTED),
    case("episode-field-513-deep", episode(USER, episode_extra=',"x":' + nest(513)), outcome=ACCEPTED),
    case("unknown-field-600-deep", episode(node(',"x_deep":' + nest(600))), outcome=ACCEPTED),
    case(
        "unknown-field-600-deep-objects",
        episode(node(',"x_deep":' + '{"a":' * 600 + "0" + "}" * 600)),
        outcome=ACCEPTED,
    ),
    case("message-600-deep", episode('{"message":{"role":"user","c":' + nest(600) + "}}"), outcome=ACCEPTED),
    case("episode-field-600-deep", episode(USER, episode_extra=',"x":' + nest(600)), outcome=ACCEPTED),
    case("trace-field-600-deep", episode(USER, trace_extra=',"x":' + nest(600)), outcome=ACCEPTED),
    case("bare-trace-field-600-deep", user_in('{"id":"tr-x","x":' + nest(600) + ',"nodes":[<U>]}'), outcome=ACCEPTED),
    case("unknown-field-800-deep", episode(node(',"x_deep":' + nest(800)))),  # accepted or not: the stack decides
    case("unknown-field-1020-deep", episode(node(',"x_deep":' + nest(1020))), outcome=TOO_DEEP_LINE),
    case("message-1020-deep", episode('{"message":{"role":"user","c":' + nest(1020) + "}}"), outcome=TOO_DEEP_LINE),
    case("unknown-field-2000-deep", episode(node(',"x_deep":' + nest(2000))), outcome=TOO_DEEP_LINE),
    case("message-2000-deep", episode('{"message":{"role":"user","c":' + nest(2000) + "}}"), outcome=TOO_DEEP_LINE),
    case("episode-field-2000-deep", episode(USER, episode_extra=',"x":' + nest(2000)), outcome=TOO_DEEP_LINE),
    # lines the legacy path parses with json + pydantic (simdjson fails on a number beyond
    # 64 bits, or the "[" count of the line disagrees with its arrays because of an escaped
    # "[") while the scanner takes them
    case("bigint-in-episode", episode(USER, REPLY, episode_extra=',"big":18446744073709551616'), True),
    case("escaped-bracket-in-message", episode('{"message":{"role":"user","content":"\\u005b"}}', REPLY), True),
    # ... and with "logprobs": null too, rejected both ways
    case(
        "logprobs-null-bigint-in-episode",
        episode(node(',"token_ids":[1],"mask":[true],"logprobs":null'), episode_extra=',"big":18446744073709551616'),
        outcome=LOGPROBS_NULL,
    ),
    case(
        "logprobs-null-escaped-bracket",
        episode('{"message":{"role":"user","content":"\\u005b"},"token_ids":[1],"mask":[true],"logprobs":null}'),
        outcome=LOGPROBS_NULL,
    ),
    case("negative-zero-logprob", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[-0]')), True),
    case("negative-zero-timestamp", episode(node(',"timestamp":-0')), True),
]


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


RAGGED = [
    case("ragged-longer", episode(node(',"token_ids":[1,2],"mask":[false,true],"logprobs":[1,2,3]')), True),
    case("ragged-shorter", episode(node(',"token_ids":[1,2],"mask":[true,true],"advantages":[1]')), True),
    case("ragged-no-sampled", episode(node(',"token_ids":[1],"mask":[false],"entropies":[0.5]')), True),
    case(
        "ragged-null-and-ragged",
        episode(node(',"token_ids":[1],"mask":[true],"advantages":null,"entropies":[1,2]')),
        True,
    ),
    case("ragged-mask-length", episode(node(',"token_ids":[1,2],"mask":[true],"logprobs":[1]'))),
    case("ragged-parent-forward", episode(USER, node(',"parent":3,"logprobs":[1,2]'))),
    case("ragged-loss_weights-length", episode(node(',"token_ids":[1],"mask":[true],"loss_weights":{"rl":[]}'))),
    case("ragged-nested-logprobs", episode(node(',"token_ids":[1],"mask":[true],"logprobs":[[1],2]'))),
    case("ragged-is_content-length", episode(node(',"token_ids":[1],"mask":[true],"is_content":[true,true]'))),
]


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


@pytest.mark.parametrize(
    "name, data",
    [
        ("empty.traces.jsonl", b""),
        ("blank.traces.jsonl", b"\n\n"),
        ("whitespace.traces.jsonl", b"  \n\t\r\n\x0b\x0c"),
        ("empty.json", b""),
        ("whitespace.json", b" \n\t\n"),
        ("empty.traces.jsonl.zst", zstandard.ZstdCompressor().compress(b"")),
    ],
)
def test_files_without_records(tmp_path: Path, name: str, data: bytes) -> None:
    fast, _ = assert_same(write(tmp_path, name, data))
    assert fast.report is not None and fast.report["lines"] == 0


# --------------------------------------------------------------------------- numbers


def _f32_text(value: float) -> str:
    """The 17 significant digits repr of a float32 value, as a double."""
    return repr(float(np.float32(value)))


def _halfway(value: float, places: str = "f") -> list[str]:
    """Decimal texts at, just above and just below the point halfway between the float32
    ``value`` and its upper neighbour (exact decimals: float32 and double values are
    dyadic), and that point rounded to 17 significant digits."""
    a = np.float32(value)
    with np.errstate(over="ignore"):
        b = np.nextafter(a, np.float32(np.inf))
    upper = Decimal(float(b)) if np.isfinite(b) else Decimal(2) ** 128  # above the largest float32
    mid = (Decimal(float(a)) + upper) / 2
    tiny = Decimal(1).scaleb(mid.adjusted() - 30)
    return [format(mid, places), format(mid + tiny, places), format(mid - tiny, places), f"{float(mid):.17g}"]


NUMBER_TEXTS = [
    # integers
    "0",
    "1",
    "-1",
    "42",
    "123456789",
    "9007199254740993",
    # negative zero: the integer -0 is 0 (+0.0), the others are floats (-0.0)
    "-0",
    "-0.0",
    "-0e0",
    "-0E+2",
    "-0.0E-5",
    "-0.000",
    # 17 significant digits of float32 values
    *(_f32_text(v) for v in (0.1, -2.3456789, 1e-30, 3.4028235e38, 1.4e-45, 16777217.0, -7.0e-39)),
    # exponents
    "1e-5",
    "1E+3",
    "2.5e-3",
    "-4.5E-07",
    "1e22",
    "1e23",
    "123456e-28",
    "5e-324",
    "2.4703282292062328e-324",
    "1e308",
    "1.7976931348623157e308",
    "1e39",
    "-1e-400",
    "1e-99999999999",
    # more than 19 digits
    "12345678901234567890123",
    "-98765432109876543210.5",
    "0.12345678901234567890123",
    "1.00000000000000000000001",
    "0." + "0" * 399 + "1",
    # leading zeros in the fraction
    "0.000000000000000000001234",
    "-0.0000001",
    "0.0000000000000000000000000000000001",
    # halfway between float32 neighbours
    *_halfway(1.0),
    *_halfway(0.1),
    *_halfway(-3.0e38, "e"),
    *_halfway(1.0e-40, "e"),
    *_halfway(float(np.finfo(np.float32).max), "e"),
]
BEYOND_DOUBLE = ["1e400", "-1e400", "1" + "0" * 400]
"""Numbers beyond the double range: the whole chunk falls back (so, files of their own)."""


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
        if side["report rejected"]:
            assert not np.isfinite(value), side["report rejected"]
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
    fast, slow = numbers.assert_same(text, True)
    _check_number(text, fast, slow)


def test_numbers_file(numbers: Batch) -> None:
    numbers.assert_whole_file_same()


@pytest.mark.parametrize("text", BEYOND_DOUBLE, ids=_ids(BEYOND_DOUBLE))
def test_number_beyond_double(tmp_path: Path, text: str) -> None:
    fast, slow = assert_same(write(tmp_path, "n.traces.jsonl", _number_line(text) + b"\n"), taken=[False])
    ids = {r["trace_id"] for r in fast.tables["traces"]}
    _check_number(text, fast.line(1, ids), slow.line(1, ids))


TOKEN_TEXTS = [
    ("2147483647", True),
    ("-2147483648", True),
    ("0", True),
    ("-0", True),
    (" 5 ", True),
    ("2147483648", False),
    ("-2147483649", False),
    ("99999999999999999999", False),
    ("1.0", False),
    ("1e2", False),
    ("1E2", False),
    ("01", False),
    ("-01", False),
    ("00", False),
    ("+1", False),
    ("-", False),
    ("true", False),
    ("null", False),
    ('"1"', False),
]


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


def _meant(ep: dict[str, Any], style: dict[str, Any]) -> bool:
    """Whether the scanner is meant to take the episode written in ``style``: not with a
    ``loss_weights`` object, nor with an escaped key in the episode, a trace, a node, a
    message or a link, nor with an escaped role or link type."""
    if any(_escaped(k, style) for k in ep):
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


MUTATION_SEEDS = [
    FULL,
    GOOD_EPISODE.encode(),
    GOOD_BARE.encode(),
    episode(
        USER,
        node(
            ',"semantic_parents":[{"node":0,"type":"compaction"}],"timestamp":12.5,"token_ids":[5,6,7],'
            '"mask":[false,true,true],"logprobs":[-0.1,-0.25],"advantages":[1,0],"is_content":[true,true,false],'
            '"x_n":{"a":[1,"b"]}'
        ),
        trace_extra=',"rewards":{"r":{"score":1}},"ok":true',
    ),
    b'{"id":"tr-b","x":{"y":[1,2]},"nodes":[{"message":{"role":"tool","content":[{"type":"text","text":"hi"}]},'
    b'"parent":null,"sampled":false,"token_ids":[1],"mask":[false],"is_content":[],"logprobs":[],"advantages":null,'
    b'"semantic_parents":[],"loss_weights":null}]}',
    episode(
        '{"message":{"role":"usér","content":"a\\u00e9\\n\\ud83d\\ude00","n":[1.50,-0,1E3]}}',
        node(',"parent":0,"x_m":{"é":[-0.0,2e-3,"\\/"]},"token_ids":[1],"mask":[true],"logprobs":[-0]'),
        episode_extra=',"x":{"ü":[1.5e1]}',
    ),
]
"""Lines to mutate, one with text the scanner keeps as written and the legacy path writes
otherwise (non-ASCII, escapes, exponents, -0)."""
MUTATION_TEXT = [
    *(bytes([c]) for c in b'01-.eE+"\\[]{},: \t'),
    b"null",
    b"true",
    b"false",
    b"9" * 25,
    b"1e400",
    b"\\u0000",
    b"\xff",
    b'"x":1,',
    b'"id":"z",',
    b'"parent":0,',
    b'"nodes":[],',
    b'"traces":[],',
    b'"role":"x",',
    b'"message":{},',
    b'"mask":[true],',
    b'"token_ids":[1],',
    b'"logprobs":null,',
]


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


# --------------------------------------------------------------------------- chunks


def _chunk_lines(path: Path, chunk_bytes: int | None) -> list[tuple[int, bytes]]:
    """(line number, line) of the non-blank lines, as read_chunks cuts them."""
    chunks = read_chunks(path) if chunk_bytes is None else read_chunks(path, chunk_bytes)
    out = []
    for chunk in chunks:
        assert chunk.data.endswith(b"\n")
        assert len(chunk.starts) == len(chunk.ends) == len(chunk.numbers)
        for k in range(len(chunk.starts)):
            assert b"\n" not in chunk.data[chunk.starts[k] : chunk.ends[k]]
            raw = chunk.raw(k)
            if raw.strip():
                out.append((int(chunk.numbers[k]), raw))
    return out


SMALL_TEXT = b"\n".join(
    [
        GOOD_EPISODE.encode(),
        b"",
        b"  \t",
        GOOD_BARE.encode() + b"\r",
        b"\x0b",
        b"{}",
        b"\r\r",
        FULL,
        b"x" * 150,
        b"",
    ]
)


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000, None])
@pytest.mark.parametrize("variant", ["lf", "crlf", "no-final-newline", "zst"])
def test_read_chunks_cuts_lines_like_read_lines(tmp_path: Path, variant: str, chunk_bytes: int | None) -> None:
    data = SMALL_TEXT + FIRST_LINES[-1] + b"\n"
    if variant == "crlf":
        data = data.replace(b"\n", b"\r\n")
    elif variant == "no-final-newline":
        data = data.rstrip(b"\n")
    name = "c.traces.jsonl"
    if variant == "zst":
        data, name = zstandard.ZstdCompressor().compress(data), name + ".zst"
    path = write(tmp_path, name, data)
    assert _chunk_lines(path, chunk_bytes) == list(read_lines(path))


@settings(max_examples=150, deadline=None, database=None)
@given(
    parts=st.lists(
        st.sampled_from([b"a", b"{}", b" ", b"\n", b"\r", b"\r\n", b"\x0b", b"xyz" * 7, b"\n\n"]), max_size=40
    ),
    chunk_bytes=st.integers(1, 48),
)
def test_read_chunks_cuts_any_text_like_read_lines(parts: list[bytes], chunk_bytes: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp), "r.jsonl", b"".join(parts))
        assert _chunk_lines(path, chunk_bytes) == list(read_lines(path))
        numbers = [n for chunk in read_chunks(path, chunk_bytes) for n in chunk.numbers.tolist()]
        assert numbers == list(range(1, len(numbers) + 1))


def _tiny_chunk_file(tmp_path: Path) -> tuple[Path, list[bool]]:
    """Lines of a few fixtures with blank and malformed lines between them, CRLF."""
    lines = []
    for i, path in enumerate(FIXTURE_FILES[:3]):
        lines += _lines(path)
        malformed = [FULL + b"x", b"{}", episode(node(',"parent":0'))][i]
        lines += [
            WHITESPACE_LINES[i + 1],
            unique(malformed, i),
            GOOD_BARE.encode().replace(b"tr-bare", b"tr-bare%d" % i),
        ]
    data = b"\r\n".join(lines)
    taken = [
        ok and not line.startswith((b'{"id":"ep', b"{}")) for ok, line in zip(meant_taken(data), data.split(b"\n"))
    ]
    return write(tmp_path, "tiny.traces.jsonl", data), taken


@pytest.mark.parametrize("chunk_bytes", [7, 64, 1000])
def test_ingest_in_tiny_chunks(tmp_path: Path, chunk_bytes: int, knobs: Any) -> None:
    """Ingest reading a few bytes at a time (chunks of whole lines, each scanned on its
    own, the scanner's buffers sized for tiny chunks and grown) against the legacy path
    reading the default chunks."""
    path, taken = _tiny_chunk_file(tmp_path)
    reference = run_ingest(path, legacy=True)
    knobs(chunk_bytes=chunk_bytes)
    chunks = list(read_chunks(path))
    assert len(chunks) > 1
    scanner = Scanner()
    assert [p is not None for chunk in chunks for p in scan_chunk(chunk, scanner)[1]] == taken
    _assert_no_differences(run_ingest(path, legacy=False).whole(), reference.whole(), " in tiny chunks")
    assert reference.report is not None and reference.report["rejected"] and reference.report["traces"]


def test_many_tiny_traces_stay_inside_the_scanner_buffers(tmp_path: Path) -> None:
    """One 4.9 MB line of 700,000 traces ``{"":0}`` (no id: the legacy path rejects it).
    The scanner writes a row per trace before Python looks for an id, into a trace table
    of len(chunk) // 10 + 4 rows, and 7 bytes make a trace here: the line must come back
    to the legacy path without a row written past the table. Run in a child process (a
    write past the end may crash it, or go unnoticed: the child also reports the rows the
    scan counted against the table's size)."""
    script = textwrap.dedent(
        """
        import json
        import sys
        from pathlib import Path

        from tracedb.ingest import _scan
        from tracedb.ingest.files import read_chunks
        from tracedb.ingest.scanned import Scanner, scan_chunk

        path = Path(sys.argv[1])
        path.write_bytes(b'{"id":"ep","traces":[' + b",".join([b'{"":0}'] * 700_000) + b"]}\\n")
        scanner = Scanner()
        _, parsed = scan_chunk(next(read_chunks(path)), scanner)
        try:
            rows, capacity = int(scanner.out["counts"][_scan.C_TRACE]), len(scanner.out["traces"])
        except (AttributeError, KeyError):  # the scanner's internals changed: rely on the rest
            rows = capacity = 0
        print(json.dumps({"taken": [p is not None for p in parsed], "rows": rows, "capacity": capacity}))
        """
    )
    child = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "tiny-traces.jsonl")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert child.returncode == 0, f"the scan died (exit code {child.returncode}): {child.stderr[-500:]!r}"
    result = json.loads(child.stdout)
    assert result["taken"] == [False]
    assert result["rows"] <= result["capacity"], (
        f"{result['rows']} trace rows written into a table of {result['capacity']}"
    )


def test_a_line_not_followed_by_its_line_break_falls_back() -> None:
    """The digit loops stop at the byte after a line without checking bounds; a chunk whose
    line is followed by anything but its line break is not scanned (a hand-built chunk)."""
    line = b'{"id":"e","traces":[{"id":"t","nodes":[{"message":{},"token_ids":[1],"mask":[true]}]}]}'
    for after in (b"\n", b"2", b"-", b"."):
        data = line + after
        chunk = Chunk(data, np.array([0]), np.array([len(line)]), np.array([1]))
        _, lines = scan_chunk(chunk)
        assert (lines[0] is not None) == (after == b"\n"), after
