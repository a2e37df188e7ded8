"""The follower (``tracedb.ingest.follow``), in process: whole lines only, positions kept
with the lines, new files, files that shrink, are replaced or rewritten, compressed files
that settle, rejects once, the byte budget, and a restart that continues where it ended."""

from __future__ import annotations

import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import zstandard

import tracedb
from tracedb import runtime
from tracedb.ingest.follow import Follower, follow_positions

from support import FIXTURES
from support.ingested import all_episodes, renamed

GROUPS = FIXTURES / "groups.traces.jsonl"


def lines_of(episodes: list[dict[str, Any]]) -> list[bytes]:
    return [(json.dumps(e) + "\n").encode() for e in episodes]


def distinct(n: int, tag: str = "") -> list[bytes]:
    """``n`` lines of episodes with ids of their own (copies of every fixture episode)."""
    base = all_episodes()
    return lines_of([renamed(base[i % len(base)], f"-{tag}{i}") for i in range(n)])


def offline(paths: list[Path]) -> tracedb.Database:
    db = tracedb.connect(":memory:")
    db.ingest(paths)
    return db


def same_data(a: tracedb.Database, b: tracedb.Database) -> None:
    """Equal traces, nodes, segments, branches and views (sequence numbers aside)."""
    for table, key in (("traces", "trace_id"), ("nodes", "trace_id, node_index"), ("segments", "segment_id")):
        query = f"SELECT * EXCLUDE (ingested_at, seq, source, line) FROM {table} ORDER BY {key}"
        if table != "traces":
            query = f"SELECT * FROM {table} ORDER BY {key}"
        assert a.sql(query).equals(b.sql(query)), table
    assert a.branches().equals(b.branches())


@pytest.fixture
def db() -> tracedb.Database:
    with tracedb.connect(":memory:") as db:
        yield db


def test_lines_cut_anywhere_are_taken_once_whole(db: tracedb.Database, tmp_path: Path) -> None:
    data = GROUPS.read_bytes().replace(b"\n", b"\r\n", 3) + b"\n\n"  # some CRLF, a blank line at the end
    path = tmp_path / "traces.jsonl"
    follower = Follower(db.handle, [tmp_path], settle=0)
    rng = random.Random(7)
    at = 0
    with open(path, "wb") as f:
        while at < len(data):
            step = rng.choice([1, 7, 300, 5000, 40000])
            f.write(data[at : at + step])
            f.flush()
            at += step
            follower.poll()
            (position,) = follow_positions(db.handle) or [None]
            if position is not None:  # always the end of a whole line
                assert data[position.offset - 1 : position.offset] == b"\n"
                assert data[: position.offset].count(b"\n") == position.line
    follower.poll()
    assert db.stats()["rejects"] == 0
    same_data(db, offline([path]))
    assert follower.report.traces == 32 and follower.report.watermark == 32
    assert sorted(r[0] for r in db.con.execute("SELECT seq FROM traces").fetchall()) == list(range(1, 33))


def test_a_line_without_its_break_waits(db: tracedb.Database, tmp_path: Path) -> None:
    first, second = distinct(2)
    path = tmp_path / "traces.jsonl"
    path.write_bytes(first + second[:-1])  # the writer is in the middle of the second line's break
    follower = Follower(db.handle, [path], settle=0)
    assert follower.poll() is not None
    assert db.stats()["traces"] == 1
    assert follower.poll() is None  # nothing whole is new: no transaction at all
    with open(path, "ab") as f:
        f.write(b"\n")
    report = follower.poll()
    assert report is not None and report.traces == 1 and db.watermark() == 2
    (position,) = follow_positions(db.handle)
    assert (position.offset, position.line) == (len(first + second), 2)


