"""Live runs: ingest sequence numbers and the watermark, ``after=`` on every read
(traces, branches, iter_branches, export, micro_batches), ``complete_groups``, paging with
``limit``, exactly-once polling while ingests commit, and ``wait()``."""

from __future__ import annotations

import collections
import json
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tracedb
from tracedb import IngestAborted, watermark_of
from tracedb.ingest import IngestReport

from support import FIXTURES

GROUPS = FIXTURES / "groups.traces.jsonl"
LINEAR = FIXTURES / "linear.traces.jsonl"
FOREST = FIXTURES / "forest.traces.jsonl"
SUBAGENT = FIXTURES / "subagent_fork.traces.jsonl"
BAD_LINE = '{"id": "broken", "traces": ['
DEADLINE_S = 30.0


# --------------------------------------------------------------------------- helpers


def lines_of(path: Path) -> list[str]:
    """The non-empty lines of a JSONL file."""
    return [line for line in path.read_text().splitlines() if line.strip()]


def write_lines(path: Path, lines: Sequence[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines))
    return path


def ids_of(lines: Sequence[str]) -> list[str]:
    """The trace ids of JSONL lines in line order, then trace position order (lines that
    are not JSON hold none)."""
    out = []
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        out += [t["id"] for t in record["traces"]]
    return out


def group_of(line: str) -> str:
    return json.loads(line)["group"]["id"]


def renamed_line(line: str, suffix: str) -> str:
    """The line with fresh episode and trace ids (a distinct episode of the same group)."""
    record = json.loads(line)
    record["id"] += suffix
    for t in record["traces"]:
        t["id"] += suffix
    return json.dumps(record)


def seqs(db: tracedb.Database) -> dict[str, int]:
    """trace id -> sequence number, for every stored trace."""
    return {r["trace_id"]: r["seq"] for r in db.sql("SELECT trace_id, seq FROM traces").to_pylist()}


def in_seq_order(db: tracedb.Database) -> list[str]:
    return db.sql("SELECT trace_id FROM traces ORDER BY seq").column("trace_id").to_pylist()


def above(db: tracedb.Database, mark: int) -> list[str]:
    """The trace ids whose sequence number is above ``mark``, in sequence order."""
    rows = db.sql("SELECT trace_id FROM traces WHERE seq > ? ORDER BY seq", [mark])
    return rows.column("trace_id").to_pylist()


def column(table: pa.Table, name: str) -> list[Any]:
    return table.column(name).to_pylist()


def assert_watermark_consistent(db: tracedb.Database) -> None:
    """watermark() == max(seq) == stats()["watermark"], and seqs are exactly 1..n."""
    numbers = sorted(seqs(db).values())
    assert numbers == list(range(1, len(numbers) + 1))
    assert db.watermark() == (numbers[-1] if numbers else 0) == db.stats()["watermark"]


@pytest.fixture(scope="module")
def group_lines() -> list[str]:
    return lines_of(GROUPS)


@pytest.fixture(scope="module")
def live_db():
    """linear (seq 1), then groups (2..33), then forest (34): read-only use by the tests."""
    with tracedb.connect(":memory:") as db:
        for path in (LINEAR, GROUPS, FOREST):
            assert db.ingest(path).ok
        assert db.watermark() == 34
        yield db


# --------------------------------------------------------------------------- sequence numbers


def test_an_empty_database_has_watermark_zero(fresh_db):
    assert fresh_db.watermark() == 0 == fresh_db.stats()["watermark"]
    table = fresh_db.traces()
    assert table.num_rows == 0 and watermark_of(table) == 0
    assert fresh_db.traces(after=0).num_rows == 0


def test_one_ingest_numbers_its_traces_in_file_line_and_position_order(fresh_db, tmp_path, group_lines):
    # A line of three traces whose ids do not sort in position order.
    episode = json.loads(lines_of(LINEAR)[0])
    trace = episode["traces"][0]
    episode["traces"] = [dict(trace, id=tid) for tid in ("zz-first", "aa-second", "mm-third")]
    multi = json.dumps(episode)
    second = write_lines(tmp_path / "a_second.jsonl", [group_lines[5], multi, group_lines[2]])
    first = write_lines(tmp_path / "z_first.jsonl", [group_lines[9], group_lines[0]])
    report = fresh_db.ingest([first, second])  # the order given, not the names' order
    assert report.ok and report.traces == 7
    expected = ids_of([group_lines[9], group_lines[0], group_lines[5], multi, group_lines[2]])
    assert expected[3:6] == ["zz-first", "aa-second", "mm-third"]
    assert in_seq_order(fresh_db) == expected
    assert seqs(fresh_db) == {tid: i + 1 for i, tid in enumerate(expected)}
    assert report.watermark == 7
    assert_watermark_consistent(fresh_db)


