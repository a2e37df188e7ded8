"""Hostile input at ingest: trace ids that are no string, damaged compressed files,
repeated JSON keys, non-finite numbers and numbers beyond float32, lines over the size
limit. Each bad line is one reject (file, line, field) while its neighbours are ingested,
on both parse paths (the compiled scanner and the parser behind it).

The lines: :mod:`support.hostile` (a mutated ``linear`` episode between good lines of
``groups``)."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import zstandard

import tracedb
from tracedb.cec import ingest_records
from tracedb.errors import IngestAborted, InputError
from tracedb.ingest.files import read_chunks
from tracedb.ingest.scanned import scan_chunk
from tracedb.records import COMPACT_STREAMS, trace_reward

from support.cec_records import EPISODES, GROUPS, trace_record
from support.hostile import (
    BASE,
    BASE_TRACE,
    GOOD_LINES,
    PLACEHOLDER,
    cut_inside_a_line,
    episode_with,
    first_wins,
    inserted_after,
    with_literal,
    write_lines,
    zst_frames,
)
from support.ingested import content

SCANNERS = ("always", "never")


@pytest.fixture(params=SCANNERS)
def scanner(request: pytest.FixtureRequest, knobs: Any) -> str:
    """Both parse paths: the compiled scanner first (``always``), the parser alone (``never``)."""
    knobs(scanner=request.param)
    return request.param


def between_good_lines(tmp_path: Path, bad: str, name: str = "bad.traces.jsonl") -> Path:
    return write_lines(tmp_path / name, [GOOD_LINES[0], bad, GOOD_LINES[1]])


def good_ids() -> list[str]:
    return sorted(json.loads(line)["traces"][0]["id"] for line in GOOD_LINES[:2])


def stored_ids(db: tracedb.Database) -> list[str]:
    return sorted(db.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist())


# --------------------------------------------------------------------------- trace ids that are no string

NON_STRING_IDS = [1, 1.5, True, [], {}, None]


@pytest.mark.parametrize("value", NON_STRING_IDS, ids=lambda v: type(v).__name__)
def test_a_non_string_trace_id_in_an_episode_is_one_rejected_line(tmp_path, scanner, value):
    def mutate(e: dict[str, Any]) -> None:
        second = copy.deepcopy(e["traces"][0])
        second["id"] = value
        e["traces"].append(second)  # the first trace is good; the line is one record

    line = json.dumps(episode_with(mutate))
    path = between_good_lines(tmp_path, line)
    with tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        assert (report.lines, report.traces, report.episodes) == (3, 2, 2)
        assert stored_ids(db) == good_ids()
        (reject,) = report.rejected
        where = (reject.file, reject.line, reject.trace_id, reject.node, reject.field)
        assert where == (str(path), 2, None, None, "id")
        assert "valid string" in reject.reason and f"(got {json.dumps(value)})" in reject.reason
        assert "trace 1 of the episode" in reject.reason
        assert f"{path}:2" in str(reject) and "field id" in str(reject)
        rows = db.sql("SELECT source, line, trace_id, field, record FROM rejects").to_pylist()
        assert rows == [{"source": str(path), "line": 2, "trace_id": None, "field": "id", "record": line}]


@pytest.mark.parametrize("value", NON_STRING_IDS, ids=lambda v: type(v).__name__)
def test_a_non_string_id_of_a_bare_trace_is_one_rejected_line(tmp_path, scanner, value):
    bare = copy.deepcopy(BASE["traces"][0])
    bare["id"] = value
    path = between_good_lines(tmp_path, json.dumps(bare))
    with tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        assert report.traces == 2 and stored_ids(db) == good_ids()
        (reject,) = report.rejected
        assert (reject.file, reject.line, reject.trace_id, reject.field) == (str(path), 2, None, "id")
        assert "valid string" in reject.reason and "of the episode" not in reject.reason


@pytest.mark.parametrize("bare", [False, True], ids=["episode", "bare-trace"])
def test_a_non_string_trace_id_aborts_a_strict_ingest(tmp_path, scanner, bare):
    record = copy.deepcopy(BASE["traces"][0] if bare else BASE)
    (record if bare else record["traces"][0])["id"] = 7
    path = between_good_lines(tmp_path, json.dumps(record))
    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        db.ingest(write_lines(tmp_path / "first.jsonl", [GOOD_LINES[5]]))
        before = content(db)
        with pytest.raises(IngestAborted) as info:
            db.ingest(path, strict=True)
        assert f"{path}:2" in str(info.value) and "field id" in str(info.value)
        assert content(db) == before


# --------------------------------------------------------------------------- damaged compressed input


def test_a_multi_frame_zst_cut_short_keeps_the_lines_before_the_cut(tmp_path, scanner):
    data, ends = zst_frames(GOOD_LINES[:10])  # a frame per line
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[: ends[5] + (ends[6] - ends[5]) // 2])  # inside the frame of line 7
    with tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        assert report.traces == 6 and report.unreadable == [str(path)]
        assert stored_ids(db) == sorted(json.loads(x)["traces"][0]["id"] for x in GOOD_LINES[:6])
        (reject,) = report.rejected
        assert (reject.file, reject.line, reject.trace_id) == (str(path), 7, None)
        assert "truncated" in reject.reason
        assert "could not be read to their end" in str(report) and str(path) in str(report)
        rows = db.sql("SELECT source, line, reason FROM rejects").to_pylist()
        assert rows == [{"source": str(path), "line": 7, "reason": reject.reason}]


def test_a_zst_cut_inside_its_only_frame_is_reported(tmp_path, scanner):
    """The decompressor hands out nothing of a small frame cut short: the first read of
    the file already finds the end (the damage must not pass for an empty file)."""
    data, _ = zst_frames(GOOD_LINES[:3], per_frame=3)
    assert not zstandard.ZstdDecompressor().decompressobj().decompress(data[: len(data) // 2])
    path = tmp_path / "one.jsonl.zst"
    path.write_bytes(data[: len(data) // 2])
    with tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        assert report.traces == 0 and report.unreadable == [str(path)]
        assert [(r.line, "truncated" in r.reason) for r in report.rejected] == [(1, True)]


def test_a_zst_cut_inside_a_line_loses_that_line_whole(tmp_path, scanner, knobs):
    knobs(reject_record_bytes=100)
    cut, whole, partial = cut_inside_a_line(GOOD_LINES)
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(cut)
    with tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        assert report.traces == whole and report.unreadable == [str(path)]
        assert [(r.line, "truncated" in r.reason) for r in report.rejected] == [(whole + 1, True)]
        (row,) = db.sql("SELECT record, record_bytes, record_sha256 FROM rejects").to_pylist()
        assert row == {"record": partial[:100].decode(), "record_bytes": None, "record_sha256": None}


def test_a_zst_cut_short_aborts_strict_and_whole_file_ingests(tmp_path, scanner):
    data, ends = zst_frames(GOOD_LINES[:4])
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[: ends[2] + 5])
    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        db.ingest(write_lines(tmp_path / "first.jsonl", [GOOD_LINES[9]]))
        before = content(db)
        with pytest.raises(IngestAborted) as aborted:
            db.ingest(path, strict=True)
        assert f"{path}:4" in str(aborted.value) and "truncated" in str(aborted.value)
        assert content(db) == before
        with pytest.raises(InputError) as refused:
            db.ingest(path, whole_files=True)
        assert (refused.value.file, refused.value.line) == (str(path), 4)
        assert content(db) == before


@pytest.mark.parametrize("damage", ["garbage", "text", "garbage-after-frames"])
def test_a_corrupt_zst_is_reported_and_the_other_files_are_ingested(tmp_path, scanner, damage):
    runs = tmp_path / "runs"
    runs.mkdir()
    write_lines(runs / "a.traces.jsonl", GOOD_LINES[:2])
    bad = runs / "b.traces.jsonl.zst"
    kept = 0
    if damage == "garbage":
        bad.write_bytes(bytes(range(256)) * 8)
    elif damage == "text":
        write_lines(bad, GOOD_LINES[2:4])  # a text file named .zst
    else:
        frames, _ = zst_frames(GOOD_LINES[2:5])
        bad.write_bytes(frames + b"\x00garbage\xff" * 10)
        kept = 3
    write_lines(runs / "c.traces.jsonl", GOOD_LINES[5:7])
    with tracedb.connect(":memory:") as db:
        report = db.ingest(runs)
        assert report.files == 3 and report.traces == 4 + kept
        assert report.unreadable == [str(bad)]
        (reject,) = report.rejected
        assert (reject.file, reject.line) == (str(bad), kept + 1)
        assert "not valid zstd data" in reject.reason


def test_cec_records_in_a_zst_cut_short_keep_the_lines_before_the_cut(tmp_path):
    padded = [json.dumps({**trace_record(e["traces"][0]["id"]), "info": {"pad": "x" * 20_000}}) for e in EPISODES]
    cut, whole, partial = cut_inside_a_line(padded)
    path = tmp_path / "cec.jsonl.zst"
    path.write_bytes(cut)
    with tracedb.connect(":memory:") as db:
        assert db.ingest(GROUPS).ok
        report = ingest_records(db, path)
        assert report.added["trace"] == whole > 0
        (reject,) = report.rejected  # the cut line is lost whole: it is not read as a bad record
        assert (reject.file, reject.line) == (str(path), whole + 1) and "truncated" in reject.reason
        rows = db.sql("SELECT source, line, left(record, 40) AS start FROM rejects").to_pylist()
        assert rows == [{"source": str(path), "line": whole + 1, "start": partial[:40].decode()}]
        assert db.sql("SELECT count(*) AS n FROM cec_traces").column("n")[0].as_py() == whole


# --------------------------------------------------------------------------- repeated keys: the last value


def _dup_cases() -> dict[str, str]:
    e = copy.deepcopy(BASE)
    node = e["traces"][0]["nodes"][2]
    n, k = len(node["token_ids"]), sum(node["mask"])
    node["x_node"] = 1
    e["traces"][0]["ok"] = True
    e["traces"][0]["x_trace"] = 1
    e["x_episode"] = 1
    text = json.dumps(e)
    message = json.dumps(node["message"])
    at_node, at_trace, at_episode = '"x_node": 1', '"x_trace": 1', '"x_episode": 1'
    other = json.loads(GOOD_LINES[0])
    return {
        "node-parent": inserted_after(text, at_node, ', "parent": 0'),
        "node-sampled": inserted_after(text, at_node, ', "sampled": false'),
        "node-timestamp": inserted_after(text, at_node, ', "timestamp": 12.5'),
        "node-logprobs": inserted_after(text, at_node, ', "logprobs": ' + json.dumps([-0.25] * k)),
        "node-advantages": inserted_after(
            text, at_node, ', "advantages": [1.0], "x_a": 0, "advantages": ' + json.dumps([0.5] * k)
        ),
        "node-loss-weights": inserted_after(
            text, at_node, f', "loss_weights": {{"w": {json.dumps([1.0] * n)}, "w": {json.dumps([0.5] * n)}}}'
        ),
        "node-unknown-field": inserted_after(text, at_node, ', "x_node": {"k": 1, "k": [2]}'),
        "message-role": text.replace(message, message[:-1] + ', "role": "tool"}'),
        "message-nested": text.replace(message, message[:-1] + ', "x": {"y": 1, "y": 2}}'),
        "trace-ok": inserted_after(text, at_trace, ', "ok": false'),
        "trace-id": inserted_after(text, at_trace, ', "id": "the-last-trace-id"'),
        "trace-rewards": inserted_after(text, at_trace, ', "rewards": {"r": {"score": 0.0, "score": 1.0}}'),
        "trace-metrics": inserted_after(text, at_trace, ', "metrics": {"a": 1, "b": {"c": 1, "c": 2}, "a": 2}'),
        "trace-nodes": inserted_after(text, at_trace, ', "nodes": ' + json.dumps(other["traces"][0]["nodes"])),
        "episode-id": inserted_after(text, at_episode, ', "id": "the-last-episode-id"'),
        "episode-metadata": inserted_after(text, at_episode, ', "x_episode": {"z": [1], "z": [2, 3]}'),
        "episode-traces": inserted_after(text, at_episode, ', "traces": ' + json.dumps(other["traces"])),
    }


DUP_CASES = _dup_cases()


@pytest.mark.parametrize("case", list(DUP_CASES))
def test_a_repeated_key_means_its_last_value(tmp_path, scanner, case):
    line = DUP_CASES[case]
    want = json.loads(line)
    assert first_wins(line) != want  # the case tells first from last
    path = write_lines(tmp_path / "dup.jsonl", [line])
    with tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        assert report.ok, report.rejected
        assert db.episode(want["id"]) == want
        assert db.sql("SELECT episode_id FROM episodes").to_pylist() == [{"episode_id": want["id"]}]
        for t in want["traces"]:
            assert db.trace(t["id"]) == t
            row = db.sql("SELECT ok, reward FROM traces WHERE trace_id = ?", [t["id"]]).to_pylist()
            assert row == [{"ok": t.get("ok", False), "reward": trace_reward(t.get("rewards"))}]
            nodes = db.sql(
                'SELECT parent, role, sampled, "timestamp" FROM nodes WHERE trace_id = ? ORDER BY node_index', [t["id"]]
            ).to_pylist()
            assert nodes == [
                {
                    "parent": nd.get("parent"),
                    "role": nd["message"].get("role"),
                    "sampled": nd.get("sampled"),
                    "timestamp": nd.get("timestamp"),
                }
                for nd in t["nodes"]
            ]


# --------------------------------------------------------------------------- non-finite numbers, beyond float32

STREAMS = [*COMPACT_STREAMS, "loss_weights"]


def stream_line(stream: str, literal: str) -> str:
    """``linear`` with value 3 of node 2's ``stream`` written as ``literal``."""

    def mutate(e: dict[str, Any]) -> None:
        node = e["traces"][0]["nodes"][2]
        if stream == "loss_weights":
            node["loss_weights"] = {"w": [1.0] * len(node["token_ids"])}
            node["loss_weights"]["w"][3] = PLACEHOLDER
        else:
            node[stream] = [-0.5] * sum(node["mask"])
            node[stream][3] = PLACEHOLDER

    return with_literal(episode_with(mutate), literal)


