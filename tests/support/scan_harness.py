"""The differential harness for ingest's two parse paths (the tests: ``tests/ingest/test_scan_*.py``).

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

Hand-written cases share files to keep the tests fast: a :class:`Batch` writes many
cases as the lines of one file (each with ids of its own), ingests it once each way, and
each case compares what came of its line (its rejects, episode, traces, their nodes,
branches and records); one more test compares the whole file. Cases that may make an
ingest raise, or make the whole chunk fall back, get a file of their own. A case may also
say how its line is meant to end (accepted, or rejected with a reason and a location),
which is checked on top of the two paths agreeing.
"""

from __future__ import annotations

import contextlib
import json
import re
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import tracedb
from tracedb import runtime
from tracedb.ingest.files import read_chunks
from tracedb.ingest.scanned import Scanner, scan_chunk

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


def assert_no_differences(fast: dict[str, Any], slow: dict[str, Any], what: str = "") -> None:
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
    assert_no_differences(fast.whole(), slow.whole())
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
        assert_no_differences(fast, slow, f" on line {number} of {self.path.name} ({case_id})")
        if taken is not None:
            assert not isinstance(self.taken, tuple), f"the scan raised {self.taken}"
            assert self.taken[number - 1] == taken, f"the scanner took line {number}: {self.taken[number - 1]}"
        return fast, slow

    def assert_whole_file_same(self) -> None:
        assert_no_differences(self.fast.whole(), self.slow.whole(), f" for the whole of {self.path.name}")


def write(directory: Path, name: str, data: bytes | str) -> Path:
    """``data`` (text as UTF-8) written to ``directory / name``."""
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
    """``value`` as minified JSON."""
    return json.dumps(value, separators=(",", ":"), **kwargs)


# --------------------------------------------------------------------------- what a case means


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