def test_numbers_continue_across_the_flushes_of_one_ingest(fresh_db, tmp_path, group_lines, knobs):
    knobs(chunk_bytes=1, batch_tokens=1)  # a flush after every line
    lines = [group_lines[3], group_lines[1], group_lines[3], group_lines[7]]  # line 3 twice: skipped the 2nd time
    report = fresh_db.ingest(write_lines(tmp_path / "g.jsonl", lines))
    assert report.ok and (report.traces, report.skipped) == (3, 1)
    assert in_seq_order(fresh_db) == ids_of([group_lines[3], group_lines[1], group_lines[7]])
    assert report.watermark == 3
    assert_watermark_consistent(fresh_db)


def test_the_next_ingest_continues_and_skipped_traces_keep_their_numbers(fresh_db, tmp_path, group_lines):
    first = fresh_db.ingest(LINEAR)
    assert first.watermark == 1 and fresh_db.watermark() == 1
    (linear_id,) = ids_of(lines_of(LINEAR))

    mixed = write_lines(tmp_path / "mixed.jsonl", [group_lines[4], BAD_LINE, group_lines[0], "not json at all"])
    report = fresh_db.ingest([LINEAR, mixed])
    assert [r.line for r in report.rejected] == [2, 4]
    assert (report.traces, report.skipped) == (2, 1)
    assert report.watermark == 3
    assert seqs(fresh_db) == {linear_id: 1, **dict(zip(ids_of([group_lines[4], group_lines[0]]), [2, 3]))}
    assert_watermark_consistent(fresh_db)

    again = fresh_db.ingest([LINEAR, mixed])  # nothing new: no number given
    assert again.traces == 0 and again.skipped == 3
    assert again.watermark is None
    assert fresh_db.watermark() == 3

    only_rejects = fresh_db.ingest(write_lines(tmp_path / "bad.jsonl", [BAD_LINE]))
    assert len(only_rejects.rejected) == 1 and only_rejects.watermark is None
    assert fresh_db.watermark() == 3

    last = fresh_db.ingest([FOREST, GROUPS])
    assert last.traces == 1 + 30 and last.watermark == 34
    assert in_seq_order(fresh_db)[3:] == ids_of(lines_of(FOREST)) + [
        t for t in ids_of(group_lines) if t not in ids_of([group_lines[4], group_lines[0]])
    ]
    assert_watermark_consistent(fresh_db)


@pytest.mark.parametrize("flush_every_line", [False, True], ids=["one-batch", "flush-per-line"])
def test_an_aborted_strict_ingest_gives_no_numbers_and_leaves_no_gap(
    fresh_db, tmp_path, group_lines, knobs, flush_every_line
):
    if flush_every_line:
        knobs(chunk_bytes=1, batch_tokens=1)  # rows numbered and written before the bad line
    assert fresh_db.ingest(LINEAR).watermark == 1
    before = seqs(fresh_db)
    bad = write_lines(tmp_path / "bad.jsonl", [group_lines[0], group_lines[1], BAD_LINE, group_lines[2]])
    with pytest.raises(IngestAborted):
        fresh_db.ingest(bad, strict=True)
    assert seqs(fresh_db) == before
    assert fresh_db.watermark() == 1 == fresh_db.stats()["watermark"]

    report = fresh_db.ingest(write_lines(tmp_path / "good.jsonl", group_lines[:3]))
    assert report.watermark == 4
    assert in_seq_order(fresh_db)[1:] == ids_of(group_lines[:3])
    assert_watermark_consistent(fresh_db)