def scalar_line(where: str, literal: str) -> str:
    """``linear`` with a reward score or weight, node 2's timestamp or a trace metric written as ``literal``."""

    def mutate(e: dict[str, Any]) -> None:
        trace = e["traces"][0]
        if where == "score":
            trace["rewards"] = {"r": {"score": PLACEHOLDER, "weight": 1.0}}
        elif where == "weight":
            trace["rewards"] = {"r": {"score": 1.0, "weight": PLACEHOLDER}}
        elif where == "timestamp":
            trace["nodes"][2]["timestamp"] = PLACEHOLDER
        else:
            trace["metrics"] = {"m": PLACEHOLDER}

    return with_literal(episode_with(mutate), literal)


def the_one_reject(tmp_path: Path, line: str) -> Any:
    path = between_good_lines(tmp_path, line)
    with tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        assert report.traces == 2 and stored_ids(db) == good_ids()
        (reject,) = report.rejected
        assert (reject.file, reject.line, reject.trace_id) == (str(path), 2, BASE_TRACE)
        return reject


@pytest.mark.parametrize("literal", ["NaN", "-Infinity"])
@pytest.mark.parametrize("stream", STREAMS)
def test_a_non_finite_stream_value_is_rejected_naming_field_and_position(tmp_path, scanner, stream, literal):
    reject = the_one_reject(tmp_path, stream_line(stream, literal))
    assert reject.node == 2
    assert reject.field == ("loss_weights.w.3" if stream == "loss_weights" else f"{stream}.3")
    assert "finite" in reject.reason


