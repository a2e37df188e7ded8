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
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import duckdb
import numpy as np
import simdjson

from tracedb import jitcache, policy, runtime
from tracedb.errors import IngestAborted, InputError, Location, RecordError
from tracedb.handle import Handle, Numbering
from tracedb.ingest.files import ByteRange, Chunk, LongLine, find_files, read_chunks, read_range
from tracedb.ingest.parse import ParsedLine, parse_line
from tracedb.ingest.rejects import Raw, Reject, Report, record_rejects, storable_text
from tracedb.ingest.rows import Batch
from tracedb.ingest.tags import Tag, parse_tags
from tracedb.ingest.writer import Writer, commit_into_file

log = logging.getLogger("tracedb.ingest")
SCANNER_SOURCE = str(Path(__file__).with_name("_scan.py"))
"""The compiled scanner's source file (named, not imported: that imports numba)."""


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
    unreadable: list[str] = field(default_factory=list)
    """Files that could not be read to their end (corrupt or truncated compression): the
    lines before the damage were ingested; each is also a reject, naming the first line lost."""
    seconds: float = 0.0
    watermark: int | None = None
    """The highest sequence number this ingest gave a trace (None: it added none)."""

    def __str__(self) -> str:
        text = (
            f"ingested {self.traces} traces ({self.episodes} episodes, {self.nodes} nodes, "
            f"{self.tokens} tokens) from {self.files} files in {self.seconds:.2f}s"
        ) + self.notes("traces")
        if self.unreadable:
            text += f"; {len(self.unreadable)} file(s) could not be read to their end: {', '.join(self.unreadable)}"
        return text


@dataclass
class _Seen:
    """What one ingest has added so far (not committed yet, so its reader cannot see it)."""

    traces: set[str] = field(default_factory=set)
    episodes: set[str] = field(default_factory=set)
    segments: set[bytes] = field(default_factory=set)
    rows: dict[str, int] = field(default_factory=dict)
    """The reader's size of each table looked up (read once: only an ingest, which holds
    the writing lock, adds to them)."""


def _resolve(handle: Handle, reader: Any, batch: Batch, report: IngestReport, seen: _Seen) -> None:
    """Turn pending lines into rows, leaving out traces, episodes and token segments the
    database already holds.

    ``reader`` sees the database as committed before this ingest; ``seen`` is what this
    ingest has added so far."""
    ids = [t.trace_id for line, _, _ in batch.pending for t in line.traces]
    episode_ids = [line.episode["id"] for line, _, _ in batch.pending if line.episode is not None]
    for table in ("traces", "episodes", "segment_store"):
        if table not in seen.rows:
            seen.rows[table] = handle.table_rows(table, reader)
    known = handle.existing("traces", "trace_id", ids, con=reader, rows=seen.rows["traces"]) | (seen.traces & set(ids))
    known_episodes = handle.existing("episodes", "episode_id", episode_ids, con=reader, rows=seen.rows["episodes"]) | (
        seen.episodes & set(episode_ids)
    )
    for line, source, number in batch.pending:
        episode = line.episode
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
            elif line.traces and not fresh:
                # Every trace it carries is stored under another episode: its row would hold
                # none. A later line of this id with a new trace still adds it.
                line.episode = None
            else:
                known_episodes.add(line.episode["id"])
                seen.episodes.add(line.episode["id"])
                report.episodes += 1
        batch.add(line, source, number, group_id, fresh, episode)
        report.traces += len(fresh)
        report.nodes += sum(t.n_nodes for t in fresh)
        report.tokens += sum(t.n_tokens for t in fresh)
    seen.traces.update(known)
    segments = batch.segments
    new = [k for k in segments if k not in seen.segments]
    stored = handle.existing(
        "segment_store", "segment_id", new, con=reader, sql_type="BLOB", rows=seen.rows["segment_store"]
    )
    for key in list(segments):
        if key in seen.segments or key in stored:
            del segments[key]
    seen.segments.update(segments)
    report.segments_added += len(segments)


def _flush(handle: Handle, reader: Any, writer: Writer, batch: Batch, report: IngestReport, seen: _Seen) -> None:
    """Leave out what the database holds, then hand the batch's rows to the writer."""
    _resolve(handle, reader, batch, report, seen)
    writer.submit(batch.inserts())


