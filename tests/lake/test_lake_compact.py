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
from tracedb.lake import commit, compact, files, read, write  # noqa: E402
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


def _segment_copies(lake):
    """The segments rows as stored: (bucket of lake_trace, segment_id, lake_batch) of each."""
    table = lake.table("segments")
    rows = files.read(table, files.live_files(table), ["segment_id", "lake_trace", "lake_batch"])
    buckets = files.buckets(table, "lake_trace", rows.column("lake_trace").combine_chunks()).to_pylist()
    return list(zip(buckets, rows.column("segment_id").to_pylist(), rows.column("lake_batch").to_pylist()))


def test_compact_removes_leftovers_and_keeps_answers(tmp_path, store):
    rows = _rows(store, sorted(_ids(store))[:5])
    lake = lakes.init(tmp_path / "L", buckets=4)  # several traces a bucket: files to merge
    lake.push(store, batch_traces=WRITE)  # several writes: several small files per table
    for name in ("nodes", "branches", "episodes"):  # a killed writer: rows, no traces commit
        lake.table(name).append(write.lake_rows(name, rows[name], "killed-writer"))
    lake.table("segments").append(write.lake_rows("segments", rows["segments"], "killed-writer"))  # duplicates
    before, seqs, mark = _answers(lake), _seqs(lake), lake.watermark()
    visible = before[0]
    assert _raw(lake, "nodes") > visible["nodes"].num_rows and _raw(lake, "segments") > visible["segments"].num_rows
    killed = {name: len(rows[name]) for name in ("nodes", "branches", "episodes", "segments")}

    young = lake.compact()  # the leftovers are in files of this minute: a writer may still be at work
    for name in ("nodes", "branches", "episodes", "segments"):  # their files wait; the others are merged
        entry = young.tables[name]
        assert entry["rows_after"] == entry["rows_before"] == _raw(lake, name) - killed[name], name
        assert entry["files_after"] < entry["files_before"], name  # small files rewritten
    assert young.tables["traces"]["files_after"] < young.tables["traces"]["files_before"]
    assert _answers(lake, plan=False) == before[:2] and _seqs(lake) == seqs
    assert lake.watermark() > mark  # the traces rewrite is a commit
    mark = lake.watermark()

    report = lake.compact(grace=0)
    assert _answers(lake) == before and _seqs(lake) == seqs
    for name in ("nodes", "branches", "episodes"):
        assert _raw(lake, name) == visible[name].num_rows, name
        entry = report.tables[name]
        assert entry["rows_before"] == killed[name] and entry["rows_after"] == 0, name  # only the waiting files
        assert entry["files_after"] < entry["files_before"], name
    copies = _segment_copies(lake)
    assert "killed-writer" not in {b for _, _, b in copies} and len(set(copies)) == len(copies)
    assert len({(b, s) for b, s, _ in copies}) == len(copies)  # each segment once per bucket
    assert {s for _, s, _ in copies} == set(visible["segments"].column("segment_id").to_pylist())
    assert report.tables["traces"]["rows_before"] == 0  # nothing new since the last compaction
    assert lake.watermark() == mark  # no traces commit then

    run = CliRunner().invoke(app, ["lake", "compact", "--lake", lake.where, "--grace", "0", "--json"])
    assert run.exit_code == 0, run.output
    again = json.loads(run.output)["tables"]
    assert all(e["rows_before"] == e["rows_after"] == e["files_rewritten"] == 0 for e in again.values())
    assert all(e["files_before"] == e["files_after"] for e in again.values())  # nothing to merge: no commit
    assert _answers(lake, plan=False) == before[:2] and lake.watermark() == mark
    full = lake.compact(grace=0, full=True)  # every file again: the same rows, one file per partition
    assert all(e["rows_before"] == e["rows_after"] for e in full.tables.values())
    assert _answers(lake) == before and _seqs(lake) == seqs
    for name in ("nodes", "segments", "traces"):
        live = files.live_files(lake.table(name))
        assert len(live) == len({f.partition for f in live}) and all(commit.compacted(f.path) for f in live)
    with pytest.raises(ValueError, match="grace is a number of seconds"):
        lake.compact(grace=-1)
    with pytest.raises(ValueError, match="expire_older_than is a number of seconds"):
        lake.compact(expire_older_than=-1)


