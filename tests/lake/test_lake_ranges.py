"""Large files cut into byte ranges at line starts (no Ray: the cutting and the range ingest).

The lake's ingest cuts a plain ``.jsonl`` file into ranges that each hold the lines
starting in their span of ``range_bytes`` bytes, numbered as in the whole file; each
range is ingested on its own. Here every range goes into a tracedb of its own and the
union must be the file store's ingest of the whole file: the same traces, the same
rejects with the same file, line and reason, the same count of lines.
"""

from __future__ import annotations

import pytest

import tracedb
from tracedb.ingest.files import ByteRange, read_range
from tracedb.ingest.run import ingest_files

from support.cut_files import write_cut_file

pytest.importorskip("pyiceberg", reason="the lake extra is not installed (pip install '.[lake]')")
pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb.lake.ingest import cut, measure, numbered, spans  # noqa: E402


def _line_starts(data: bytes) -> list[int]:
    """Where each line starts (the reference: every byte after a line break, but the end)."""
    return [0] + [k + 1 for k, b in enumerate(data) if b == ord("\n") and k + 1 < len(data)]


@pytest.mark.parametrize("range_bytes", [1_000, 4_096, 9_999, 65_536])
def test_ranges_tile_the_file_at_line_starts_numbered_as_in_the_file(tmp_path, range_bytes):
    path = write_cut_file(tmp_path / "t.traces.jsonl", range_bytes)
    data = path.read_bytes()
    ranges = cut(path, range_bytes)
    assert len(ranges) > 3
    assert ranges[0].start == 0 and ranges[-1].stop == len(data)
    assert all(a.stop == b.start for a, b in zip(ranges, ranges[1:]))
    starts = _line_starts(data)
    number = {s: k + 1 for k, s in enumerate(starts)}
    for r in ranges:
        assert r.start in number and r.first_line == number[r.start]  # a line start, its true number
    for s in starts:  # every line in exactly one range: the one of the span it starts in
        holders = [r for r in ranges if r.start <= s < r.stop]
        assert len(holders) == 1
        span_start = s // range_bytes * range_bytes
        assert holders[0].start == min(t for t in starts if t >= span_start)
    assert len(spans(len(data), range_bytes)) == -(-len(data) // range_bytes)


def test_measure_names_the_range_of_a_span_and_its_line_breaks(tmp_path):
    path = tmp_path / "t.jsonl"
    path.write_bytes(b"ab\ncdef\n\ngh")  # lines start at 0, 3, 8, 9
    size = 11
    assert measure(str(path), 0, 3, size) == (0, 3, 1)
    assert measure(str(path), 3, 6, size) == (3, 8, 1)  # the line starting at 3 runs past the span
    assert measure(str(path), 4, 8, size) == (8, 8, 0)  # no line starts in [4, 8): empty
    assert measure(str(path), 8, 11, size) == (8, 11, 1)  # the last line has no line break
    assert numbered(str(path), [(0, 3, 1), (3, 8, 1), (8, 8, 0), (8, 11, 1)]) == [
        ByteRange(path, 0, 3, 1),
        ByteRange(path, 3, 8, 2),
        ByteRange(path, 8, 11, 3),
    ]
    assert [(r.start, r.stop, r.first_line) for r in cut(path, 3)] == [(0, 3, 1), (3, 8, 2), (8, 9, 3), (9, 11, 4)]
    assert cut(path, 100) == [ByteRange(path, 0, 11, 1)]


def test_only_plain_jsonl_files_are_read_in_ranges(tmp_path):
    for name in ("t.jsonl.zst", "t.json"):
        (tmp_path / name).write_bytes(b"{}\n")
        with pytest.raises(ValueError, match=f"{name}: only a plain .jsonl file is read in byte ranges"):
            list(read_range(ByteRange(tmp_path / name, 0, 3)))


def _contents(db: tracedb.Database) -> tuple[dict, list]:
    ids = db.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist()
    rejects = db.sql(
        "SELECT source, line, trace_id, node, field, reason, record, record_bytes, record_sha256 FROM rejects"
    ).to_pylist()
    return {t: db.trace(t) for t in ids}, sorted(rejects, key=lambda r: (r["source"], r["line"]))


@pytest.mark.parametrize(
    ("range_bytes", "last", "newline_at_end"),
    [(2_048, "good", False), (5_000, "bad", True), (1 << 20, "bad", False)],  # the last: one range
)
def test_ranges_ingested_apart_equal_the_whole_file(tmp_path, range_bytes, last, newline_at_end):
    path = write_cut_file(tmp_path / "t.traces.jsonl", range_bytes, last=last, newline_at_end=newline_at_end, goods=25)
    with tracedb.connect(":memory:") as db:
        whole = db.ingest(path)
        traces, rejects = _contents(db)
    assert len(rejects) == 7 + (last == "bad") and whole.skipped == 1  # the bad lines placed, the repeat
    got_traces: dict = {}
    got_rejects: list = []
    lines = skipped = 0
    ranges = cut(path, range_bytes)
    for r in ranges:  # each range on its own, as the lake's tasks ingest them
        with tracedb.connect(":memory:") as db:
            report = ingest_files(db.handle, [], ranges=[r])
            t, j = _contents(db)
        got_traces.update(t)
        got_rejects += j
        lines += report.lines
        skipped += report.skipped
    assert lines == whole.lines
    assert got_traces == traces
    assert sorted(got_rejects, key=lambda r: (r["source"], r["line"])) == rejects
    assert {r["source"] for r in rejects} == {str(path)}
    with tracedb.connect(":memory:") as db:  # all ranges in one ingest: the same again
        report = ingest_files(db.handle, [], ranges=ranges)
        assert _contents(db) == (traces, rejects)
        assert (report.files, report.lines, report.skipped) == (1, whole.lines, 1)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "64M"])
def test_a_bad_range_size_is_refused_naming_it(tmp_path, bad):
    lake = lakes.init(tmp_path / "L")
    with pytest.raises(ValueError, match=f"range_bytes must be an int >= 1, not {bad!r}"):
        lake.ingest([tmp_path], range_bytes=bad)  # before Ray is asked for