def test_concurrent_ingests_through_two_handles_number_without_gaps_or_overlap(tmp_path, group_lines):
    files: dict[str, list[Path]] = {"a": [], "b": []}
    for k in range(8):  # thread a: lines 0..15, thread b: lines 16..31, 4 lines per file
        owner = "a" if k < 4 else "b"
        files[owner].append(write_lines(tmp_path / f"{owner}{k}.jsonl", group_lines[4 * k : 4 * k + 4]))
    reports: list[tuple[Path, IngestReport]] = []
    errors: list[BaseException] = []
    start = threading.Barrier(2)

    with tracedb.connect(tmp_path / "live.duckdb") as db:

        def ingest_all(paths: list[Path]) -> None:
            own = tracedb.Database.on(db.handle.child())
            try:
                start.wait(timeout=DEADLINE_S)
                for path in paths:
                    reports.append((path, own.ingest(path)))
            except BaseException as e:  # reported by the main thread
                errors.append(e)
            finally:
                own.close()

        threads = [threading.Thread(target=ingest_all, args=(files[o],)) for o in ("a", "b")]
        for t in threads:
            t.start()
        for t in threads:
            t.join(DEADLINE_S)
        assert not any(t.is_alive() for t in threads)
        assert not errors, errors

        numbers = seqs(db)
        assert sorted(numbers.values()) == list(range(1, 33))
        assert set(numbers) == set(ids_of(group_lines))
        assert len(reports) == 8
        for path, report in reports:
            ids = ids_of(lines_of(path))
            assert report.ok and report.traces == len(ids) == 4
            w = report.watermark
            assert [numbers[t] for t in ids] == list(range(w - 3, w + 1)), path.name  # contiguous, in file order
        assert sorted(r.watermark for _, r in reports) == [4, 8, 12, 16, 20, 24, 28, 32]
        assert_watermark_consistent(db)


# --------------------------------------------------------------------------- after=


@pytest.mark.parametrize("mark", [0, 1, 10, 33])
def test_traces_after_are_those_above_the_watermark_in_seq_order(live_db, mark):
    table = live_db.traces(after=mark)
    assert column(table, "trace_id") == above(live_db, mark)
    assert column(table, "seq") == list(range(mark + 1, 35))
    assert watermark_of(table) == 34


def test_traces_after_the_watermark_are_none_but_carry_it(live_db):
    table = live_db.traces(after=34)
    assert table.num_rows == 0 and watermark_of(table) == 34
    assert live_db.traces(after=1000).num_rows == 0
    assert watermark_of(live_db.traces()) == 34


def test_after_combines_with_other_filters(live_db):
    table = live_db.traces(after=10, group="group-1")
    want = live_db.sql("SELECT trace_id FROM traces WHERE seq > 10 AND group_id = 'group-1' ORDER BY seq")
    assert column(table, "trace_id") == column(want, "trace_id") and table.num_rows > 0


@pytest.mark.parametrize("mark", [0, 10, 33])
def test_branches_after_equal_the_branches_of_those_traces(live_db, mark):
    ids = above(live_db, mark)
    got = live_db.branches(after=mark)
    want = live_db.branches(trace_ids=ids)
    assert got.num_rows > 0 and got.equals(want)
    assert set(column(got, "trace_id")) == set(ids)
    assert watermark_of(got) == 34


def test_branches_after_the_watermark_are_none_but_carry_it(live_db):
    table = live_db.branches(after=34)
    assert table.num_rows == 0 and watermark_of(table) == 34


def test_iter_branches_after_batches_all_carry_the_watermark(live_db):
    batches = list(live_db.iter_branches(after=10, batch_tokens=500))
    assert len(batches) > 3
    assert [watermark_of(b) for b in batches] == [34] * len(batches)
    whole = pa.concat_tables(batches)
    assert whole.equals(live_db.branches(after=10))
    (empty,) = list(live_db.iter_branches(after=34, batch_tokens=500))
    assert empty.num_rows == 0 and watermark_of(empty) == 34


@pytest.mark.parametrize("suffix", [".parquet", ".arrow"])
def test_export_after_carries_the_watermark_in_its_result_and_file(live_db, tmp_path, suffix):
    path = tmp_path / f"out{suffix}"
    result = live_db.export(path, after=10)
    assert result["watermark"] == 34
    if suffix == ".parquet":
        schema, table = pq.read_schema(path), pq.read_table(path)
    else:
        with pa.ipc.open_file(path) as reader:
            schema, table = reader.schema, reader.read_all()
    assert watermark_of(schema) == 34
    assert set(column(table, "trace_id")) == set(above(live_db, 10))
    assert result["rows"] == table.num_rows == live_db.branches(after=10).num_rows

    empty = live_db.export(tmp_path / f"empty{suffix}", after=34)
    assert empty["rows"] == 0 and empty["watermark"] == 34


def test_a_plain_export_carries_the_watermark_too(live_db, tmp_path):
    result = live_db.export(tmp_path / "all.parquet")
    assert result["watermark"] == 34 == watermark_of(pq.read_schema(tmp_path / "all.parquet"))


def packed_ids(plan: Any) -> list[str]:
    return [t for rank in plan for mb in rank for t in mb.samples.column("trace_id").to_pylist()]


