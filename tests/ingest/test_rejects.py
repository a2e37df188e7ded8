"""Rejection at ingest: every check of the contract, where it is reported, what survives.

Each bad record is a small mutation of a real verifiers record (``linear``: node 2 is a
sampled assistant turn with 28 tokens, 25 of them sampled), written between two good
lines of ``groups.traces.jsonl``.
"""

from __future__ import annotations

import copy
import dataclasses
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import simdjson
import zstandard

import tracedb
import tracedb.ingest.rows
import tracedb.ingest.run
import tracedb.ingest.writer
from tracedb.errors import IngestAborted, Location, RecordError
from tracedb.ingest.parse import Fallback, check_trace, parse_fast, parse_line, parse_slow
from tracedb.records import COMPACT_STREAMS

from support import FIXTURES

TABLES = ("tracedb_meta", "episodes", "traces", "segments", "nodes", "branches", "rejects")
FIXTURE_FILES = sorted(FIXTURES.glob("*.traces.jsonl"))
BASE: dict[str, Any] = json.loads((FIXTURES / "linear.traces.jsonl").read_text())
BASE_TRACE = BASE["traces"][0]["id"]
GOOD_LINES = (FIXTURES / "groups.traces.jsonl").read_text().splitlines()
GOOD = [json.loads(line) for line in GOOD_LINES]
N = 2  # the node the mutations touch
N_TOKENS = len(BASE["traces"][0]["nodes"][N]["token_ids"])
N_SAMPLED = sum(BASE["traces"][0]["nodes"][N]["mask"])
assert (N_TOKENS, N_SAMPLED) == (28, 25)


# --------------------------------------------------------------------------- helpers


def canon(value: Any) -> str:
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def assert_same(got: Any, want: Any) -> None:
    assert got == want
    assert canon(got) == canon(want)


def counts(db: tracedb.Database) -> dict[str, int]:
    return {t: db.sql(f"SELECT count(*) AS n FROM {t}").column("n")[0].as_py() for t in TABLES}


def content(db: tracedb.Database) -> dict[str, list[str]]:
    return {t: sorted(repr(r) for r in db.sql(f"SELECT * FROM {t}").to_pylist()) for t in TABLES}


def write_lines(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((x.encode() if isinstance(x, str) else x) + b"\n" for x in lines))
    return path


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
]
CASE_IDS = [c.id for c in CASES]
LAYOUT = [c for c in CASES if c.layout]


def bad_file(tmp_path: Path, case: Case) -> tuple[Path, bytes]:
    raw = case.line()
    path = write_lines(tmp_path / "bad.traces.jsonl", [GOOD_LINES[0], raw, GOOD_LINES[1]])
    return path, raw


def check_reject(reject: Any, case: Case, path: Path, line: int) -> None:
    assert reject.file == str(path)
    assert reject.line == line
    assert reject.trace_id == case.trace_id
    assert reject.node == case.node
    if case.field is None:
        assert reject.field is None
    else:
        assert reject.field == case.field or reject.field.startswith(case.field + "."), reject.field
    for needle in case.needles:
        assert needle in reject.reason, (needle, reject.reason)
    text = str(reject)
    assert f"{path}:{line}" in text
    if case.trace_id is not None:
        assert case.trace_id in text
    if case.node is not None:
        assert f"node {case.node}" in text


# --------------------------------------------------------------------------- one test per rejection


