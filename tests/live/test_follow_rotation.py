"""The follower's identity rule and rotations (``tracedb.ingest.follow``, issue 22 items 1
and 2), driven poll by poll: a file cut back and grown again past its position, renamed
away (to ``traces.jsonl.1``, to any name, out of its directory, inside a followed
directory), copied and truncated (logrotate ``copytruncate``, with and without lines
written between the copy and the truncation), deleted, rotated twice between polls. Each
ends with exact counts: traces stored, rejects (none bogus), restarts, rotations, bytes
and lines reported lost; and what a poll costs in bytes read."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

import tracedb
from tracedb.ingest import rotation
from tracedb.ingest.follow import Follower, follow_positions

from support.ingested import all_episodes, one_episode, renamed

SMALL = one_episode("empty_tokens")  # 1.7 KB a line
LARGE = one_episode("subagent_fork")  # 11 KB a line


def lines(n: int, tag: str, base: dict[str, Any] | None = None) -> list[bytes]:
    """``n`` lines of episodes with ids of their own."""
    episodes = [base] * n if base is not None else [all_episodes()[i % 44] for i in range(n)]
    return [(json.dumps(renamed(e, f"-{tag}{i}")) + "\n").encode() for i, e in enumerate(episodes)]


def append(path: Path, data: list[bytes] | bytes) -> None:
    with open(path, "ab") as f:
        f.write(data if isinstance(data, bytes) else b"".join(data))


def ids(data: list[bytes]) -> list[str]:
    return [json.loads(x)["traces"][0]["id"] for x in data]


def stored(db: tracedb.Database) -> list[str]:
    """The trace ids stored, in the order they were numbered."""
    return db.sql("SELECT trace_id FROM traces ORDER BY seq").column("trace_id").to_pylist()


def rejects(db: tracedb.Database) -> int:
    return db.stats()["rejects"]


@pytest.fixture
def db() -> tracedb.Database:
    with tracedb.connect(":memory:") as db:
        yield db


@pytest.fixture
def follow(db: tracedb.Database):
    """Followers on ``db``, closed after the test."""
    made: list[Follower] = []

    def make(paths: list[Path], **kw: Any) -> Follower:
        follower = Follower(db.handle, paths, settle=0, **kw)
        made.append(follower)
        return follower

    yield make
    for follower in made:
        follower.close()


# ----------------------------------------------------------------- truncate and regrow


def test_a_file_cut_back_and_grown_past_its_position_is_read_again_losing_nothing(db, follow, tmp_path):
    """The writer resumes from a checkpoint: the file is cut back to its first line and
    four new lines are appended before the next poll, past the old offset."""
    path = tmp_path / "traces.jsonl"
    # The first line is over 4 KiB: the first bytes' hash alone does not see the cut.
    old, new = lines(1, "first", LARGE) + lines(16, "old", SMALL), lines(4, "new", LARGE)
    path.write_bytes(b"".join(old))
    follower = follow([path])
    assert follower.poll().traces == 17
    offset = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(len(old[0]))
    append(path, new)
    assert path.stat().st_size > offset  # grown past the position: its size alone says nothing
    report = follower.poll()
    assert report is not None and (report.traces, report.skipped, report.rejected) == (4, 1, [])
    assert stored(db) == ids(old) + ids(new)  # 21 traces, none lost
    assert rejects(db) == 0  # no bogus "not valid JSON" from reading on mid-line
    (message,) = follower.report.restarts
    assert str(path) in message and "read again from its start" in message and "rewritten" in message
    assert follower.report.lost == [] and follower.report.rotations == []
    (position,) = follow_positions(db.handle)
    assert (position.offset, position.line) == (path.stat().st_size, 5)
    assert follower.poll() is None  # and not a third time


def test_the_identity_rule_holds_for_a_position_within_the_first_4_kib(db, follow, tmp_path):
    """Cut back and regrown where head and tail hashes cover the same bytes."""
    path = tmp_path / "traces.jsonl"
    path.write_bytes(lines(1, "a", SMALL)[0])
    follower = follow([path])
    follower.poll()
    new = lines(3, "b", SMALL)
    path.write_bytes(b"".join(new))  # same inode, other first bytes, larger
    follower.poll()
    assert len(follower.report.restarts) == 1 and stored(db)[1:] == ids(new) and rejects(db) == 0


def test_a_rewrite_between_polls_that_keeps_the_bytes_is_no_restart(db, follow, tmp_path):
    path = tmp_path / "traces.jsonl"
    data = lines(5, "same", SMALL)
    path.write_bytes(b"".join(data[:3]))
    follower = follow([path])
    follower.poll()
    path.write_bytes(b"".join(data))  # truncated and written again with the same bytes, then more
    report = follower.poll()
    assert report is not None and (report.traces, report.skipped) == (2, 0)
    assert follower.report.restarts == []


def test_a_poll_reads_at_most_a_few_kib_of_a_file_that_did_not_change(db, follow, tmp_path, monkeypatch):
    run = tmp_path / "run"
    for k in range(20):
        (run / f"r{k}").mkdir(parents=True)
        (run / f"r{k}" / "traces.jsonl").write_bytes(b"".join(lines(4, f"c{k}-", LARGE)))  # 45 KB each
    follower = follow([run])
    assert follower.poll().traces == 80
    read: list[int] = []
    real = os.pread
    monkeypatch.setattr(os, "pread", lambda fd, n, at: read.append(n) or real(fd, n, at))
    assert follower.poll() is None
    assert 0 < sum(read) <= 20 * 2 * rotation.HASH_BYTES  # the two hashes of each file, nothing else
    monkeypatch.setattr(rotation.OpenFiles, "TRUST_S", 0.0)
    read.clear()
    assert follower.poll() is None
    assert sum(read) == 0  # unchanged since a check made after their last change: not hashed again
    append(run / "r3" / "traces.jsonl", lines(1, "more", LARGE))
    read.clear()
    assert follower.poll().traces == 1
    assert sum(read) <= 4 * rotation.HASH_BYTES + (1 << 16)  # the grown file: hashes, the look for a line break


# ----------------------------------------------------------------- renamed away


@pytest.mark.parametrize("how", ["held descriptor", "new follower"])
def test_a_rename_to_name_1_is_read_to_its_end_before_the_new_file(db, follow, tmp_path, how):
    """15 lines polled, 6 appended, then renamed to traces.jsonl.1 and a new traces.jsonl
    started; the new follower (a restart) finds the old file by its inode in the directory."""
    path = tmp_path / "traces.jsonl"
    first, between, after = lines(15, "a"), lines(6, "b"), lines(4, "c")
    path.write_bytes(b"".join(first))
    follower = follow([path])
    follower.poll()
    append(path, between)
    os.rename(path, tmp_path / "traces.jsonl.1")
    path.write_bytes(b"".join(after))
    if how == "new follower":
        follower = follow([path])
    follower.poll()
    assert stored(db) == ids(first) + ids(between) + ids(after)  # 25: the old file's end before the new one
    assert rejects(db) == 0 and follower.report.restarts == [] and follower.report.lost == []
    (message,) = follower.report.rotations
    assert str(path) in message and "renamed to traces.jsonl.1" in message
    positions = {Path(p.path).name: p for p in follow_positions(db.handle)}
    assert positions["traces.jsonl.1"].rotated_from == str(path)
    assert positions["traces.jsonl.1"].offset == (tmp_path / "traces.jsonl.1").stat().st_size
    assert positions["traces.jsonl"].offset == path.stat().st_size
    # The writer still had the old file open: what it writes there is still read, once.
    late = lines(2, "late")
    append(tmp_path / "traces.jsonl.1", late)
    follower.poll()
    assert stored(db)[-2:] == ids(late)
    assert follower.poll() is None
    # logrotate removes it at last: its position goes, quietly (it was read to its end).
    (tmp_path / "traces.jsonl.1").unlink()
    follower.poll()
    assert [Path(p.path).name for p in follow_positions(db.handle)] == ["traces.jsonl"]
    assert len(follower.report.rotations) == 1 and follower.report.lost == []


@pytest.mark.parametrize("target", ["traces.old", "archive-2024.txt", ".hidden"])
def test_any_rename_in_its_directory_is_followed(db, follow, tmp_path, target):
    path = tmp_path / "traces.jsonl"
    first, between = lines(15, "a"), lines(6, "b")
    path.write_bytes(b"".join(first))
    follower = follow([path])
    follower.poll()
    append(path, between)
    os.rename(path, tmp_path / target)  # nothing takes its name
    follower.poll()
    assert stored(db) == ids(first) + ids(between) and rejects(db) == 0
    (message,) = follower.report.rotations
    assert f"renamed to {target}" in message
    after = lines(3, "c")
    path.write_bytes(b"".join(after))  # the writer starts a new one later
    follower.poll()
    assert stored(db)[-3:] == ids(after) and len(stored(db)) == 24


def test_a_file_moved_out_of_its_directory_is_read_through_the_descriptor(db, follow, tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "elsewhere").mkdir()
    path = tmp_path / "run" / "traces.jsonl"
    first, between = lines(5, "a"), lines(3, "b")
    path.write_bytes(b"".join(first))
    follower = follow([path])
    follower.poll()
    append(path, between)
    os.rename(path, tmp_path / "elsewhere" / "traces.jsonl")
    follower.poll()
    assert stored(db) == ids(first) + ids(between)
    (message,) = follower.report.rotations
    assert "moved out of" in message and str(path) in message
    assert follow_positions(db.handle) == []


def test_a_rename_inside_a_followed_directory_keeps_the_position(db, follow, tmp_path):
    """Renamed to traces.1.jsonl, a name the directory's listing takes: followed there, from
    its position (not read again from its start)."""
    run = tmp_path / "run"
    run.mkdir()
    path = run / "traces.jsonl"
    first, between, after = lines(15, "a"), lines(6, "b"), lines(3, "c")
    path.write_bytes(b"".join(first))
    follower = follow([run])
    follower.poll()
    append(path, between)
    os.rename(path, run / "traces.1.jsonl")
    path.write_bytes(b"".join(after))
    report = follower.poll()
    assert report is not None and (report.traces, report.skipped) == (9, 0)
    assert stored(db) == ids(first) + ids(between) + ids(after) and rejects(db) == 0
    (message,) = follower.report.rotations
    assert "renamed to" in message and "traces.1.jsonl" in message and "line 16" in message
    names = sorted((Path(p.path).name, p.rotated_from) for p in follow_positions(db.handle))
    assert names == [("traces.1.jsonl", None), ("traces.jsonl", None)]


# ----------------------------------------------------------------- copytruncate


def copytruncate(path: Path, copy: Path) -> None:
    """What logrotate's copytruncate does: copy the file, then cut it to nothing."""
    shutil.copyfile(path, copy)
    with open(path, "r+b") as f:
        f.truncate(0)