@pytest.mark.parametrize("literal", ["-1e39", "3.5e38", "1e400"])
@pytest.mark.parametrize("stream", STREAMS)
def test_a_stream_value_beyond_float32_is_rejected_naming_field_and_position(tmp_path, scanner, stream, literal):
    reject = the_one_reject(tmp_path, stream_line(stream, literal))
    assert reject.node == 2
    assert reject.field == ("loss_weights.w.3" if stream == "loss_weights" else f"{stream}.3")
    if literal != "1e400":  # a double itself: "outside the float32 range"; 1e400 reads as infinity
        assert "position 3" in reject.reason and "float32" in reject.reason


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize("where", ["score", "weight", "timestamp"])
def test_a_non_finite_reward_or_timestamp_is_rejected_naming_the_field(tmp_path, scanner, where, literal):
    reject = the_one_reject(tmp_path, scalar_line(where, literal))
    want = {"score": (None, "rewards.r.score"), "weight": (None, "rewards.r.weight"), "timestamp": (2, "timestamp")}
    assert (reject.node, reject.field) == want[where]
    assert "finite" in reject.reason


FREE_FORM = {
    "metrics": (lambda t: t.__setitem__("metrics", {"turns": 5.0, "m": PLACEHOLDER}), None, "metrics.m"),
    "info-nested": (lambda t: t.__setitem__("info", {"a": [{"b": [0, PLACEHOLDER]}]}), None, "info.a.0.b.1"),
    "timing": (lambda t: t.__setitem__("timing", {"agent": {"end": PLACEHOLDER}}), None, "timing.agent.end"),
    "message": (lambda t: t["nodes"][2]["message"].__setitem__("x_score", PLACEHOLDER), 2, "message.x_score"),
    "unknown-node-field": (lambda t: t["nodes"][1].__setitem__("x_note", [PLACEHOLDER]), 1, "x_note.0"),
}


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e400"])
@pytest.mark.parametrize("where", list(FREE_FORM))
def test_a_non_finite_number_in_free_form_json_is_rejected_naming_its_path(tmp_path, scanner, where, literal):
    """verifiers never writes a NaN or an infinity (pydantic writes null); one kept in a
    record came back from ``tracedb trace`` as ``NaN``, which no strict JSON reader takes."""
    mutate, node, field = FREE_FORM[where]
    reject = the_one_reject(tmp_path, with_literal(episode_with(lambda e: mutate(e["traces"][0])), literal))
    assert (reject.node, reject.field) == (node, field)
    assert reason_is_finite(reject.reason)