@pytest.mark.parametrize("case", CASES, ids=CASE_IDS)
def test_rejected_with_location(fresh_db, tmp_path, case):
    path, raw = bad_file(tmp_path, case)
    # The record checker itself must refuse the line (checked first: a record that slips
    # through can wedge the writer, e.g. a negative parent loops forever in branch_paths).
    with pytest.raises(RecordError):
        parse_line(simdjson.Parser(), raw, Location(str(path), 2))

    report = fresh_db.ingest(path)

    # the report
    assert not report.ok
    assert report.lines == 3
    assert len(report.rejected) == 1, report.rejected
    reject = report.rejected[0]
    check_reject(reject, case, path, 2)
    assert report.to_dict()["rejected"] == [
        {
            "file": str(path),
            "line": 2,
            "trace_id": case.trace_id,
            "node": reject.node,
            "field": reject.field,
            "reason": reject.reason,
        }
    ]
    assert "1 records rejected" in str(report)

    # the good lines before and after it
    assert (report.traces, report.episodes, report.skipped) == (2, 2, 0)
    for e in GOOD[:2]:
        assert_same(fresh_db.episode(e["id"]), e)
    with pytest.raises(tracedb.NotFound):
        fresh_db.trace(BASE_TRACE)
    with pytest.raises(tracedb.NotFound):
        fresh_db.episode(BASE["id"])
    assert fresh_db.stats()["traces"] == 2

    # the rejects table
    rows = fresh_db.sql("SELECT source, line, trace_id, node, field, reason, record FROM rejects").to_pylist()
    assert rows == [
        {
            "source": str(path),
            "line": 2,
            "trace_id": case.trace_id,
            "node": reject.node,
            "field": reject.field,
            "reason": reject.reason,
            "record": raw.decode(),
        }
    ]
    assert fresh_db.stats()["rejects"] == 1


@pytest.mark.parametrize(
    "case",
    [c for c in CASES if c.id in ("mask_shorter_than_token_ids", "missing_message", "string_in_token_ids")],
    ids=lambda c: c.id,
)
def test_rejected_in_bare_trace_line(fresh_db, tmp_path, case):
    e = copy.deepcopy(BASE)
    case.mutate(e)
    raw = json.dumps(e["traces"][0]).encode()
    path = write_lines(tmp_path / "bare.jsonl", [GOOD_LINES[0], "", raw, GOOD_LINES[1]])
    report = fresh_db.ingest(path)
    assert report.traces == 2 and len(report.rejected) == 1
    check_reject(report.rejected[0], case, path, 3)  # blank lines count
    assert fresh_db.sql("SELECT record FROM rejects").to_pylist() == [{"record": raw.decode()}]


@pytest.mark.parametrize("which", ["layout", "type"])
def test_rejected_in_second_trace_of_an_episode(fresh_db, tmp_path, which):
    e = copy.deepcopy(BASE)
    second = copy.deepcopy(e["traces"][0])
    second["id"] = "second-trace"
    e["traces"].append(second)
    if which == "layout":
        second["nodes"][4]["mask"] = second["nodes"][4]["mask"][:-2]
        field, needles = "mask", (str(len(second["nodes"][4]["token_ids"]) - 2),)
    else:
        del second["nodes"][4]["message"]
        field, needles = "message", ()
    raw = json.dumps(e).encode()
    path = write_lines(tmp_path / "two.jsonl", [GOOD_LINES[0], raw, GOOD_LINES[1]])
    report = fresh_db.ingest(path)
    case = Case("second", raw=raw, field=field, node=4, trace_id="second-trace", needles=needles)
    assert len(report.rejected) == 1
    check_reject(report.rejected[0], case, path, 2)
    # the episode is one record: neither of its traces is stored
    assert report.traces == 2
    with pytest.raises(tracedb.NotFound):
        fresh_db.trace(BASE_TRACE)


def test_rejected_in_zst_and_json_files(fresh_db, tmp_path):
    case = next(c for c in CASES if c.id == "mask_shorter_than_token_ids")
    raw = case.line()
    zpath = tmp_path / "bad.jsonl.zst"
    zpath.write_bytes(zstandard.ZstdCompressor().compress(b"\n".join([GOOD_LINES[0].encode(), raw, b""])))
    e = copy.deepcopy(BASE)
    case.mutate(e)
    jpath = tmp_path / "bad.json"
    jpath.write_text(json.dumps(e["traces"][0], indent=1))
    report = fresh_db.ingest([zpath, jpath])
    assert report.traces == 1 and len(report.rejected) == 2
    check_reject(report.rejected[0], case, zpath, 2)
    check_reject(report.rejected[1], case, jpath, 1)
    rows = fresh_db.sql("SELECT source, line, record FROM rejects ORDER BY source").to_pylist()
    assert rows == sorted(
        [
            {"source": str(zpath), "line": 2, "record": raw.decode()},
            {"source": str(jpath), "line": 1, "record": jpath.read_text()},
        ],
        key=lambda r: r["source"],
    )