def test_copytruncate_is_finished_from_the_copy(db, follow, tmp_path):
    """15 lines polled, 3 appended, copied to traces.jsonl.1 and truncated: 18 traces."""
    path = tmp_path / "traces.jsonl"
    first, between = lines(15, "a"), lines(3, "b")
    path.write_bytes(b"".join(first))
    follower = follow([path])
    follower.poll()
    append(path, between)
    copytruncate(path, tmp_path / "traces.jsonl.1")
    follower.poll()
    assert stored(db) == ids(first) + ids(between) and rejects(db) == 0
    (message,) = follower.report.rotations
    assert "copied to traces.jsonl.1 and truncated" in message and "lines 16.." in message
    assert "cannot be seen" in message  # what may have been written between the copy and the truncation
    assert follower.report.restarts == [] and follower.report.lost == []
    after = lines(2, "c")
    append(path, after)
    follower.poll()
    assert stored(db)[-2:] == ids(after) and len(stored(db)) == 20
    (position,) = follow_positions(db.handle)  # the copy is not followed: it does not grow
    assert Path(position.path) == path and position.line == 2


def test_copytruncate_with_a_line_cut_by_the_copy_reports_the_loss(db, follow, tmp_path):
    """The writer was in the middle of a line when the copy was made, finished it and wrote
    another before the truncation: both are in neither file; the part of the first that the
    copy holds is reported lost (bytes and line), not rejected."""
    path = tmp_path / "traces.jsonl"
    first, between, cut, lost, after = lines(15, "a"), lines(3, "b"), *lines(2, "x"), lines(2, "c")
    path.write_bytes(b"".join(first))
    follower = follow([path])
    follower.poll()
    append(path, b"".join(between) + cut[:1000])
    shutil.copyfile(path, tmp_path / "traces.jsonl.1")
    append(path, cut[1000:] + lost)  # between the copy and the truncation
    with open(path, "r+b") as f:
        f.truncate(0)
    append(path, after)
    follower.poll()
    assert stored(db) == ids(first) + ids(between) + ids(after) and rejects(db) == 0
    (loss,) = follower.report.lost
    assert (loss.file, loss.bytes, loss.lines) == (str(path), 1000, 1)
    assert "line 19 of" in loss.message and "traces.jsonl.1" in loss.message and "unfinished" in loss.message
    assert (follower.report.lost_bytes, follower.report.lost_lines) == (1000, 1)
    assert "LOST at least 1000 bytes" in str(follower.report)


