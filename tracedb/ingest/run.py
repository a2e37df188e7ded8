"""Ingest of verifiers ``traces.jsonl`` files: the loop that reads, parses, checks and writes.

Files are read in chunks of whole lines (:mod:`tracedb.ingest.files`); the compiled
scanner takes the lines it can vouch for (:mod:`tracedb.ingest.scanned`), the parser
the rest (:mod:`tracedb.ingest.parse`), which rejects a bad line with its location and
keeps it in ``rejects`` while its neighbours are still ingested. Rows are built a batch
at a time (:mod:`tracedb.ingest.rows`) and inserted by the writer's thread
(:mod:`tracedb.ingest.writer`). One ``ingest_files`` call is one transaction: it lands
whole or not at all, and with ``strict=True`` any rejection aborts it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import pyarrow as pa
import simdjson

from tracedb import runtime
from tracedb.errors import IngestAborted, Location, RecordError
from tracedb.handle import Handle
from tracedb.ingest.files import find_files, read_chunks
from tracedb.ingest.parse import parse_line
from tracedb.ingest.rejects import Reject, Report, record_rejects
from tracedb.ingest.rows import Batch
from tracedb.ingest.writer import Writer, commit_into_file


@dataclass
class IngestReport(Report):
    """What one ``ingest`` call did."""

    files: int = 0
    lines: int = 0
    episodes: int = 0
    traces: int = 0
    skipped: int = 0
    """Traces already in the database (or earlier in this ingest): not added again."""
    nodes: int = 0
    tokens: int = 0
    segments_added: int = 0
    rejected: list[Reject] = field(default_factory=list)
    seconds: float = 0.0

    def __str__(self) -> str:
        return (
            f"ingested {self.traces} traces ({self.episodes} episodes, {self.nodes} nodes, "
            f"{self.tokens} tokens) from {self.files} files in {self.seconds:.2f}s"
        ) + self.notes("traces")


@dataclass
class _Seen:
    """What one ingest has added so far (not committed yet, so its reader cannot see it)."""

    traces: set[str] = field(default_factory=set)
    episodes: set[str] = field(default_factory=set)
    segments: set[bytes] = field(default_factory=set)


def _existing_segments(handle: Handle, reader: Any, keys: list[bytes]) -> set[bytes]:
    if not keys:
        return set()
    with handle.registered("_tdb_keys", pa.table({"segment_id": pa.array(keys, pa.binary())}), con=reader):
        rows = reader.execute(
            "SELECT segment_id FROM segments WHERE segment_id IN (SELECT segment_id FROM _tdb_keys)"
        ).fetchall()
    return {r[0] for r in rows}


def _resolve(handle: Handle, reader: Any, batch: Batch, report: IngestReport, seen: _Seen) -> None:
    """Turn pending lines into rows, leaving out traces, episodes and token segments the
    database already holds.

    ``reader`` sees the database as committed before this ingest; ``seen`` is what this
    ingest has added so far."""
    ids = [t.trace_id for line, _, _ in batch.pending for t in line.traces]
    episode_ids = [line.episode["id"] for line, _, _ in batch.pending if line.episode is not None]
    known = handle.existing("traces", "trace_id", ids, con=reader) | (seen.traces & set(ids))
    known_episodes = handle.existing("episodes", "episode_id", episode_ids, con=reader) | (
        seen.episodes & set(episode_ids)
    )
    for line, source, number in batch.pending:
        fresh = []
        for t in line.traces:
            if t.trace_id in known:
                report.skipped += 1
            else:
                known.add(t.trace_id)
                fresh.append(t)
        group = (line.episode or {}).get("group")
        group_id = group.get("id") if isinstance(group, dict) else None
        if line.episode is not None:
            if line.episode["id"] in known_episodes:
                line.episode = None  # already stored; its new traces still join it
            else:
                known_episodes.add(line.episode["id"])
                seen.episodes.add(line.episode["id"])
                report.episodes += 1
        batch.add(line, source, number, group_id, fresh)
        report.traces += len(fresh)
        report.nodes += sum(t.n_nodes for t in fresh)
        report.tokens += sum(t.n_tokens for t in fresh)
    seen.traces.update(known)
    segments = batch.segments
    new = [k for k in segments if k not in seen.segments]
    stored = _existing_segments(handle, reader, new)
    for key in list(segments):
        if key in seen.segments or key in stored:
            del segments[key]
    seen.segments.update(segments)
    report.segments_added += len(segments)


def _flush(handle: Handle, reader: Any, writer: Writer, batch: Batch, report: IngestReport, seen: _Seen) -> None:
    _resolve(handle, reader, batch, report, seen)
    writer.submit(batch.inserts())


def ingest_files(
    handle: Handle,
    paths: str | Path | Iterable[str | Path],
    *,
    strict: bool = False,
    allow_ragged: bool = False,
    progress: bool = False,
) -> IngestReport:
    """Ingest files or directories; see :meth:`tracedb.Database.ingest`."""
    # The scanner is numba: imported on the first ingest, not with tracedb (~0.35 s).
    from tracedb.ingest.scanned import Scanner, scan_chunk

    started = time.perf_counter()
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files = find_files(paths)
    report = IngestReport(files=len(files))
    parser = simdjson.Parser()
    rejects: list[tuple[Reject, bytes]] = []
    seen = _Seen()
    knobs = runtime.settings()
    con = handle.con
    con.execute("BEGIN TRANSACTION")
    reader: Any = None
    writer: Writer | None = None
    bar = None
    try:
        reader = handle.cursor()
        writer = Writer(con, knobs.write_alignment_rows)
        bar = _progress(files) if progress else None
        batch = Batch()
        scanner = Scanner()
        for path in files:
            source = str(path)
            for chunk in read_chunks(path, knobs.chunk_bytes):
                if bar is not None:
                    bar.advance(len(chunk.data))
                if knobs.scanner == "never":
                    scanned: list[Any] = [None] * len(chunk.starts)
                else:
                    _, scanned = scan_chunk(chunk, scanner, allow_ragged=allow_ragged)
                for k, line in enumerate(scanned):
                    number = int(chunk.numbers[k])
                    if line is None:  # not taken by the scanner (or blank)
                        raw = chunk.raw(k)
                        if not raw.strip():
                            continue
                        try:
                            line = parse_line(parser, raw, Location(source, number), allow_ragged=allow_ragged)
                        except RecordError as e:
                            report.lines += 1
                            reject = Reject.of(e)
                            if strict:
                                raise IngestAborted(e) from None
                            rejects.append((reject, raw))
                            report.rejected.append(reject)
                            continue
                    report.lines += 1
                    batch.pending.append((line, source, number))
                    batch.tokens += sum(t.n_tokens for t in line.traces)
                if batch.tokens >= knobs.batch_tokens:  # at a chunk's end: a block goes whole into one batch
                    _flush(handle, reader, writer, batch, report, seen)
                    batch = Batch()
        _flush(handle, reader, writer, batch, report, seen)
        writer.finish()
        record_rejects(handle, rejects)
        commit_into_file(handle)
    except BaseException:
        try:
            if writer is not None:
                writer.cancel()
        finally:
            if writer is not None:
                writer.wait()  # never roll back under a running INSERT
            # A failed COMMIT has ended the transaction already: its error is the one to see.
            with contextlib.suppress(duckdb.TransactionException):
                con.execute("ROLLBACK")
        raise
    finally:
        if reader is not None:
            reader.close()
        if bar is not None:
            bar.stop()
    handle.changed()
    report.seconds = time.perf_counter() - started
    return report


class _Bar:
    def __init__(self, total: int) -> None:
        from rich.progress import BarColumn, DownloadColumn, Progress, TimeRemainingColumn, TransferSpeedColumn

        self.progress = Progress(
            "[progress.description]{task.description}",
            BarColumn(),
            DownloadColumn(),
            TransferSpeedColumn(),
            TimeRemainingColumn(),
            transient=True,
        )
        self.task = self.progress.add_task("ingest", total=total)
        self.progress.start()

    def advance(self, n: int) -> None:
        self.progress.advance(self.task, n)

    def stop(self) -> None:
        self.progress.stop()


def _progress(files: list[Path]) -> _Bar:
    return _Bar(sum(p.stat().st_size for p in files))