def test_many_bad_lines_all_reported(fresh_db, tmp_path):
    lines: list[bytes] = []
    for i, case in enumerate(CASES[:10]):
        lines += [GOOD_LINES[i].encode(), case.line()]
    lines.append(GOOD_LINES[10].encode())
    path = write_lines(tmp_path / "many.jsonl", lines)
    report = fresh_db.ingest(path)
    assert report.traces == 11
    assert [r.line for r in report.rejected] == [2 * (i + 1) for i in range(10)]
    assert fresh_db.stats()["rejects"] == 10
    for i, case in enumerate(CASES[:10]):
        check_reject(report.rejected[i], case, path, 2 * (i + 1))


# --------------------------------------------------------------------------- wrong types elsewhere


def _string_in_logprobs(e: dict[str, Any]) -> None:
    node(e)["logprobs"][0] = "-1.5"


WRONG_TYPES = {
    "timestamp_string": set_node("timestamp", "abc"),
    "sampled_string": set_node("sampled", "yes"),
    "sampled_number": set_node("sampled", 1),
    "parent_float": set_node("parent", 1.0),
    "bool_in_token_ids": set_token(0, True),
    "string_in_logprobs": _string_in_logprobs,
    "string_in_loss_weights": set_node("loss_weights", {"w": ["1"] * N_TOKENS}),
}


@pytest.mark.parametrize("name", list(WRONG_TYPES))
def test_wrong_type_is_rejected_or_kept_exactly(fresh_db, tmp_path, name):
    """A value of the wrong type is either rejected like the others or stored verbatim;
    it never takes its good neighbours down with it, and is never silently converted."""
    e = copy.deepcopy(BASE)
    WRONG_TYPES[name](e)
    raw = json.dumps(e).encode()
    path = write_lines(tmp_path / "t.jsonl", [GOOD_LINES[0], raw, GOOD_LINES[1]])
    report = fresh_db.ingest(path)  # must not raise
    for g in GOOD[:2]:
        assert_same(fresh_db.episode(g["id"]), g)
    if report.rejected:
        (reject,) = report.rejected
        assert (reject.file, reject.line, reject.trace_id, reject.node) == (str(path), 2, BASE_TRACE, N)
        assert reject.field is not None
        assert fresh_db.sql("SELECT record FROM rejects").to_pylist() == [{"record": raw.decode()}]
    else:
        assert_same(fresh_db.episode(e["id"]), e)


# --------------------------------------------------------------------------- allow_ragged


@pytest.mark.parametrize("case", [c for c in LAYOUT if c.field in COMPACT_STREAMS], ids=lambda c: c.id)
def test_allow_ragged_accepts_compact_streams(fresh_db, tmp_path, case):
    path, raw = bad_file(tmp_path, case)
    report = fresh_db.ingest(path, allow_ragged=True)
    assert report.ok, report.rejected
    assert report.traces == 3
    e = json.loads(raw)
    assert_same(fresh_db.episode(e["id"]), e)  # the ragged stream is kept as written
    assert fresh_db.stats()["rejects"] == 0


@pytest.mark.parametrize("case", [c for c in LAYOUT if c.field not in COMPACT_STREAMS], ids=lambda c: c.id)
def test_allow_ragged_still_checks_the_rest(fresh_db, tmp_path, case):
    path, _ = bad_file(tmp_path, case)
    report = fresh_db.ingest(path, allow_ragged=True)
    assert report.traces == 2 and len(report.rejected) == 1
    check_reject(report.rejected[0], case, path, 2)


# --------------------------------------------------------------------------- strict