def test_micro_batches_after_pack_only_those_traces(live_db):
    ids = above(live_db, 20)
    plan = live_db.micro_batches(2048, after=20)
    assert plan.report.watermark == 34
    got = packed_ids(plan)
    assert got and set(got) <= set(ids)
    assert sorted(got) == sorted(packed_ids(live_db.micro_batches(2048, trace_ids=ids)))
    assert len(set(packed_ids(live_db.micro_batches(2048, after=0)))) > len(set(got))  # the filter did something
    assert live_db.micro_batches(2048, after=34).report.watermark == 34


# --------------------------------------------------------------------------- exactly once while ingests run


def split_files(tmp_path: Path, lines: Sequence[str], sizes: Sequence[int]) -> list[Path]:
    """``lines`` cut into consecutive files of ``sizes`` lines."""
    assert sum(sizes) == len(lines)
    files, at = [], 0
    for k, n in enumerate(sizes):
        files.append(write_lines(tmp_path / f"part{k:02d}.jsonl", lines[at : at + n]))
        at += n
    return files


def interleaved(group_lines: Sequence[str]) -> list[str]:
    """The groups lines dealt so that groups fill up at different times: group g's members
    start after ``2 g`` lines of the others."""
    by_group: dict[str, list[str]] = collections.defaultdict(list)
    for line in group_lines:
        by_group[group_of(line)].append(line)
    queues = [list(by_group[g]) for g in sorted(by_group)]
    out: list[str] = []
    step = 0
    while any(queues):
        for g, q in enumerate(queues):
            if q and step >= 2 * g:
                out.append(q.pop(0))
        step += 1
    return out


def run_writer(db: tracedb.Database, files: Sequence[Path], errors: list[BaseException]) -> threading.Thread:
    """A thread ingesting ``files`` one at a time through a handle of its own."""

    def write() -> None:
        own = tracedb.Database.on(db.handle.child())
        try:
            for path in files:
                assert own.ingest(path).ok
                time.sleep(0.002)
        except BaseException as e:
            errors.append(e)
        finally:
            own.close()

    thread = threading.Thread(target=write, daemon=True)
    thread.start()
    return thread


def poll_until_done(
    db: tracedb.Database, writer: threading.Thread, read: Callable[[int], pa.Table]
) -> list[tuple[int, pa.Table]]:
    """``read(W)`` with W passed along, until the writer is done and one more read returns
    nothing: every (W, table) read."""
    polls: list[tuple[int, pa.Table]] = []
    mark = 0
    deadline = time.monotonic() + DEADLINE_S
    while True:
        assert time.monotonic() < deadline, "polling did not end"
        done = not writer.is_alive()  # before the read: a read after the last commit follows
        table = read(mark)
        polls.append((mark, table))
        new = watermark_of(table)
        assert new is not None and new >= mark
        mark = new
        if table.num_rows == 0:
            if done:
                return polls
            db.wait(mark, 0.05)


@pytest.mark.parametrize("how", ["traces", "traces-limit-3", "branches"])
def test_polling_after_the_watermark_sees_every_trace_exactly_once(fresh_db, tmp_path, group_lines, how):
    lines = interleaved(group_lines) + [renamed_line(line, "-copy") for line in group_lines[:8]]
    files = split_files(tmp_path, lines, [2] * 12 + [1] * 8 + [4, 4])  # 22 ingests
    readers: dict[str, Callable[[int], pa.Table]] = {
        "traces": lambda w: fresh_db.traces(after=w),
        "traces-limit-3": lambda w: fresh_db.traces(after=w, limit=3),
        "branches": lambda w: fresh_db.branches(after=w, columns=["trace_id", "branch_index"]),
    }
    errors: list[BaseException] = []
    writer = run_writer(fresh_db, files, errors)
    polls = poll_until_done(fresh_db, writer, readers[how])
    writer.join(DEADLINE_S)
    assert not errors, errors

    if how == "branches":  # a trace's branches all come in one poll
        per_poll = [set(column(t, "trace_id")) for _, t in polls]
        seen = [tid for ids in per_poll for tid in ids]
    else:
        seen = [tid for _, t in polls for tid in column(t, "trace_id")]
        numbers = [s for _, t in polls for s in column(t, "seq")]
        assert numbers == sorted(numbers)  # arrival order across polls
        assert all(s > w for w, t in polls for s in column(t, "seq"))  # nothing at or below the W passed
    counts = collections.Counter(seen)
    assert [tid for tid, n in counts.items() if n > 1] == []
    assert set(seen) == set(ids_of(lines)) == set(seqs(fresh_db))
    assert len(seen) == 40
    assert sum(1 for _, t in polls if t.num_rows) >= 2  # the reads really interleaved with the ingests
    if how == "branches":
        assert sum(t.num_rows for _, t in polls) == fresh_db.branches().num_rows