class IngestRun:
    """One ingest under way: its transaction's connection, the reader that sees the
    database as it was before, the writer thread, the batch being filled, the report."""

    def __init__(
        self, handle: Handle, report: IngestReport, *, strict: bool, allow_ragged: bool, tags: Sequence[Tag] = ()
    ) -> None:
        self.handle = handle
        self.tags = tuple(tags)
        self.numbering: Numbering | None = None
        self.mapping: dict[str, int] = {}
        self.report = report
        self.strict = strict
        self.allow_ragged = allow_ragged
        self.bar: _Bar | None = None
        self.knobs = runtime.settings()
        self.parser = simdjson.Parser()
        self.scan: Any = None  # the compiled scanner (scan_only, then collect), when this ingest uses it
        self.collect: Any = None
        self.scanners: tuple[Any, Any] = (None, None)  # its buffers (two sets when one scan runs ahead)
        self.ahead = False  # whether the next chunk is scanned on another thread meanwhile
        self.turn = 0
        self.compiling = False
        self.rejects: list[tuple[Reject, bytes | Raw]] = []
        self.seen = _Seen()
        self.batch = Batch()
        self.reader: Any = None
        self.writer: Writer | None = None

    def start(self, files: Sequence[Path | ByteRange], progress: bool) -> None:
        """Inside the transaction: the reader, the writer thread, the progress bar, and
        which parser reads the lines (``scanner`` setting)."""
        self.reader = self.handle.cursor()
        self.numbering = self.handle.numbering()
        self.mapping = policy.mapping_of(self.reader)
        self.batch = Batch(self.numbering, self.tags, self.mapping)
        self.writer = Writer(self.handle.con, self.knobs.write_alignment_rows)
        self.bar = _progress(files) if progress else None
        if uses_scanner(self.knobs, files):
            # The scanner is numba: imported by the first ingest that uses it, not with tracedb.
            from tracedb.ingest import scanned

            self.scan, self.collect = scanned.scan_only, scanned.collect
            self.ahead = scans_ahead(self.knobs)
            self.scanners = (scanned.Scanner(), scanned.Scanner() if self.ahead else None)
            if not jitcache.is_compiled(SCANNER_SOURCE):
                self.compiling = True
                self.notice(
                    "compiling the ingest scanner (numba, once per install: ~20 s on 2 cores); later ingests load it"
                )

    def notice(self, text: str) -> None:
        """Something a person waiting for the ingest should know."""
        if self.bar is not None:
            self.bar.progress.console.print(text, style="dim")
        else:
            log.info(text)

    def read_file(self, path: Path) -> None:
        """Every line of one file into the batch (flushed at chunk ends once it is full)."""
        self.read(str(path), read_chunks(path, self.knobs.chunk_bytes))

    def read_range(self, part: ByteRange) -> None:
        """The lines of a byte range of a file, named and numbered as in the whole file."""
        self.read(str(part.path), read_range(part, self.knobs.chunk_bytes))

    def read(self, source: str, chunks: Iterable[Chunk | LongLine]) -> None:
        """The lines of ``chunks`` (of the file ``source``) into the batch, in order. With
        the scanner, the next chunk is scanned on a thread of its own (the kernel runs
        without the GIL) while this one's lines go into the batch and batches are flushed:
        the scan, the rows and the writer's INSERTs use both cores."""
        ahead: tuple[Chunk, Future[Any], Any] | None = None  # the chunk being scanned meanwhile, its buffers
        iterator = iter(chunks)
        while True:
            try:
                chunk = next(iterator)
            except StopIteration:
                break
            except Exception:  # a file damaged further on: the lines before it are kept
                if ahead is not None:
                    self.take(source, *ahead)
                raise
            if isinstance(chunk, LongLine):
                if ahead is not None:
                    self.take(source, *ahead)
                    ahead = None
                self.long_line(source, chunk)
                continue
            if self.bar is not None:
                self.bar.advance(len(chunk.data))
            if self.scan is None:
                self.take(source, chunk, None, None)
                continue
            if not self.ahead:  # one thread: scan the chunk, take its lines
                self.scan(chunk, self.scanners[0], allow_ragged=self.allow_ragged)
                self.take(source, chunk, None, self.scanners[0])
                continue
            # The other thread runs only the kernel, which holds no GIL; the Python half
            # (collect) runs here. Python on both threads made each DuckDB call and read of
            # this one wait for the GIL behind the other's (a 5 ms switch interval each).
            self.turn ^= 1  # the buffers of the chunk before are in use until it is taken
            scanner = self.scanners[self.turn]
            scanning = runtime.threads().submit(self.scan, chunk, scanner, allow_ragged=self.allow_ragged)
            if ahead is not None:
                self.take(source, *ahead)
            ahead = (chunk, scanning, scanner)
        if ahead is not None:
            self.take(source, *ahead)

    def take(self, source: str, chunk: Chunk, scanning: Future[Any] | None, scanner: Any) -> None:
        """The lines of one chunk into the batch (``scanner``: the buffers it was scanned
        into, by ``scanning`` when that ran on another thread; else the parser reads every
        line); a full batch is flushed at the chunk's end."""
        limit = self.knobs.max_line_bytes
        if scanner is None:
            lines: list[Any] = [None] * len(chunk.starts)
        else:
            if scanning is not None:
                scanning.result()
            _, lines = self.collect(chunk, scanner)
            if self.compiling:
                self.compiling = False
                jitcache.mark_compiled(SCANNER_SOURCE)
        long = np.flatnonzero(chunk.ends - chunk.starts > limit)  # within one block, over the limit all the same
        for k, line in enumerate(lines):
            number = int(chunk.numbers[k])
            if len(long) and k in long:
                raw = chunk.raw(k)
                self.long_line(source, LongLine(number, len(raw), b""), raw)
                continue
            if line is None:  # not taken by the scanner (or blank)
                raw = chunk.raw(k)
                if not raw.strip():
                    continue
                line = self.parse(raw, source, number)
                if line is None:
                    continue
            self.report.lines += 1
            self.batch.pending.append((line, source, number))
            self.batch.tokens += sum(t.n_tokens for t in line.traces)
        if self.batch.tokens >= self.knobs.batch_tokens:  # at a chunk's end: a scan goes whole into one batch
            self.flush()

    def parse(self, raw: bytes, source: str, number: int) -> ParsedLine | None:
        """One line the scanner did not take; None when it is rejected (and recorded)."""
        try:
            return parse_line(self.parser, raw, Location(source, number), allow_ragged=self.allow_ragged)
        except RecordError as e:
            self.report.lines += 1
            if self.strict:
                raise IngestAborted(e) from None
            self.reject(Reject.of(e), raw)
            return None

    def long_line(self, source: str, line: LongLine, raw: bytes | None = None) -> None:
        """A line over ``max_line_bytes``: rejected unparsed (``raw``: the whole line, when
        it was read whole within a block)."""
        self.report.lines += 1
        error = RecordError(line.reason, Location(source, line.number))
        if self.strict:
            raise IngestAborted(error) from None
        self.reject(Reject.of(error), raw if raw is not None else Raw(line.prefix, line.size))

    def unreadable(self, error: InputError) -> None:
        """A file that could not be read to its end: its lines before the damage stay."""
        if self.strict:
            raise IngestAborted(RecordError(error.reason, Location(error.file, error.line))) from None
        self.reject(
            Reject(storable_text(error.file), error.line, None, None, None, error.reason),
            Raw(error.partial, None),
        )
        self.report.unreadable.append(error.file)

    def reject(self, reject: Reject, raw: bytes | Raw) -> None:
        self.rejects.append((reject, raw))
        self.report.rejected.append(reject)

    def flush(self) -> None:
        assert self.writer is not None
        _flush(self.handle, self.reader, self.writer, self.batch, self.report, self.seen)
        self.batch = Batch(self.numbering, self.tags, self.mapping)

    def finish(self, before_commit: Callable[[], None] | None = None) -> None:
        """Write what is left, the rejects and the new watermark (and what
        ``before_commit`` writes: a follower's positions), and COMMIT."""
        assert self.writer is not None
        self.flush()
        self.writer.finish()
        record_rejects(self.handle, self.rejects)
        assert self.numbering is not None
        last = self.numbering.store()
        if last is not None:
            self.report.watermark = last
        if before_commit is not None:
            before_commit()
        commit_into_file(self.handle, large=self.report.tokens >= self.knobs.checkpoint_min_tokens)

    def abort(self) -> None:
        """Stop the writer (through a second Ctrl-C) and roll back."""
        try:
            if self.writer is not None:
                self.writer.cancel()
        finally:
            if self.writer is not None:
                self.writer.wait()  # never roll back under a running INSERT
            # A failed COMMIT has ended the transaction already: its error is the one to see.
            with contextlib.suppress(duckdb.TransactionException):
                self.handle.con.execute("ROLLBACK")

    def close(self) -> None:
        if self.reader is not None:
            self.reader.close()
        if self.bar is not None:
            self.bar.stop()


