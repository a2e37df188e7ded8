"""Ingest into a database file: it persists and reopens, keeps its schema version, lands
at commit, and a failed or interrupted ingest (the writer thread's INSERTs, the commit,
Ctrl-C) leaves the database as it was with nothing left running."""

from __future__ import annotations

import gc
from pathlib import Path

import duckdb
import pyarrow as pa
import pytest

import tracedb
import tracedb.ingest.rows
import tracedb.ingest.run
import tracedb.ingest.writer
from tracedb.errors import SchemaVersionError

from support import FIXTURES
from support.ingested import all_episodes, assert_same, content, counts, episodes_of, fixture_totals, stats_without_size

# --------------------------------------------------------------------------- persistence


def test_file_database_persists(tmp_path):
    path = tmp_path / "db.duckdb"
    with tracedb.connect(path) as db:
        report = db.ingest(FIXTURES)
        assert report.ok
        stats = stats_without_size(db)
        views = db.branches()
        snap = content(db)
        assert db.stats()["bytes"] > 0
    assert path.exists()
    for read_only in (False, True):
        with tracedb.connect(path, read_only=read_only) as db:
            assert stats_without_size(db) == stats
            assert db.branches().equals(views)
            assert content(db) == snap
            for episode in all_episodes():
                assert_same(db.episode(episode["id"]), episode)


def test_file_database_reingest_after_reopen(tmp_path):
    path = tmp_path / "db.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "groups.traces.jsonl")
    with tracedb.connect(path) as db:
        report = db.ingest(FIXTURES)
        n_groups = len(episodes_of(FIXTURES / "groups.traces.jsonl"))
        assert report.skipped == n_groups
        assert report.traces == fixture_totals()["traces"] - n_groups
    with tracedb.connect(path, read_only=True) as db:
        assert db.stats()["traces"] == fixture_totals()["traces"]


def test_schema_version_recorded(fresh_db, tmp_path):
    rows = fresh_db.sql("SELECT key, value FROM tracedb_meta WHERE key = 'schema_version'").to_pylist()
    assert rows == [{"key": "schema_version", "value": str(tracedb.SCHEMA_VERSION)}]
    assert fresh_db.stats()["schema_version"] == tracedb.SCHEMA_VERSION == fresh_db.schema_version
    path = tmp_path / "v.duckdb"
    with tracedb.connect(path):
        pass
    with tracedb.connect(path, read_only=True) as db:
        assert db.sql("SELECT value FROM tracedb_meta WHERE key = 'schema_version'").to_pylist() == [
            {"value": str(tracedb.SCHEMA_VERSION)}
        ]


@pytest.mark.parametrize("stored", ["999", "0"])
def test_other_schema_version_refused(tmp_path, stored):
    path = tmp_path / "old.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        db.sql(f"UPDATE tracedb_meta SET value = '{stored}' WHERE key = 'schema_version'")
    for read_only in (True, False):
        with pytest.raises(SchemaVersionError) as info:
            tracedb.connect(path, read_only=read_only)
        assert stored in str(info.value) and isinstance(info.value, tracedb.TraceDBError)
        del info
        gc.collect()
    # refusing did not rewrite the file's version
    con = duckdb.connect(str(path), read_only=True)
    try:
        assert con.execute("SELECT value FROM tracedb_meta WHERE key = 'schema_version'").fetchall() == [(stored,)]
    finally:
        con.close()


def test_refused_open_does_not_keep_the_file_open(tmp_path):
    """A caller that holds on to the SchemaVersionError (logs it, re-raises it later) must
    still be able to open the file again, e.g. read-only to inspect it."""
    path = tmp_path / "old.duckdb"
    with tracedb.connect(path) as db:
        db.sql("UPDATE tracedb_meta SET value = '999' WHERE key = 'schema_version'")
    try:
        tracedb.connect(path)
    except SchemaVersionError as e:
        held = e
    con = duckdb.connect(str(path), read_only=True)
    con.close()
    assert isinstance(held, SchemaVersionError)