def test_polling_complete_groups_while_ingests_run_gives_each_group_once_whole(fresh_db, tmp_path, group_lines):
    lines = interleaved(group_lines)
    files = split_files(tmp_path, lines, [2] * 12 + [1] * 8)
    errors: list[BaseException] = []
    writer = run_writer(fresh_db, files, errors)
    polls = poll_until_done(fresh_db, writer, lambda w: fresh_db.traces(complete_groups=8, after=w))
    writer.join(DEADLINE_S)
    assert not errors, errors
    returned: list[str] = []
    for _, table in polls:
        members = collections.Counter(column(table, "group_id"))
        assert all(n == 8 for n in members.values()), members
        returned += list(members)
    assert sorted(returned) == ["group-0", "group-1", "group-2", "group-3"]


# --------------------------------------------------------------------------- complete_groups

# Ingests of the groups fixture's members: (group, member index). After each: group sizes
#   1: g0 4, g1 2          2: g0 7, g1 6, g2 4        3: g0 8, g2 8, g3 7
#   4: g1 8                5: a 9th member of g0, and linear (no group)
PLAN: list[list[tuple[int, int]]] = [
    [(0, 0), (1, 0), (0, 1), (0, 2), (1, 1), (0, 3)],
    [(2, 0), (0, 4), (1, 2), (2, 1), (1, 3), (0, 5), (2, 2), (1, 4), (2, 3), (0, 6), (1, 5)],
    [(3, 0), (2, 4), (3, 1), (0, 7), (3, 2), (2, 5), (3, 3), (2, 6), (3, 4), (3, 5), (2, 7), (3, 6)],
    [(1, 6), (1, 7)],
]


def members_by_group(group_lines: Sequence[str]) -> list[list[str]]:
    by_group: dict[str, list[str]] = collections.defaultdict(list)
    for line in group_lines:
        by_group[group_of(line)].append(line)
    return [by_group[f"group-{g}"] for g in range(4)]


@pytest.fixture
def staged(tmp_path: Path, group_lines: list[str]) -> list[Path]:
    """The files of the ingests of :data:`PLAN`, then the 5th."""
    members = members_by_group(group_lines)
    files = [write_lines(tmp_path / f"step{k}.jsonl", [members[g][i] for g, i in step]) for k, step in enumerate(PLAN)]
    extra = [renamed_line(members[0][0], "-ninth"), lines_of(LINEAR)[0]]
    files.append(write_lines(tmp_path / "step4.jsonl", extra))
    return files


def group_ids_at(db: tracedb.Database, group: str) -> set[str]:
    rows = db.sql("SELECT trace_id FROM traces WHERE group_id = ?", [group])
    return set(column(rows, "trace_id"))


def test_complete_groups_returns_each_group_once_in_the_poll_after_it_completed(fresh_db, staged):
    expected = [[], [], ["group-0", "group-2"], ["group-1"], []]
    mark = 0
    for k, path in enumerate(staged):
        assert fresh_db.ingest(path).ok
        table = fresh_db.traces(complete_groups=8, after=mark)
        assert watermark_of(table) == fresh_db.watermark()
        mark = watermark_of(table)
        got = column(table, "group_id")
        assert sorted(set(got)) == expected[k], k
        for group in set(got):  # every member, and nothing else
            members = {t for t, g in zip(column(table, "trace_id"), got, strict=True) if g == group}
            assert members == group_ids_at(fresh_db, group) and len(members) == 8
        assert column(table, "seq") == sorted(column(table, "seq"))
    # group-3 (7 members) was never returned; g0's 9th member did not bring it back
    assert fresh_db.traces(complete_groups=8, after=mark).num_rows == 0


def test_complete_groups_skipping_polls_gets_every_group_completed_since(fresh_db, staged):
    for path in staged[:3]:
        fresh_db.ingest(path)
    after_three = fresh_db.watermark()
    for path in staged[3:]:
        fresh_db.ingest(path)
    table = fresh_db.traces(complete_groups=8, after=0)
    assert collections.Counter(column(table, "group_id")) == {"group-0": 9, "group-1": 8, "group-2": 8}
    assert set(column(fresh_db.traces(complete_groups=8, after=after_three), "group_id")) == {"group-1"}
    assert collections.Counter(column(fresh_db.traces(complete_groups=8), "group_id")) == {
        "group-0": 9,
        "group-1": 8,
        "group-2": 8,
    }