def test_copytruncate_with_the_truncated_file_starting_inside_a_line(db, follow, tmp_path):
    """The copy ended at a line break; the writer was inside its next line when the file was
    cut: the truncated file starts with that line's end, lost (not a bogus reject)."""
    path = tmp_path / "traces.jsonl"
    first, between, (cut,), after = lines(5, "a"), lines(3, "b"), lines(1, "x"), lines(2, "c")
    path.write_bytes(b"".join(first))
    follower = follow([path])
    follower.poll()
    append(path, between)
    shutil.copyfile(path, tmp_path / "traces.jsonl.1")
    append(path, cut[:700])
    with open(path, "r+b") as f:
        f.truncate(0)
    append(path, cut[700:] + b"".join(after))
    follower.poll()
    assert stored(db) == ids(first) + ids(between) + ids(after) and rejects(db) == 0
    (loss,) = follower.report.lost
    assert (loss.bytes, loss.lines) == (len(cut) - 700 - 1, 1)  # the line's end, without its line break
    assert "line 1 of" in loss.message and "cut by the truncation" in loss.message


def test_copytruncate_to_a_configured_name(db, follow, tmp_path):
    (tmp_path / "old").mkdir()
    path = tmp_path / "traces.jsonl"
    first, between = lines(4, "a"), lines(3, "b")
    path.write_bytes(b"".join(first))
    follower = follow([path], rotated=["old/{stem}.prev"])
    follower.poll()
    append(path, between)
    copytruncate(path, tmp_path / "old" / "traces.prev")
    follower.poll()
    assert stored(db) == ids(first) + ids(between)
    assert "copied to traces.prev" in follower.report.rotations[0]