def reason_is_finite(reason: str) -> bool:
    return reason.startswith("Input should be a finite number (got ")


def test_a_non_finite_number_in_an_episode_field_is_rejected(tmp_path, scanner):
    line = with_literal(episode_with(lambda e: e.__setitem__("task", {"data": {"w": PLACEHOLDER}})), "NaN")
    path = between_good_lines(tmp_path, line)
    with tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        (reject,) = report.rejected
        assert (reject.line, reject.trace_id, reject.node, reject.field) == (2, None, None, "task.data.w")
        assert reason_is_finite(reject.reason) and stored_ids(db) == good_ids()


SCAN_CASES = {
    **{f"{s}-{x}": stream_line(s, x) for s in ("logprobs", "entropies") for x in ("NaN", "-1e39", "3.5e38", "1e400")},
    **{f"timestamp-{x}": scalar_line("timestamp", x) for x in ("NaN", "-Infinity", "1e400")},
    **{f"score-{x}": scalar_line("score", x) for x in ("Infinity", "1e400")},
}


@pytest.mark.parametrize("case", list(SCAN_CASES))
def test_the_scanner_sends_only_the_bad_line_to_the_parser(tmp_path, case):
    path = write_lines(tmp_path / "scan.jsonl", [GOOD_LINES[0], SCAN_CASES[case], GOOD_LINES[1], GOOD_LINES[2]])
    chunks = list(read_chunks(path))
    assert len(chunks) == 1
    _, lines = scan_chunk(chunks[0])
    assert [line is not None for line in lines] == [True, False, True, True]