def test_a_large_ingest_lands_in_the_file_at_commit(tmp_path, knobs):
    """The commit of a large ingest checkpoints straight into the file (no WAL left
    behind), and the instance's checkpoint threshold is put back afterwards."""
    from tracedb.synthetic import write_sample

    knobs(checkpoint_min_tokens=200_000)  # "large" from 200k tokens: this one has 240k
    jsonl = write_sample(tmp_path / "traces.jsonl", groups=2, tokens_per_trace=15_000, advantages=True)
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        before = db.con.execute("SELECT current_setting('checkpoint_threshold')").fetchall()[0][0]
        report = db.ingest(jsonl)
        assert report.traces == 16
        wal = Path(str(path) + ".wal")
        assert not wal.exists() or wal.stat().st_size < 64 * 1024  # not the ~2 MB of data
        assert db.con.execute("SELECT current_setting('checkpoint_threshold')").fetchall()[0][0] == before
        expected = db.branches()
    with tracedb.connect(path, read_only=True) as db:
        assert db.branches().equals(expected)


def test_a_small_ingest_commits_into_the_wal(tmp_path, knobs):
    """A small commit (a follower's poll) is not checkpointed at once: a checkpoint
    rewrites the key indexes whole. Its data is in the WAL, and there after a reopen."""
    from tracedb.synthetic import write_sample

    knobs(checkpoint_min_tokens=10_000_000)
    jsonl = write_sample(tmp_path / "traces.jsonl", groups=2, tokens_per_trace=15_000, advantages=True)
    path = tmp_path / "runs.duckdb"
    db = tracedb.connect(path)
    before = db.con.execute("SELECT current_setting('checkpoint_threshold')").fetchall()[0][0]
    assert db.ingest(jsonl).traces == 16
    assert Path(str(path) + ".wal").stat().st_size > 256 * 1024  # the data, not yet in the file
    assert db.con.execute("SELECT current_setting('checkpoint_threshold')").fetchall()[0][0] == before
    expected = db.branches()
    db.close()
    with tracedb.connect(path, read_only=True) as db:
        assert db.branches().equals(expected)


def test_a_failed_insert_leaves_the_database_as_it_was(tmp_path, monkeypatch, knobs):
    """The INSERTs run on the writer thread; its failure reaches the caller, after the
    batches written before it, and the whole ingest is rolled back."""
    knobs(batch_tokens=1)
    knobs(chunk_bytes=1)  # a chunk per line
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        before = content(db)
        real = tracedb.ingest.writer.Writer._write
        calls = []

        def failing(self, inserts):
            calls.append(len(inserts))
            if len(calls) == 3:
                raise OSError("disk full (simulated)")
            real(self, inserts)

        monkeypatch.setattr(tracedb.ingest.writer.Writer, "_write", failing)
        with pytest.raises(OSError, match="simulated"):
            db.ingest(FIXTURES / "groups.traces.jsonl")
        assert len(calls) >= 3
        assert content(db) == before
        monkeypatch.setattr(tracedb.ingest.writer.Writer, "_write", real)
        report = db.ingest(FIXTURES / "groups.traces.jsonl")  # still usable
        assert report.ok and report.traces > 3
    with tracedb.connect(path, read_only=True) as db:
        assert counts(db)["traces"] == 1 + report.traces


def test_a_failing_insert_reports_its_own_error(tmp_path, monkeypatch):
    """The writer thread's INSERT error reaches the caller as itself, not as the
    "transaction is aborted" that cleaning up after it would raise."""
    import duckdb

    real = tracedb.ingest.rows.Batch.inserts

    def with_a_bad_row(batch):
        from tracedb import tables

        bad = pa.Table.from_pylist([{}], schema=tables.inserted(tables.TRACES))  # trace_id NULL
        return [*real(batch), ("traces", bad)]

    monkeypatch.setattr(tracedb.ingest.rows.Batch, "inserts", with_a_bad_row)
    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        before = content(db)
        with pytest.raises(duckdb.ConstraintException):
            db.ingest(FIXTURES / "linear.traces.jsonl")
        assert content(db) == before
        monkeypatch.setattr(tracedb.ingest.rows.Batch, "inserts", real)
        assert db.ingest(FIXTURES / "linear.traces.jsonl").traces == 1