def test_compaction_rewrites_only_the_files_added_since_the_last_one(tmp_path, store):
    """Each compaction rewrites the files written since the previous one, one per
    partition, and leaves the compacted ones alone; each table keeps one manifest."""
    ids = _ids(store)
    lake = lakes.init(tmp_path / "L", buckets=4)
    lake.append(_rows(store, ids[:6]))
    lake.append(_rows(store, ids[6:9]))
    first = lake.compact(grace=0)
    compacted = {n: {f.path for f in files.live_files(lake.table(n))} for n in ("nodes", "traces", "segments")}
    seqs = _seqs(lake)
    lake.append(_rows(store, ids[9:]))  # new data after the compaction
    added = {n: {f.path for f in files.live_files(lake.table(n))} - compacted[n] for n in compacted}
    second = lake.compact(grace=0)
    for name, paths in compacted.items():
        live = {f.path for f in files.live_files(lake.table(name))}
        assert paths <= live, name  # the compacted files were not rewritten
        assert not added[name] & live, name  # the new ones were
        assert second.tables[name]["files_rewritten"] == len(added[name]) < first.tables[name]["files_rewritten"]
        table = lake.table(name)
        assert len(table.current_snapshot().manifests(table.io)) == 1, name  # merged into one
    assert second.tables["traces"]["rows_before"] == len(ids) - 9
    assert {t: s for t, s in _seqs(lake).items() if t in seqs} == seqs
    with tracedb.connect(store, read_only=True) as db:
        assert lake.tables()["nodes"].num_rows == db.sql("SELECT count(*) FROM nodes").column(0)[0].as_py()


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
    real, rewrites, writes = compact.replace_files, [], []

    def racing(table, removed, added, properties=None):
        if table.name()[-1] == "traces":
            rewrites.append(len(removed))
            if len(rewrites) == 1:  # another writer commits its traces now, after the rewrite's read
                writes.append(lakes.open(lake.where).append(_rows(store, ids[-5:])))
        return real(table, removed, added, properties)

    monkeypatch.setattr(compact, "replace_files", racing)
    report = lake.compact(grace=0)
    assert len(rewrites) == 2 and rewrites[1] > rewrites[0]  # the commit conflicted; the table was read again
    assert report.tables["traces"]["rows_after"] == len(ids)
    after = _seqs(lake)
    assert {t: after[t] for t in seqs} == seqs
    assert {after[t] for t in ids[-5:]} == {writes[0].sequence_number} and writes[0].traces == 5
    assert lake.tables()["nodes"].num_rows == _rows(store, ids)["nodes"].num_rows


def test_a_write_between_a_tables_read_and_its_rewrite_is_kept(tmp_path, store, monkeypatch):
    """A writer's rows landing in ``nodes`` while compaction rewrites it: the rewrite
    replaces only the files it read (the writer's new files stay), so both commit."""
    ids = _ids(store)
    lake = lakes.init(tmp_path / "L")
    lake.append(_rows(store, ids[:4]))
    later = _rows(store, ids[4:8])
    lake.table("nodes").append(write.lake_rows("nodes", later["nodes"], "killed-writer"))  # needs a rewrite
    real, calls = compact.replace_files, []

    def racing(table, removed, added, properties=None):
        if table.name()[-1] == "nodes":
            calls.append(len(removed))
            if len(calls) == 1:
                lakes.open(lake.where).append(later)  # another writer's whole write lands now
        return real(table, removed, added, properties)

    monkeypatch.setattr(compact, "replace_files", racing)
    report = lake.compact(grace=0)
    assert len(calls) == 1  # no conflict: appends do not touch the files replaced
    assert report.tables["nodes"]["rows_after"] == _rows(store, ids[:4])["nodes"].num_rows
    assert lake.tables()["nodes"].num_rows == _rows(store, ids[:8])["nodes"].num_rows
    assert any(not commit.compacted(f.path) for f in files.live_files(lake.table("nodes")))  # the writer's
    again = lake.compact(grace=0)
    assert again.tables["nodes"]["rows_after"] == _rows(store, ids[4:8])["nodes"].num_rows
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