def test_a_copy_whose_bytes_differ_is_not_taken(db, follow, tmp_path):
    """A stale traces.jsonl.1 (another run's) does not hash to what was read: the cut file
    is read again from its start, and the stale copy's lines are not ingested."""
    path = tmp_path / "traces.jsonl"
    first, stale = lines(4, "a"), lines(6, "stale")
    path.write_bytes(b"".join(first))
    (tmp_path / "traces.jsonl.1").write_bytes(b"".join(stale))
    follower = follow([path])
    follower.poll()
    with open(path, "r+b") as f:
        f.truncate(0)
    follower.poll()
    assert stored(db) == ids(first)
    (message,) = follower.report.restarts
    assert "shrunk to 0 bytes" in message


def test_a_compressed_copy_is_named_in_the_restart(db, follow, tmp_path):
    """logrotate compress without delaycompress: the copy is gzipped before the follower
    looks; it is not read, and the restart says what that means."""
    path = tmp_path / "traces.jsonl"
    path.write_bytes(b"".join(lines(4, "a")))
    follower = follow([path])
    follower.poll()
    append(path, lines(2, "b"))
    (tmp_path / "traces.jsonl.1.gz").write_bytes(b"\x1f\x8b not read")
    with open(path, "r+b") as f:
        f.truncate(0)
    follower.poll()
    assert len(stored(db)) == 4 and rejects(db) == 0
    (message,) = follower.report.restarts
    assert "after line 4 before the truncation is not read" in message
    assert "traces.jsonl.1.gz: compressed, not read" in message


def test_bad_rotated_patterns_are_refused(db, tmp_path):
    with pytest.raises(ValueError, match=r"--rotated '\{nope\}'"):
        Follower(db.handle, [tmp_path], rotated=["{nope}"])


# ----------------------------------------------------------------- deleted


def test_a_file_deleted_while_followed_is_read_to_its_end(db, follow, tmp_path):
    path = tmp_path / "traces.jsonl"
    first, between = lines(10, "a"), lines(3, "b")
    path.write_bytes(b"".join(first))
    follower = follow([path])
    follower.poll()
    append(path, b"".join(between) + between[0][:500])  # and a line the writer never finished
    path.unlink()
    follower.poll()
    assert stored(db) == ids(first) + ids(between) and rejects(db) == 0
    (message,) = follower.report.rotations
    assert "deleted while followed" in message and str(path) in message
    (loss,) = follower.report.lost
    assert (loss.bytes, loss.lines) == (500, 1) and "line 14" in loss.message
    assert follow_positions(db.handle) == []


