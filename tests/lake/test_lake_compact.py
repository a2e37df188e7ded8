"""``tracedb lake compact``: what readers never see is removed, their answers unchanged;
``traces`` rewritten with every trace's ``seq`` kept; old snapshots and their files expired."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

import tracedb

from support import FIXTURES

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb.cli.main import app  # noqa: E402
from tracedb.lake import compact, read, write  # noqa: E402
from tracedb.lake.move import file_rows, write_into  # noqa: E402
from tracedb.lake.scan import visible_traces  # noqa: E402


def _answers(lake, plan=True):
    """What readers get (the watermark aside: a traces rewrite is a commit and moves it):
    the visible tables, the macros over them and (``plan``) a micro-batch plan."""
    visible = lake.tables()
    tables = {}
    for name, table in visible.items():
        keys = [f.name for f in table.schema if not pa.types.is_nested(f.type)]
        tables[name] = table.sort_by([(c, "ascending") for c in keys])
    with tracedb.connect(":memory:") as db:  # the macros over the lake's visible rows (what a pull writes)
        write_into(db, visible)
        stats = db.sql("SELECT * FROM branch_stats() ORDER BY ALL")
    if not plan:
        return tables, stats
    batches = lake.micro_batches(300, ranks=2)
    return tables, stats, [[(mb.tokens, mb.samples) for mb in rank] for rank in batches]


def _seqs(lake, after=None):
    """Each visible trace's seq (of those after ``after``), as every reader takes it."""
    return _by_id(visible_traces(lake.table("traces")), after)


def _by_id(traces, after=None):
    pairs = zip(traces.column("trace_id").to_pylist(), traces.column("seq").to_pylist(), strict=True)
    return {t: s for t, s in pairs if after is None or s > after}


def _reward(traces, value):
    return traces.set_column(traces.schema.get_field_index("reward"), "reward", pa.array([value] * traces.num_rows))


def _raw(lake, name):
    return lake.table(name).scan().to_arrow().num_rows


def _on_disk(lake):
    files = [p for p in (Path(lake.where) / "warehouse").rglob("*") if p.is_file()]
    return len(files), sum(p.stat().st_size for p in files)