def test_a_write_stores_its_segments_beside_its_traces(tmp_path, store):
    """A write stores every segment its traces use in each bucket holding one of them
    (homed at the first such trace), whatever the lake holds already: no segment look-up,
    and a reader of some traces finds their segments in their own buckets, also after a
    compaction removed a dead writer's copies."""
    ids = _ids(store)
    lake = lakes.init(tmp_path / "L", buckets=4)
    rows = _rows(store, ids)
    lake.table("segments").append(write.lake_rows("segments", rows["segments"], "a-dead-writer"))
    lake.append(_rows(store, ids[:6]))
    lake.append(_rows(store, ids[6:]))
    table = lake.table("segments")
    nodes = rows["nodes"]
    want = set(
        zip(
            files.buckets(table, "lake_trace", nodes.column("trace_id").combine_chunks()).to_pylist(),
            nodes.column("segment_id").to_pylist(),
        )
    )
    for _ in range(2):
        copies = _segment_copies(lake)
        assert {(b, s) for b, s, batch in copies if batch != "a-dead-writer"} == want
        lake.compact(grace=0)
    assert len(_segment_copies(lake)) == len(want)  # the dead writer's copies went, each kept once per bucket
    got = read.visible(lake, trace_ids=ids[:3])
    with tracedb.connect(store, read_only=True) as db:
        for trace_id in ids[:3]:
            with tracedb.connect(":memory:") as local:
                write_into(local, read.visible(lake, trace_ids=[trace_id]))
                assert local.trace(trace_id) == db.trace(trace_id)
    assert got["segments"].num_rows == len(set(got["nodes"].column("segment_id").to_pylist()))


def test_a_compaction_reads_the_visible_traces_once_of_the_buckets_it_rewrites(tmp_path, store, monkeypatch):
    """The visible traces rows decide every table's rewrite: they are read once per
    compaction (not once per table), of the trace-id buckets of the files rewritten
    (every bucket when episodes are rewritten: an episode shows through a trace of any)."""
    ids = _ids(store)
    lake = lakes.init(tmp_path / "L")  # 64 buckets: a few traces touch a few
    for start in range(0, len(ids), WRITE):
        lake.append(_rows(store, ids[start : start + WRITE]))
    lake.compact(grace=0)
    real, reads = compact.visible_traces, []

    def counting(table, *args, **kwargs):
        got = real(table, *args, **kwargs)
        reads.append((kwargs.get("buckets"), got.num_rows))
        return got

    monkeypatch.setattr(compact, "visible_traces", counting)
    leftover = _rows(store, ids[:2])
    for name in ("nodes", "branches"):  # a killed writer's rows of two traces: only their buckets need reading
        lake.table(name).append(write.lake_rows(name, leftover[name], "killed-writer"))
    before = _answers(lake, plan=False)
    report = lake.compact(grace=0)
    traces = lake.table("traces")
    buckets = set(files.buckets(traces, "trace_id", pa.array(ids[:2])).to_pylist())
    assert [b for b, _ in reads] == [buckets]
    assert reads[0][1] < len(ids)  # the visible traces of those buckets only
    assert report.tables["nodes"]["rows_before"] == leftover["nodes"].num_rows + report.tables["nodes"]["rows_after"]
    assert _answers(lake, plan=False) == before
    reads.clear()
    lake.table("nodes").append(write.lake_rows("nodes", leftover["nodes"], "killed-writer"))
    lake.table("episodes").append(write.lake_rows("episodes", leftover["episodes"], "killed-writer"))
    lake.compact(grace=0)
    assert reads == [(None, len(ids))]  # episodes rewritten: every bucket, still once
    assert _answers(lake, plan=False) == before