# --------------------------------------------------------------------------- lines over the size limit


def test_a_line_over_the_limit_is_rejected_and_its_neighbours_ingested(tmp_path, scanner, knobs):
    knobs(max_line_bytes=10_000, reject_record_bytes=100)
    long_line = GOOD_LINES[4]
    assert len(GOOD_LINES[1]) < 10_000 < len(long_line) and len(GOOD_LINES[5]) < 10_000
    path = write_lines(tmp_path / "long.jsonl", [GOOD_LINES[1], long_line, GOOD_LINES[5]])
    with tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        assert (report.lines, report.traces) == (3, 2)
        (reject,) = report.rejected
        assert (reject.file, reject.line) == (str(path), 2)
        assert f"{len(long_line)} bytes" in reject.reason and "limit of 10000 bytes" in reject.reason
        (row,) = db.sql("SELECT record, record_bytes, record_sha256 FROM rejects").to_pylist()
        assert row == {
            "record": long_line[:100],
            "record_bytes": len(long_line),
            "record_sha256": hashlib.sha256(long_line.encode()).hexdigest(),
        }


@pytest.mark.parametrize("newline_at_end", [True, False])
def test_a_line_spanning_many_read_blocks_is_read_past(tmp_path, scanner, knobs, newline_at_end):
    knobs(max_line_bytes=200_000, chunk_bytes=1, reject_record_bytes=1000)  # read blocks of 64 KiB
    garbage = b"0123456789abcdef{[" * 55_556  # 1 MB, no line break inside
    last = [] if newline_at_end else [garbage]
    path = write_lines(
        tmp_path / "long.jsonl", [GOOD_LINES[0], garbage, GOOD_LINES[1], *last], newline_at_end=newline_at_end
    )
    with tracedb.connect(":memory:") as db:
        report = db.ingest(path)
        assert report.traces == 2 and stored_ids(db) == good_ids()
        numbers = [2] if newline_at_end else [2, 4]
        assert [r.line for r in report.rejected] == numbers
        for reject in report.rejected:
            assert f"line of {len(garbage)} bytes" in reject.reason and "limit of 200000 bytes" in reject.reason
        rows = db.sql("SELECT line, record, record_bytes FROM rejects ORDER BY line").to_pylist()
        assert rows == [{"line": n, "record": garbage[:1000].decode(), "record_bytes": len(garbage)} for n in numbers]