WRITE = 4
"""Traces per write: the store's traces in three writes (several small files per table)."""


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The one-trace golden fixtures (12 traces of every shape): what compaction does is
    per row and per file, so the 32-trace group fixture would add only time."""
    path = tmp_path_factory.mktemp("store") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(sorted(p for p in FIXTURES.glob("*.traces.jsonl") if p.name != "groups.traces.jsonl"))
    return path


def _ids(store):
    with tracedb.connect(store, read_only=True) as db:
        return db.sql("SELECT trace_id FROM traces ORDER BY seq, trace_id").column("trace_id").to_pylist()


def _rows(store, ids):
    with tracedb.connect(store, read_only=True) as db:
        return file_rows(db, ids)


def test_compact_removes_leftovers_and_keeps_answers(tmp_path, store):
    rows = _rows(store, sorted(_ids(store))[:5])
    lake = lakes.init(tmp_path / "L")
    lake.push(store, batch_traces=WRITE)  # several writes: several small files per table
    for name in ("nodes", "branches", "episodes"):  # a killed writer: rows, no traces commit
        lake.table(name).append(write.lake_rows(name, rows[name], "killed-writer"))
    lake.table("segments").append(write.lake_rows("segments", rows["segments"], "killed-writer"))  # duplicates
    before, seqs, mark = _answers(lake), _seqs(lake), lake.watermark()
    visible = before[0]
    assert _raw(lake, "nodes") > visible["nodes"].num_rows and _raw(lake, "segments") > visible["segments"].num_rows

    young = lake.compact()  # the leftovers are in files of this minute: a writer may still be at work
    assert young.tables["nodes"]["rows_after"] == _raw(lake, "nodes") > visible["nodes"].num_rows
    assert young.tables["nodes"]["files_after"] < young.tables["nodes"]["files_before"]  # small files rewritten
    assert young.tables["traces"]["files_after"] < young.tables["traces"]["files_before"]
    assert _answers(lake, plan=False) == before[:2] and _seqs(lake) == seqs
    assert lake.watermark() > mark  # the traces rewrite is a commit

    report = lake.compact(grace=0)
    assert _answers(lake) == before and _seqs(lake) == seqs
    for name in ("nodes", "branches", "episodes", "segments"):
        assert _raw(lake, name) == visible[name].num_rows, name
        entry = report.tables[name]
        assert entry["rows_before"] > entry["rows_after"] and entry["files_after"] <= entry["files_before"], name
    assert report.tables["traces"]["rows_after"] == len(seqs)
    mark = lake.watermark()

    run = CliRunner().invoke(app, ["lake", "compact", "--lake", lake.where, "--grace", "0", "--json"])
    assert run.exit_code == 0, run.output
    again = json.loads(run.output)["tables"]
    assert all(e["rows_before"] == e["rows_after"] for e in again.values())  # nothing left to remove
    assert all(e["files_before"] == e["files_after"] for e in again.values())  # nor to merge: no commit
    assert _answers(lake, plan=False) == before[:2] and lake.watermark() == mark
    with pytest.raises(ValueError, match="grace is a number of seconds"):
        lake.compact(grace=-1)
    with pytest.raises(ValueError, match="expire_older_than is a number of seconds"):
        lake.compact(expire_older_than=-1)


def test_traces_compaction_keeps_seq_duplicates_and_the_order_of_later_commits(tmp_path, store):
    ids = _ids(store)
    lake = lakes.init(tmp_path / "L")
    for start in range(0, len(ids) - 4, WRITE):  # several writes, one seq each
        lake.append(_rows(store, ids[start : min(start + WRITE, len(ids) - 4)]))
    # Duplicate traces rows (writers that lost the race): one in a later file, and two
    # rows of one new trace in one file, where the batch decides.
    lost = _rows(store, ids[:1])["traces"]
    lake.table("traces").append(write.lake_rows("traces", _reward(lost, -9.0), "zz"))
    twin = _rows(store, ids[-4:-3])["traces"]
    rows = write.lake_rows("traces", pa.concat_tables([_reward(twin, 7.0), _reward(twin, 8.0)]), "")
    batch = rows.schema.get_field_index("lake_batch")
    lake.table("traces").append(rows.set_column(batch, "lake_batch", pa.array(["b", "a"])))
    seqs, traces = _seqs(lake), lake.tables()["traces"]
    chosen = dict(zip(traces.column("trace_id").to_pylist(), traces.column("reward").to_pylist(), strict=True))
    assert chosen[ids[-4]] == 8.0 and chosen[ids[0]] != -9.0  # first by seq, then by batch
    assert lake.table("traces").scan().to_arrow().num_rows == len(seqs) + 2
    mark = lake.watermark()

    report = lake.compact(grace=0)
    entry = report.tables["traces"]
    assert entry["rows_before"] == len(seqs) + 2 and entry["rows_after"] == len(seqs)
    assert _seqs(lake) == seqs and lake.tables()["traces"].equals(traces)
    stored = lake.table("traces").scan(selected_fields=("seq",)).to_arrow().column("seq")
    assert stored.null_count == 0  # the rewritten rows carry their seq
    compacted = lake.watermark()
    assert compacted > mark > max(seqs.values()) - 1
    assert read.visible(lake, after=mark)["traces"].num_rows == 0  # nothing new since the old watermark

    later = lake.append(_rows(store, ids[-3:]))  # a trace committed after the compaction
    new = _seqs(lake, after=compacted)
    assert sorted(new) == sorted(ids[-3:]) and set(new.values()) == {later.sequence_number}
    assert later.sequence_number > compacted > max(seqs.values())
    assert _by_id(lake.tables(after=mark)["traces"]) == new  # after= an old watermark: only what came since
    assert {t: s for t, s in _seqs(lake).items() if t not in new} == seqs
    lake.compact(grace=0)  # compacting again keeps the later trace's seq too
    assert _seqs(lake, after=compacted) == new


def test_a_traces_commit_between_the_compactions_read_and_commit_is_kept(tmp_path, store, monkeypatch):
    ids = _ids(store)
    lake = lakes.init(tmp_path / "L")
    for start in range(0, len(ids) - 5, WRITE):
        lake.append(_rows(store, ids[start : min(start + WRITE, len(ids) - 5)]))
    seqs = _seqs(lake)
    lost = _rows(store, ids[:1])["traces"]  # a losing writer's row: the table needs a rewrite
    lake.table("traces").append(write.lake_rows("traces", _reward(lost, -9.0), "zz"))
    real, reads, writes = compact.visible_traces, [], []

    def racing(table, *args, **kwargs):
        got = real(table, *args, **kwargs)
        if "columns" not in kwargs:  # the traces rewrite's read (the other tables' read only some columns)
            reads.append(got.num_rows)
            if len(reads) == 1:  # another writer commits its traces now
                writes.append(lakes.open(lake.where).append(_rows(store, ids[-5:])))
        return got

    monkeypatch.setattr(compact, "visible_traces", racing)
    report = lake.compact(grace=0)
    assert reads == [len(seqs), len(ids)]  # the commit conflicted; the table was read again
    assert report.tables["traces"]["rows_after"] == len(ids)
    after = _seqs(lake)
    assert {t: after[t] for t in seqs} == seqs
    assert {after[t] for t in ids[-5:]} == {writes[0].sequence_number} and writes[0].traces == 5
    assert lake.tables()["nodes"].num_rows == _rows(store, ids)["nodes"].num_rows


def test_a_write_between_a_tables_read_and_its_rewrite_is_kept(tmp_path, store, monkeypatch):
    """A writer's rows landing in ``nodes`` while compaction rewrites it: pyiceberg's own
    retry refuses the overwrite (ValidationException: files added meanwhile); compaction
    reads the table again and rewrites it, keeping the writer's rows."""
    ids = _ids(store)
    lake = lakes.init(tmp_path / "L")
    lake.append(_rows(store, ids[:4]))
    later = _rows(store, ids[4:8])
    lake.table("nodes").append(write.lake_rows("nodes", later["nodes"], "killed-writer"))  # needs a rewrite
    real, reads = compact._scan_with_age, []

    def racing(table):
        got = real(table)
        if table.name()[-1] == "nodes":
            reads.append(got[0].num_rows)
            if len(reads) == 2:  # the nodes rewrite's own read (the first is the segments step's)
                lakes.open(lake.where).append(later)  # another writer's whole write lands now
        return got

    monkeypatch.setattr(compact, "_scan_with_age", racing)
    report = lake.compact(grace=0)
    assert len(reads) == 3 and reads[2] > reads[1]  # the rewrite was refused; the table was read again
    assert report.tables["nodes"]["rows_after"] == _rows(store, ids[:8])["nodes"].num_rows
    assert lake.tables()["nodes"].num_rows == _rows(store, ids[:8])["nodes"].num_rows