@contextlib.contextmanager
def transaction_for_ingest(handle: Handle) -> Iterator[None]:
    """Hold the database's write lock, then BEGIN (the transaction's snapshot must see
    every ingest committed before it, or two would hand out the same sequence numbers);
    the body COMMITs or rolls back. Readers waiting for new traces are woken afterwards."""
    with handle.sequencing():
        handle.con.execute("BEGIN TRANSACTION")
        try:
            yield
        finally:
            handle.changed()


def ingest_files(
    handle: Handle,
    paths: str | Path | Iterable[str | Path],
    *,
    strict: bool = False,
    allow_ragged: bool = False,
    progress: bool = False,
    whole_files: bool = False,
    tags: Iterable[str | Tag] = (),
    ranges: Sequence[ByteRange] = (),
) -> IngestReport:
    """Ingest files or directories; see :meth:`tracedb.Database.ingest`.

    ``ranges`` are byte ranges of plain ``.jsonl`` files ingested after ``paths`` in the
    same transaction, their lines (and rejects) named and numbered as in the whole file:
    the lake's ingest cuts a large file into ranges at line starts, one per Ray task.

    A file that cannot be read to its end (corrupt or cut-short compression) keeps the
    lines read before the damage and is reported (a reject naming the file and the first
    line lost, and ``report.unreadable``); with ``strict`` the ingest aborts instead, and
    with ``whole_files`` (a request body is one unit) it raises :class:`InputError` and
    writes nothing. ``tags`` (``"name=value"`` / ``"name=$.json.path"`` or
    :class:`~tracedb.ingest.tags.Tag`) are stored on every trace added
    (:mod:`tracedb.ingest.tags`)."""
    started = time.perf_counter()
    files = find_files([paths] if isinstance(paths, (str, Path)) else paths)
    report = IngestReport(files=len(files) + len({r.path for r in ranges}))
    run = IngestRun(handle, report, strict=strict, allow_ragged=allow_ragged, tags=parse_tags(tags))
    with transaction_for_ingest(handle):
        try:
            run.start([*files, *ranges], progress)
            for path in files:
                try:
                    run.read_file(path)
                except InputError as e:
                    if whole_files:
                        raise
                    run.unreadable(e)
            for part in ranges:
                run.read_range(part)
            run.finish()
        except BaseException:
            run.abort()
            raise
        finally:
            run.close()
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