def test_complete_groups_4_returns_a_group_once_with_the_members_present_then(fresh_db, staged):
    expected = [{"group-0": 4}, {"group-1": 6, "group-2": 4}, {"group-3": 7}, {}, {}]
    mark = 0
    for k, path in enumerate(staged):
        fresh_db.ingest(path)
        table = fresh_db.traces(complete_groups=4, after=mark)
        mark = watermark_of(table)
        assert dict(collections.Counter(column(table, "group_id"))) == expected[k], k
        assert set(column(table, "trace_id")) == {t for g in expected[k] for t in group_ids_at(fresh_db, g)}


def test_branches_and_micro_batches_take_complete_groups_too(fresh_db, staged):
    for path in staged[:3]:
        fresh_db.ingest(path)
    want = set(group_ids_at(fresh_db, "group-0") | group_ids_at(fresh_db, "group-2"))
    table = fresh_db.branches(complete_groups=8, after=0)
    assert set(column(table, "trace_id")) == want
    plan = fresh_db.micro_batches(4096, complete_groups=8, after=0)
    assert plan.report.watermark == fresh_db.watermark()
    assert set(packed_ids(plan)) <= want and packed_ids(plan)


@pytest.mark.parametrize("limit", [3, 8, 10, 17])
def test_complete_groups_with_limit_pages_whole_groups(fresh_db, staged, limit):
    for path in staged[:4]:
        fresh_db.ingest(path)
    mark, pages = 0, []
    for _ in range(10):
        table = fresh_db.traces(complete_groups=8, after=mark, limit=limit)
        if table.num_rows == 0:
            break
        pages.append(table)
        mark = watermark_of(table)
    else:
        pytest.fail("paging did not end")
    assert watermark_of(table) == mark
    groups_per_page = [collections.Counter(column(t, "group_id")) for t in pages]
    for counts in groups_per_page:
        assert all(n == 8 for n in counts.values())  # whole groups only
        assert sum(counts.values()) <= max(limit, 8)  # as many as fit, at least one
    order = [g for counts in groups_per_page for g in counts]
    assert sorted(order) == ["group-0", "group-1", "group-2"]  # none missed, none repeated
    assert order[-1] == "group-1"  # in completion order
    assert len(pages) == {3: 3, 8: 3, 10: 3, 17: 2}[limit]


@pytest.mark.parametrize(("limit", "pages"), [(3, 4), (9, 4), (20, 2)])
def test_complete_groups_4_with_limit_pages_groups_holding_more_members(fresh_db, staged, limit, pages):
    for path in staged:
        fresh_db.ingest(path)  # group sizes now: g0 9, g1 8, g2 8, g3 7; they reached 4 in that order
    mark, got = 0, []
    for _ in range(10):
        table = fresh_db.traces(complete_groups=4, after=mark, limit=limit)
        if table.num_rows == 0:
            break
        got.append(dict(collections.Counter(column(table, "group_id"))))
        mark = watermark_of(table)
    assert [g for page in got for g in page] == ["group-0", "group-1", "group-2", "group-3"]
    assert {g: n for page in got for g, n in page.items()} == {"group-0": 9, "group-1": 8, "group-2": 8, "group-3": 7}
    assert len(got) == pages


@pytest.mark.parametrize("limit", [1, 3, 7])
def test_traces_with_limit_page_through_everything_in_order(live_db, limit):
    mark, seen = 0, []
    for _ in range(100):
        table = live_db.traces(after=mark, limit=limit)
        if table.num_rows == 0:
            break
        assert table.num_rows <= limit
        seen += column(table, "trace_id")
        assert watermark_of(table) == column(table, "seq")[-1]
        mark = watermark_of(table)
    assert seen == in_seq_order(live_db)
    assert mark == 34


@pytest.mark.parametrize(
    ("kwargs", "word"),
    [
        ({"after": -1}, "after"),
        ({"after": "x"}, "after"),
        ({"after": 1.5}, "after"),
        ({"complete_groups": 0}, "complete_groups"),
        ({"complete_groups": -3}, "complete_groups"),
        ({"complete_groups": "8"}, "complete_groups"),
        ({"limit": 0}, "limit"),
        ({"limit": -1}, "limit"),
        ({"limit": "3"}, "limit"),
    ],
)
def test_invalid_arguments_are_refused_with_a_clear_message(live_db, kwargs, word):
    with pytest.raises(ValueError, match=word) as info:
        live_db.traces(**kwargs)
    assert repr(next(iter(kwargs.values()))) in str(info.value)
    if "limit" not in kwargs:
        with pytest.raises(ValueError, match=word):
            live_db.branches(**kwargs)


# --------------------------------------------------------------------------- wait()