def test_a_file_deleted_while_no_follower_ran_is_reported(db, follow, tmp_path):
    path = tmp_path / "traces.jsonl"
    path.write_bytes(b"".join(lines(3, "a")))
    follow([path]).poll()
    path.unlink()
    follower = follow([path])  # started again after the file went: no descriptor on it
    assert follower.poll() is None
    (message,) = follower.report.rotations
    assert "gone" in message and "cannot be counted" in message
    assert follow_positions(db.handle) == [] and follower.report.lost == []


def test_an_unfinished_last_line_that_is_a_whole_record_is_taken(db, follow, tmp_path):
    """A deleted file whose last record lacks only its line break: ingested, not lost."""
    path = tmp_path / "traces.jsonl"
    first, (last,) = lines(2, "a"), lines(1, "b")
    path.write_bytes(b"".join(first))
    follower = follow([path])
    follower.poll()
    append(path, last[:-1])
    path.unlink()
    follower.poll()
    assert stored(db) == ids(first) + ids([last]) and follower.report.lost == []


# ----------------------------------------------------------------- twice between polls


def test_two_renames_between_polls_read_every_generation_in_order(db, follow, tmp_path):
    """traces.jsonl rotated twice (logrotate with rotate 2) between two polls: the file the
    follower knew is found by its inode (now traces.jsonl.2), the one in between by its
    rotated name and time; each is read to its end, oldest first."""
    path = tmp_path / "traces.jsonl"
    first, a, b, c = lines(5, "first"), lines(2, "a"), lines(3, "b"), lines(4, "c")
    path.write_bytes(b"".join(first))
    follower = follow([path])
    follower.poll()
    append(path, a)
    os.rename(path, tmp_path / "traces.jsonl.1")
    path.write_bytes(b"".join(b))
    os.rename(tmp_path / "traces.jsonl.1", tmp_path / "traces.jsonl.2")
    os.rename(path, tmp_path / "traces.jsonl.1")
    path.write_bytes(b"".join(c))
    follower.poll()
    assert stored(db) == ids(first) + ids(a) + ids(b) + ids(c) and rejects(db) == 0
    (message,) = follower.report.rotations
    assert "renamed to traces.jsonl.2" in message and "traces.jsonl.1: rotated in between" in message
    names = sorted((Path(p.path).name, p.rotated_from) for p in follow_positions(db.handle))
    assert names == [("traces.jsonl", None), ("traces.jsonl.1", str(path)), ("traces.jsonl.2", str(path))]


def test_two_copytruncates_between_polls_read_both_copies(db, follow, tmp_path):
    path = tmp_path / "traces.jsonl"
    first, a, b, c = lines(5, "first"), lines(2, "a"), lines(3, "b"), lines(4, "c")
    path.write_bytes(b"".join(first))
    follower = follow([path])
    follower.poll()
    append(path, a)
    copytruncate(path, tmp_path / "traces.jsonl.1")
    append(path, b)
    os.rename(tmp_path / "traces.jsonl.1", tmp_path / "traces.jsonl.2")
    copytruncate(path, tmp_path / "traces.jsonl.1")
    append(path, c)
    follower.poll()
    assert stored(db) == ids(first) + ids(a) + ids(b) + ids(c) and rejects(db) == 0
    (message,) = follower.report.rotations
    assert "copied to traces.jsonl.2" in message and "traces.jsonl.1: rotated in between" in message


def test_a_rotation_found_by_a_follower_started_later_in_a_directory(db, follow, tmp_path):
    """Rotated while no follower ran, in a followed directory: found by inode at start."""
    run = tmp_path / "run"
    run.mkdir()
    path = run / "traces.jsonl"
    first, between, after = lines(3, "a"), lines(2, "b"), lines(2, "c")
    path.write_bytes(b"".join(first))
    follow([run]).poll()
    append(path, between)
    os.rename(path, run / "traces.jsonl-20260101")
    path.write_bytes(b"".join(after))
    follower = follow([run])
    follower.poll()
    assert stored(db) == ids(first) + ids(between) + ids(after)
    assert "renamed to traces.jsonl-20260101" in follower.report.rotations[0]