def test_new_files_in_a_run_directory_are_picked_up(db: tracedb.Database, tmp_path: Path) -> None:
    run = tmp_path / "run"
    follower = Follower(db.handle, [run], settle=0)  # not there yet: nothing, no error
    assert follower.poll() is None
    lines = distinct(6)
    (run / "a").mkdir(parents=True)
    (run / "a" / "traces.jsonl").write_bytes(b"".join(lines[:2]))
    (run / "notes.txt").write_text("not a trace file")
    follower.poll()
    (run / "b" / "deep").mkdir(parents=True)
    (run / "b" / "deep" / "traces.jsonl").write_bytes(b"".join(lines[2:4]))
    (run / "a" / "traces.jsonl").open("ab").write(b"".join(lines[4:]))
    follower.poll()
    paths = sorted(p.path for p in follow_positions(db.handle))
    assert paths == [str(run / "a" / "traces.jsonl"), str(run / "b" / "deep" / "traces.jsonl")]
    assert db.stats()["traces"] == 6
    same_data(db, offline([run]))


def test_a_restart_continues_where_the_last_commit_ended(tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    lines = distinct(5)
    bad = b'{"id": "broken", "traces": [\n'
    path.write_bytes(lines[0] + bad + lines[1])
    db_path = tmp_path / "runs.duckdb"
    with tracedb.connect(db_path) as db:
        Follower(db.handle, [path], settle=0).poll()
        assert (db.stats()["traces"], db.stats()["rejects"]) == (2, 1)
    with open(path, "ab") as f:
        f.write(b"".join(lines[2:]))
    with tracedb.connect(db_path) as db:  # a new process, as far as the follower knows
        follower = Follower(db.handle, [path], settle=0)
        report = follower.poll()
        assert report is not None and report.lines == 3 and report.skipped == 0
        assert (db.stats()["traces"], db.stats()["rejects"]) == (5, 1)  # the bad line is not read again
        assert follower.poll() is None
        (reject,) = db.sql("SELECT source, line FROM rejects").to_pylist()
        assert reject == {"source": str(path.absolute()), "line": 2}
        assert db.sql("SELECT line FROM traces ORDER BY seq").column("line").to_pylist() == [1, 3, 4, 5, 6]


def test_a_failed_commit_moves_no_position(db: tracedb.Database, tmp_path: Path, monkeypatch) -> None:
    path = tmp_path / "traces.jsonl"
    path.write_bytes(b"".join(distinct(3)))
    follower = Follower(db.handle, [path], settle=0)

    def broken(*args: Any) -> None:
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(follower, "_store", broken)
    with pytest.raises(OSError, match="simulated"):
        follower.poll()
    assert (db.stats()["traces"], db.watermark(), follow_positions(db.handle)) == (0, 0, [])
    monkeypatch.undo()
    follower.poll()
    assert db.stats()["traces"] == 3 and db.watermark() == 3


@pytest.mark.parametrize("how", ["shrunk", "replaced", "rewritten"])
def test_a_file_that_shrinks_or_is_replaced_is_read_again_from_its_start(
    db: tracedb.Database, tmp_path: Path, how: str
) -> None:
    path = tmp_path / "traces.jsonl"
    before, after = distinct(4, "old"), distinct(3, "new")
    path.write_bytes(b"".join(before))
    follower = Follower(db.handle, [path], settle=0)
    follower.poll()
    if how == "shrunk":
        path.write_bytes(b"".join(after[:1]) + before[0])  # smaller than what was read
    elif how == "replaced":
        other = tmp_path / "new.part"
        other.write_bytes(b"".join(after) + b"".join(before))
        os.replace(other, path)  # another inode, and larger
    else:
        data = bytearray(b"".join(before) + after[0])
        data[2:4] = b"ID"  # the same file, its first bytes changed ("id" -> "ID"), grown
        path.write_bytes(bytes(data))
    follower.poll()
    (message,) = follower.report.restarts
    assert str(path.absolute()) in message and "read again from its start" in message
    assert {"shrunk": "shrunk", "replaced": "replaced", "rewritten": "rewritten"}[how] in message
    ids = set(db.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist())
    old = {json.loads(x)["traces"][0]["id"] for x in before}
    assert old <= ids  # what the file held before stays
    (position,) = follow_positions(db.handle)
    assert position.offset == path.stat().st_size and position.inode == path.stat().st_ino
    assert follower.poll() is None  # and the new content is not read a third time


def zst(lines: list[bytes]) -> bytes:
    return zstandard.ZstdCompressor().compress(b"".join(lines))


def test_a_compressed_file_is_taken_once_whole_and_settled(db: tracedb.Database, tmp_path: Path) -> None:
    lines = distinct(6)
    path = tmp_path / "part.jsonl.zst"
    frame = zst(lines[:4])
    path.write_bytes(frame[: len(frame) // 2])  # a frame still being written
    follower = Follower(db.handle, [tmp_path], settle=0.3)
    assert follower.poll() is None
    assert "not changed" in follower.report.waiting[str(path.absolute())]
    time.sleep(0.35)
    assert follower.poll() is None  # settled, but its frame is cut: waited for, not rejected
    assert "inside a zstd frame" in follower.report.waiting[str(path.absolute())]
    assert db.stats()["rejects"] == 0
    path.write_bytes(frame)
    assert follower.poll() is None  # changed just now: settling again
    time.sleep(0.35)
    report = follower.poll()
    assert report is not None and report.traces == 4 and not follower.report.waiting
    assert follower.poll() is None
    with open(path, "ab") as f:  # another frame appended: its lines only
        f.write(zst(lines[4:]))
    time.sleep(0.35)
    follower.poll()
    time.sleep(0.35)
    report = follower.poll()
    assert report is not None and (report.traces, report.skipped, report.lines) == (2, 0, 2)
    same_data(db, offline([path]))


def test_a_damaged_compressed_file_is_rejected_once(db: tracedb.Database, tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl.zst"
    path.write_bytes(b"this is not zstd at all\n")
    follower = Follower(db.handle, [path], settle=0)
    follower.poll()
    assert db.stats()["rejects"] == 1
    assert "zstd" in db.sql("SELECT reason FROM rejects").column("reason")[0].as_py()
    follower.poll()
    follower.poll()
    assert db.stats()["rejects"] == 1


def test_a_backlog_is_committed_in_steps_of_the_byte_budget(db: tracedb.Database, tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    lines = distinct(40)
    path.write_bytes(b"".join(lines))
    commits: list[int] = []
    with runtime.configure(follow_batch_bytes=len(lines[0]) * 5, max_line_bytes=max(map(len, lines))):
        follower = Follower(db.handle, [path], settle=0, on_commit=lambda r: commits.append(r.traces))
        stop = threading.Event()
        started = time.monotonic()
        follower.run(stop, until_idle=True)
    assert len(commits) >= 4 and sum(commits) == 40
    assert time.monotonic() - started < 0.25 * len(commits)  # a poll cut short is followed at once
    same_data(db, offline([path]))


def test_tags_are_stored_on_what_a_follower_adds(db: tracedb.Database, tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    path.write_bytes(GROUPS.read_bytes())
    Follower(db.handle, [path], settle=0, tags=["step=7", "group=$.group.id"]).poll()
    rows = db.sql("SELECT name, count(*) AS n FROM trace_tags GROUP BY name ORDER BY name").to_pylist()
    assert rows == [{"name": "group", "n": 32}, {"name": "step", "n": 32}]
    assert db.branches(tags={"step": 7, "group": "group-2"}).num_rows == db.branches(group="group-2").num_rows


def test_run_stops_when_asked_and_readers_see_each_commit(db: tracedb.Database, tmp_path: Path) -> None:
    path = tmp_path / "traces.jsonl"
    path.write_bytes(b"")
    follower = Follower(tracedb.Database.on(db.handle.child()).handle, [path], interval=0.05, settle=0)
    stop = threading.Event()
    thread = threading.Thread(target=follower.run, args=(stop,))
    thread.start()
    try:
        seen = 0
        for line in distinct(5):
            with open(path, "ab") as f:
                f.write(line)
            started = time.monotonic()
            mark = db.wait(seen, 5.0)
            assert mark == seen + 1 and time.monotonic() - started < 1.0  # visible within a second
            seen = mark
    finally:
        stop.set()
        thread.join(5)
    assert not thread.is_alive()


def test_bad_arguments_are_refused(db: tracedb.Database, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="interval"):
        Follower(db.handle, [tmp_path], interval=0)
    with pytest.raises(ValueError, match="--tag"):
        Follower(db.handle, [tmp_path], tags=["no equals sign"])