def test_a_line_over_the_limit_aborts_a_strict_ingest(tmp_path, scanner, knobs):
    knobs(max_line_bytes=10_000)
    path = write_lines(tmp_path / "long.jsonl", [GOOD_LINES[1], GOOD_LINES[4]])
    with tracedb.connect(":memory:") as db:
        with pytest.raises(IngestAborted, match="over the limit of 10000 bytes"):
            db.ingest(path, strict=True)
        assert db.stats()["traces"] == 0


def test_a_json_file_over_the_limit_is_rejected(tmp_path, scanner, knobs):
    record = json.dumps(json.loads(GOOD_LINES[4]), indent=1)
    big = tmp_path / "big.json"
    big.write_text(record)
    small = tmp_path / "small.json"
    small.write_text(GOOD_LINES[5])
    knobs(max_line_bytes=len(record) - 1, reject_record_bytes=50)
    with tracedb.connect(":memory:") as db:
        report = db.ingest([big, small])
        assert report.traces == 1
        (reject,) = report.rejected
        assert (reject.file, reject.line) == (str(big), 1)
        assert f"{len(record)} bytes" in reject.reason and f"limit of {len(record) - 1} bytes" in reject.reason
        (row,) = db.sql("SELECT record, record_bytes, record_sha256 FROM rejects").to_pylist()
        # never read whole (only its first bytes, for the reject): no digest of it
        assert row == {"record": record[:50], "record_bytes": len(record), "record_sha256": None}