def test_wait_returns_at_once_when_the_watermark_is_above_after(live_db):
    started = time.monotonic()
    assert live_db.wait(10, 5.0) == 34
    assert live_db.wait(0, 5.0) == 34
    assert time.monotonic() - started < 0.5


def test_wait_returns_the_unchanged_watermark_after_the_timeout(live_db):
    timeout = 0.5
    started = time.monotonic()
    assert live_db.wait(34, timeout) == 34
    elapsed = time.monotonic() - started
    assert timeout * 0.9 <= elapsed < timeout + 1


def test_wait_wakes_when_another_threads_ingest_commits(fresh_db):
    fresh_db.ingest(LINEAR)
    errors: list[BaseException] = []

    def later() -> None:
        own = tracedb.Database.on(fresh_db.handle.child())
        try:
            time.sleep(0.3)
            own.ingest(FOREST)
        except BaseException as e:
            errors.append(e)
        finally:
            own.close()

    thread = threading.Thread(target=later)
    started = time.monotonic()
    thread.start()
    got = fresh_db.wait(1, 10.0)
    elapsed = time.monotonic() - started
    thread.join(DEADLINE_S)
    assert not errors, errors
    assert got == 2
    assert 0.25 <= elapsed < 2.0


def test_wait_keeps_waiting_through_a_write_that_adds_no_trace(fresh_db):
    fresh_db.ingest(LINEAR)

    def later() -> None:
        own = tracedb.Database.on(fresh_db.handle.child())
        try:
            time.sleep(0.1)
            assert own.ingest(LINEAR).watermark is None  # a commit, but nothing new
        finally:
            own.close()

    thread = threading.Thread(target=later)
    thread.start()
    started = time.monotonic()
    got = fresh_db.wait(1, 0.6)
    elapsed = time.monotonic() - started
    thread.join(DEADLINE_S)
    assert got == 1
    assert elapsed >= 0.6 * 0.9


def test_wait_wakes_for_an_ingest_through_another_connect_of_the_same_file(tmp_path):
    path = tmp_path / "shared.duckdb"
    with tracedb.connect(path) as reader, tracedb.connect(path) as writer:
        reader_mark = reader.wait(0, 0.01)
        assert reader_mark == 0

        def later() -> None:
            time.sleep(0.3)
            writer.ingest(LINEAR)

        thread = threading.Thread(target=later)
        started = time.monotonic()
        thread.start()
        got = reader.wait(0, 10.0)
        elapsed = time.monotonic() - started
        thread.join(DEADLINE_S)
        assert got == 1 and elapsed < 2.0
        assert column(reader.traces(after=0), "trace_id") == ids_of(lines_of(LINEAR))


# --------------------------------------------------------------------------- a commit in the middle of a read


class CommitAfterWatermark:
    """Stands in for ``db.handle.watermark``: once armed, right after the next read of the
    watermark another thread commits an ingest of a file, so the rest of the read runs
    with a trace above the watermark it read committed."""

    def __init__(self, db: tracedb.Database) -> None:
        self.db = db
        self.real = db.handle.watermark
        self.path: Path | None = None
        self.fired = 0

    def arm(self, path: Path) -> None:
        self.path = path

    def __call__(self, con: Any = None) -> int:
        mark = self.real(con)
        if self.path is not None:
            path, self.path = self.path, None
            errors: list[BaseException] = []

            def commit() -> None:
                own = tracedb.Database.on(self.db.handle.child())
                try:
                    assert own.ingest(path).traces > 0
                except BaseException as e:
                    errors.append(e)
                finally:
                    own.close()

            thread = threading.Thread(target=commit)
            thread.start()
            thread.join(DEADLINE_S)
            assert not errors, errors
            self.fired += 1
        return mark


def read_ids_traces(db: tracedb.Database, after: int, tmp: Path) -> tuple[int | None, set[str]]:
    table = db.traces(after=after)
    return watermark_of(table), set(column(table, "trace_id"))


def read_ids_traces_limit(db: tracedb.Database, after: int, tmp: Path) -> tuple[int | None, set[str]]:
    table = db.traces(after=after, limit=100)
    return watermark_of(table), set(column(table, "trace_id"))


def read_ids_branches(db: tracedb.Database, after: int, tmp: Path) -> tuple[int | None, set[str]]:
    table = db.branches(after=after)
    return watermark_of(table), set(column(table, "trace_id"))


def read_ids_iter_branches(db: tracedb.Database, after: int, tmp: Path) -> tuple[int | None, set[str]]:
    batches = list(db.iter_branches(after=after, batch_tokens=300))
    marks = {watermark_of(b) for b in batches}
    assert len(marks) == 1
    return marks.pop(), {t for b in batches for t in column(b, "trace_id")}