def test_expiry_deletes_old_files_and_keeps_answers(tmp_path, store):
    rows = _rows(store, sorted(_ids(store))[:5])
    lake = lakes.init(tmp_path / "L")
    lake.push(store, batch_traces=WRITE)
    for name in ("nodes", "branches"):  # a killed writer's committed rows
        lake.table(name).append(write.lake_rows(name, rows[name], "killed-writer"))
    # A writer killed before its commit: a data file no snapshot refers to.
    data = next(p for p in (tmp_path / "L" / "warehouse").rglob("*.parquet") if "/nodes/" in str(p))
    orphan = data.with_name("00000-0-orphan-of-a-killed-writer.parquet")
    pq.write_table(pq.read_table(data), orphan)
    time.sleep(1.1)  # file times are of the second
    kept = lake.compact(grace=1, expire_older_than=3600)  # nothing was replaced that long ago
    assert all(e["snapshots_expired"] == 0 for e in kept.expired.values())
    assert not orphan.exists() and kept.expired["nodes"]["files_deleted"] == 1  # unreferenced, older than grace
    assert kept.tables["nodes"]["rows_after"] < kept.tables["nodes"]["rows_before"]  # the leftovers went
    before, seqs, mark = _answers(lake), _seqs(lake), lake.watermark()
    files, size = _on_disk(lake)
    pq.write_table(pq.read_table(data), orphan)  # a young orphan: a writer may be at work
    young = lake.compact(expire_older_than=0)  # the replaced files go at once; the default grace keeps the orphan
    assert young.expired["nodes"]["snapshots_expired"] > 0 and orphan.exists()
    assert all(e["rows_before"] == e["rows_after"] for e in young.tables.values())
    files_after, size_after = _on_disk(lake)
    assert files_after < files and size_after < size * 0.7
    assert sum(e["bytes_deleted"] for e in young.expired.values()) > size - size_after
    assert _answers(lake, plan=False) == before[:2] and _seqs(lake) == seqs and lake.watermark() == mark

    report = lake.compact(grace=0, expire_older_than=0)
    assert not orphan.exists() and report.expired["nodes"]["files_deleted"] == 1
    for name in ("traces", "nodes", "segments"):
        table = lake.table(name)
        assert len(table.metadata.snapshots) == 1, name  # the current one
    assert _answers(lake) == before and _seqs(lake) == seqs and lake.watermark() == mark
    assert lakes.open(lake.where).tables()["traces"].num_rows == len(seqs)

    run = CliRunner().invoke(app, ["lake", "compact", "--lake", lake.where, "--expire-older-than", "0", "--json"])
    assert run.exit_code == 0, run.output
    assert set(json.loads(run.output)["expired"]) >= {"traces", "nodes"}
    assert _answers(lake, plan=False) == before[:2] and lake.watermark() == mark


def test_a_compaction_removing_segments_a_write_relied_on_does_not_lose_them(tmp_path, monkeypatch):
    """A write skips the segments the lake holds already; when a compaction removes them
    (a dead writer's, unused) between that check and the write's traces commit, the
    write stores them again before its traces are visible: no trace without its tokens."""
    from pyiceberg.expressions import In

    store = tmp_path / "runs.duckdb"
    with tracedb.connect(store) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        ids = db.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist()
        rows = file_rows(db, ids)
    lake = lakes.init(tmp_path / "L")
    lake.table("segments").append(write.lake_rows("segments", rows["segments"], "a-dead-writer"))
    real = write._segments_present
    calls = []

    def check_then_compaction(lake_, segments):
        found = real(lake_, segments)
        calls.append(len(found))
        if len(calls) == 1:  # a compaction lands right after the first check: the leftovers go
            lake_.table("segments").delete(In("segment_id", found))
        return found if len(calls) == 1 else real(lake_, segments)

    monkeypatch.setattr(write, "_segments_present", check_then_compaction)
    report = lake.append(rows)
    assert calls[0] == rows["segments"].num_rows and calls[1] == 0  # relied on all, then all gone
    assert report.rows["segments"] == rows["segments"].num_rows
    monkeypatch.undo()
    pulled = tmp_path / "pulled.duckdb"
    lake.pull(pulled)
    with tracedb.connect(store, read_only=True) as a, tracedb.connect(pulled, read_only=True) as b:
        assert [b.trace(t) for t in ids] == [a.trace(t) for t in ids]