def test_a_failed_commit_reports_its_own_error(tmp_path, monkeypatch):
    """DuckDB ends the transaction when COMMIT fails; the ROLLBACK after it must not hide
    the commit's error behind "no transaction is active"."""
    import duckdb

    def failing_commit(db, large=True):
        db.con.execute("ROLLBACK")  # what a failed COMMIT leaves behind
        raise duckdb.ConstraintException("commit failed (simulated)")

    monkeypatch.setattr(tracedb.ingest.run, "commit_into_file", failing_commit)
    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        with pytest.raises(duckdb.ConstraintException, match="simulated"):
            db.ingest(FIXTURES / "linear.traces.jsonl")
        assert counts(db)["traces"] == 0


def test_interrupted_twice_the_ingest_still_rolls_back_after_the_writer(tmp_path, monkeypatch, knobs):
    """Ctrl-C while the writer inserts, and again while ingest waits for it: the ROLLBACK
    comes only once the writer is done (an INSERT after it would autocommit)."""
    import threading
    import time

    knobs(batch_tokens=1)

    knobs(chunk_bytes=1)  # a chunk per line
    real_write, real_join = tracedb.ingest.writer.Writer._write, threading.Thread.join
    inserting = threading.Event()

    def slow_write(self, inserts):
        inserting.set()
        time.sleep(0.3)  # a large INSERT
        real_write(self, inserts)

    def join_interrupted_once(self, timeout=None):
        if self.name == "tracedb-ingest-writer" and not getattr(self, "_tdb_interrupted", False):
            self._tdb_interrupted = True
            raise KeyboardInterrupt  # the second Ctrl-C, while ingest waits for the writer
        return real_join(self, timeout)

    def interrupted_flush(*args, **kwargs):
        real_flush(*args, **kwargs)
        if inserting.is_set():
            raise KeyboardInterrupt  # the first Ctrl-C, in the parsing thread

    real_flush = tracedb.ingest.run._flush
    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        before = content(db)
        monkeypatch.setattr(tracedb.ingest.writer.Writer, "_write", slow_write)
        monkeypatch.setattr(threading.Thread, "join", join_interrupted_once)
        monkeypatch.setattr(tracedb.ingest.run, "_flush", interrupted_flush)
        with pytest.raises(KeyboardInterrupt):
            db.ingest(FIXTURES / "groups.traces.jsonl")
        time.sleep(0.5)  # a writer left running would insert (and autocommit) by now
        assert content(db) == before
        assert not [t for t in threading.enumerate() if t.name == "tracedb-ingest-writer"]
        monkeypatch.undo()
        assert db.ingest(FIXTURES / "groups.traces.jsonl").ok


def test_an_ingest_that_cannot_begin_leaves_nothing_running(fresh_db):
    import threading

    import duckdb

    fresh_db.con.execute("BEGIN TRANSACTION")  # the caller's own, still open
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(duckdb.TransactionException):
        fresh_db.ingest(FIXTURES / "linear.traces.jsonl", progress=True)
    assert {t.ident for t in threading.enumerate() if t.is_alive()} <= before
    fresh_db.con.execute("ROLLBACK")


def test_inserts_fill_whole_row_groups(tmp_path, monkeypatch, knobs):
    """Every INSERT of an ingest but the last of each table adds whole row groups, from one
    Arrow chunk (else DuckDB writes the rows again at COMMIT and the file keeps both); the
    rows held back between batches all arrive."""
    inserted: dict[str, list[tuple[int, int]]] = {}
    real = tracedb.ingest.writer.Writer._insert

    def recording(self, name, table):
        inserted.setdefault(name, []).append((len(table), len(table.column(0).chunks)))
        real(self, name, table)

    monkeypatch.setattr(tracedb.ingest.writer.Writer, "_insert", recording)
    knobs(batch_tokens=1)
    knobs(chunk_bytes=1)  # a batch per line
    knobs(write_alignment_rows=4)  # the fixtures are small
    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        report = db.ingest(FIXTURES / "groups.traces.jsonl")
        assert report.ok
        stats = db.stats()
    assert sum(n for n, _ in inserted["nodes"]) == stats["nodes"] == report.nodes
    assert sum(n for n, _ in inserted["traces"]) == stats["traces"]
    assert sum(n for n, _ in inserted["branches"]) == stats["branches"]
    assert len(inserted["nodes"]) > 3
    for name, rows in inserted.items():
        assert all(n % 4 == 0 for n, _ in rows[:-1]), (name, rows)
        assert all(chunks == 1 for _, chunks in rows), (name, rows)