def read_ids_export(db: tracedb.Database, after: int, tmp: Path) -> tuple[int | None, set[str]]:
    path = tmp / f"export-{after}.parquet"
    result = db.export(path, after=after)
    assert result["watermark"] == watermark_of(pq.read_schema(path))
    return result["watermark"], set(column(pq.read_table(path), "trace_id"))


def read_ids_micro_batches(db: tracedb.Database, after: int, tmp: Path) -> tuple[int | None, set[str]]:
    plan = db.micro_batches(4096, after=after, trainable=None)
    return plan.report.watermark, set(packed_ids(plan))


READS = {
    "traces": read_ids_traces,
    "traces-limit": read_ids_traces_limit,
    "branches": read_ids_branches,
    "iter_branches": read_ids_iter_branches,
    "export": read_ids_export,
    "micro_batches": read_ids_micro_batches,
}


@pytest.mark.parametrize("how", list(READS))
def test_a_read_holds_nothing_above_the_watermark_it_carries(fresh_db, tmp_path, group_lines, monkeypatch, how):
    """A trace committed between a read's watermark and the rest of the read is not in it,
    and so comes in the next read from that watermark, once."""
    files = [write_lines(tmp_path / f"part{k}.jsonl", group_lines[8 * k : 8 * k + 8]) for k in range(4)]
    fresh_db.ingest(files[0])
    hook = CommitAfterWatermark(fresh_db)
    monkeypatch.setattr(fresh_db.handle, "watermark", hook)
    read = READS[how]

    hook.arm(files[1])
    mark, ids = read(fresh_db, 0, tmp_path)
    assert hook.fired == 1 and hook.real() == 16  # the commit happened during the read
    assert mark == 8
    assert ids and ids <= set(ids_of(group_lines[:8]))

    hook.arm(files[2])
    mark, ids = read(fresh_db, 8, tmp_path)
    assert hook.fired == 2 and hook.real() == 24
    assert mark == 16
    if how != "micro_batches":
        assert ids == set(ids_of(group_lines[8:16]))
    else:  # (a branch without advantages is not packed)
        assert ids and ids <= set(ids_of(group_lines[8:16]))

    mark, ids = read(fresh_db, 16, tmp_path)
    assert mark == 24


def test_complete_groups_read_holds_no_member_above_its_watermark(fresh_db, tmp_path, group_lines, monkeypatch):
    members = members_by_group(group_lines)
    first = write_lines(tmp_path / "a.jsonl", members[0][:7] + members[1][:8])
    rest = write_lines(tmp_path / "b.jsonl", members[0][7:] + members[1][8:] + members[2])
    fresh_db.ingest(first)
    hook = CommitAfterWatermark(fresh_db)
    monkeypatch.setattr(fresh_db.handle, "watermark", hook)
    hook.arm(rest)
    table = fresh_db.traces(complete_groups=8, after=0)
    assert hook.fired == 1
    assert collections.Counter(column(table, "group_id")) == {"group-1": 8}  # group-0's 8th came after the mark
    assert watermark_of(table) == 15
    table = fresh_db.traces(complete_groups=8, after=15)
    assert collections.Counter(column(table, "group_id")) == {"group-0": 8, "group-2": 8}


# --------------------------------------------------------------------------- complete_groups with limit and a filter


@pytest.mark.parametrize("how", ["trace_ids", "tags"])
def test_complete_groups_with_limit_and_a_filter_that_keeps_part_of_a_group(fresh_db, tmp_path, group_lines, how):
    members = members_by_group(group_lines)
    fresh_db.ingest(write_lines(tmp_path / "a.jsonl", members[0][:3] + members[1][:3]), tags=["step=1"])
    fresh_db.ingest(write_lines(tmp_path / "b.jsonl", members[0][3:] + members[1][3:]))
    kept = set(ids_of(members[0][:3] + members[1][:3]))
    selection: dict[str, Any] = {"trace_ids": sorted(kept)} if how == "trace_ids" else {"tags": {"step": 1}}
    assert set(column(fresh_db.traces(complete_groups=8, **selection), "trace_id")) == kept  # without limit: fine
    mark, seen = 0, []
    for _ in range(10):
        table = fresh_db.traces(complete_groups=8, after=mark, limit=2, **selection)
        if table.num_rows == 0:
            break
        seen += column(table, "trace_id")
        assert len(set(column(table, "group_id"))) == 1  # whole (filtered) groups, one per page here
        mark = watermark_of(table)
    assert sorted(seen) == sorted(kept)
