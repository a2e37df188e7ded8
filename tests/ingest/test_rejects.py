"""Rejection at ingest: every check of the contract, where it is reported, what survives.

Each bad record is a small mutation of a real verifiers record (``linear``: node 2 is a
sampled assistant turn with 28 tokens, 25 of them sampled), written between two good
lines of ``groups.traces.jsonl``.

The bad records: :mod:`support.reject_cases`; the fast and slow parse paths on them:
``test_parse_fast_slow.py``.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import simdjson
import zstandard

import tracedb
from tracedb.errors import IngestAborted, Location, RecordError
from tracedb.ingest.parse import parse_line
from tracedb.records import COMPACT_STREAMS

from support import FIXTURES
from support.ingested import FIXTURE_FILES, assert_same, content, counts
from support.reject_cases import (
    BASE,
    BASE_TRACE,
    CASE_IDS,
    CASES,
    GOOD,
    GOOD_LINES,
    LAYOUT,
    N_TOKENS,
    Case,
    N,
    node,
    set_node,
    set_token,
)

# --------------------------------------------------------------------------- helpers


def write_lines(path: Path, lines: list[str | bytes]) -> Path:
    path.write_bytes(b"".join((x.encode() if isinstance(x, str) else x) + b"\n" for x in lines))
    return path


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