def uses_scanner(knobs: runtime.Settings, files: Sequence[Path | ByteRange]) -> bool:
    """Whether an ingest of ``files`` reads them with the compiled scanner (the ``scanner``
    setting; with ``auto``: loaded in this process already, or an input large enough
    that loading or compiling it pays)."""
    if knobs.scanner != "auto":
        return knobs.scanner != "never"
    if _scanner_loaded():
        return True
    threshold = knobs.scanner_load_bytes if jitcache.is_compiled(SCANNER_SOURCE) else knobs.scanner_min_bytes
    return sum(_size(p) for p in files) >= threshold


def scans_ahead(knobs: runtime.Settings) -> bool:
    """Whether the scanner reads the next chunk on a second thread (the ``scan_ahead``
    setting; with ``auto``: unless the process may use only one CPU,
    :func:`tracedb.runtime.spare_core`)."""
    if knobs.scan_ahead != "auto":
        return knobs.scan_ahead != "never"
    return runtime.spare_core()


def _scanner_loaded() -> bool:
    """Whether this process has run the compiled scanner already (numba imported and the
    kernel loaded: using it again costs nothing), told without importing it."""
    kernel = sys.modules.get("tracedb.ingest._scan")
    return kernel is not None and bool(getattr(kernel.scan, "signatures", ()))


def _size(file: Path | ByteRange) -> int:
    return file.size if isinstance(file, ByteRange) else file.stat().st_size


def _progress(files: Sequence[Path | ByteRange]) -> _Bar:
    return _Bar(sum(_size(p) for p in files))