def _preloaded(db: tracedb.Database, tmp_path: Path) -> None:
    """Other data, including an earlier reject, ingested before the strict run."""
    db.ingest([FIXTURES / "linear.traces.jsonl", FIXTURES / "forest.traces.jsonl"])
    earlier = write_lines(tmp_path / "earlier.jsonl", [GOOD_LINES[20], b"{not json"])
    report = db.ingest(earlier)
    assert report.traces == 1 and len(report.rejected) == 1


STRICT_CASES = [c for c in CASES if c.id in ("mask_shorter_than_token_ids", "missing_message", "invalid_json")]


@pytest.mark.parametrize("batch_tokens", [None, 1], ids=["one-batch", "batch-per-line"])
@pytest.mark.parametrize("case", STRICT_CASES, ids=lambda c: c.id)
def test_strict_aborts_and_leaves_database_unchanged(fresh_db, tmp_path, knobs, case, batch_tokens):
    if batch_tokens is not None:  # earlier lines are already written when the bad one comes
        knobs(batch_tokens=batch_tokens)
        knobs(chunk_bytes=1)  # a chunk per line
    _preloaded(fresh_db, tmp_path)
    before_counts, before = counts(fresh_db), content(fresh_db)
    before_stats = fresh_db.stats()
    good = write_lines(tmp_path / "good.jsonl", GOOD_LINES[2:6])
    raw = case.line()
    bad = write_lines(tmp_path / "bad.jsonl", [*GOOD_LINES[6:9], raw, GOOD_LINES[9]])

    with pytest.raises(IngestAborted) as info:
        fresh_db.ingest([good, bad], strict=True)
    err = info.value.error
    assert isinstance(err, RecordError) and isinstance(info.value, tracedb.TraceDBError)
    loc = err.location
    assert (loc.file, loc.line, loc.trace_id, loc.node) == (str(bad), 4, case.trace_id, case.node)
    assert f"{bad}:4" in str(info.value)
    for needle in case.needles:
        assert needle in err.reason

    assert counts(fresh_db) == before_counts
    assert content(fresh_db) == before
    assert fresh_db.stats() == before_stats
    for g in GOOD[2:10]:
        with pytest.raises(tracedb.NotFound):
            fresh_db.episode(g["id"])

    # the database is still usable; a non-strict run of the same input commits the good lines
    report = fresh_db.ingest([good, bad])
    assert report.traces == 8 and len(report.rejected) == 1
    check_reject(report.rejected[0], case, bad, 4)
    for g in GOOD[2:10]:
        assert_same(fresh_db.episode(g["id"]), g)
    assert fresh_db.stats()["rejects"] == 2


def test_strict_clean_input_ingests(fresh_db):
    report = fresh_db.ingest(FIXTURES, strict=True)
    assert report.ok and report.traces == sum(len(f.read_text().splitlines()) for f in FIXTURE_FILES)


def test_strict_file_database_unchanged_after_abort(tmp_path):
    path = tmp_path / "db.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        before = content(db)
    bad, _ = bad_file(tmp_path, CASES[0])
    with tracedb.connect(path) as db:
        with pytest.raises(IngestAborted):
            db.ingest(bad, strict=True)
    with tracedb.connect(path, read_only=True) as db:
        assert content(db) == before


@pytest.mark.parametrize("batch_tokens", [None, 1], ids=["one-batch", "batch-per-line"])
def test_non_strict_commits_good_lines(tmp_path, knobs, batch_tokens):
    if batch_tokens is not None:
        knobs(batch_tokens=batch_tokens)
        knobs(chunk_bytes=1)  # a chunk per line
    path = tmp_path / "db.duckdb"
    bad, raw = bad_file(tmp_path, CASES[0])
    with tracedb.connect(path) as db:
        report = db.ingest(bad)
        assert report.traces == 2 and len(report.rejected) == 1
    with tracedb.connect(path, read_only=True) as db:
        for g in GOOD[:2]:
            assert_same(db.episode(g["id"]), g)
        assert db.sql("SELECT line, record FROM rejects").to_pylist() == [{"line": 2, "record": raw.decode()}]


# --------------------------------------------------------------------------- fast path vs slow path


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
