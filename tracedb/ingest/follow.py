"""Following a run while it writes: ``tracedb ingest --follow``.

verifiers appends one finished episode per line to ``traces.jsonl`` while a run goes on.
A :class:`Follower` polls its paths (files, and directories in which new ``.jsonl`` /
``.jsonl.zst`` files appear, recursively) and ingests what is new, one transaction per
poll. Rules (``docs/live.md`` says what each can and cannot lose):

- **Whole lines only.** A line is taken when its line break is there; the bytes after the
  last one wait for the next poll.
- **Exactly once.** Where the follower is in each file (its identity, the byte offset and
  line number after the last whole line read, hashes of its first bytes and of the bytes
  just before the offset) is written to ``follow_positions`` in the same transaction as
  the lines read up to there, so a follower killed at any moment and started again
  continues where the last commit ended: nothing lost, nothing twice.
- **The identity rule.** Every poll, a followed file must still hold, at its first bytes
  and just before the committed offset, the bytes whose hashes were committed (at most
  8 KiB read per file and poll; none for a file whose size and times have not moved since
  a check). A file that shrank below its position, or holds other bytes there (cut back
  and grown again past the offset: a writer resuming from a checkpoint), is reported
  (``FollowReport.restarts``) and read again from its start: ingest being idempotent by
  trace id, its old traces are "already present" and its new ones are added.
- **Rotation.** A followed file renamed away (``traces.jsonl.1``, any other name, another
  directory) is found by its identity (device and inode): through the descriptor the
  follower holds on it, or in its directory. It is read to its end first, and followed
  under its new name while it grows (a writer may still be writing to it); then the file
  that took its name is read from its start. A rename inside the followed paths (to
  ``traces.1.jsonl`` in a followed directory) keeps its position under the new name. A
  file deleted while followed is read to its end through the held descriptor.
- **copytruncate.** A file cut back under the same inode is looked for in a copy
  (``NAME.1``, ``NAME.<n>``, ``NAME-<date>`` and the ``rotated`` patterns) whose bytes up
  to the position hash to what was read; its lines after the position are read, then the
  file from its start. What the writer wrote between the copy and the truncation is in
  neither file: what the follower can establish of it (a line the copy ends inside, bytes
  seen at the last poll past the copy's end, a line's end at the start of the truncated
  file) is reported as lost with its bytes and lines (``FollowReport.lost``), never
  ingested as a bogus reject; lines written after the last poll and before the truncation
  leave no trace and cannot be counted (said in the rotation message).
- **Compressed files** (``.jsonl.zst``, ``.json``) are taken whole once they have not
  changed for ``settle`` seconds and (zstd) their last frame is complete; until then
  they are waited for, not rejected. One that grows later is read again, its lines up to
  the position skipped.
- Rejected lines are kept with their reason, as in any ingest, and do not stop it.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path

import numpy as np
import simdjson

from tracedb import runtime
from tracedb.errors import InputError
from tracedb.handle import Handle
from tracedb.ingest import positions
from tracedb.ingest.changes import Plan, Planner, Read
from tracedb.ingest.files import Appended, Chunk, LongLine, read_chunks
from tracedb.ingest.positions import FollowEvent, FollowReport, Position, follow_positions
from tracedb.ingest.rotation import HASH_BYTES, OpenFiles, check_patterns, head_of, identity, tail_of
from tracedb.ingest.run import IngestReport, IngestRun, transaction_for_ingest
from tracedb.ingest.tags import Tag, parse_tags

__all__ = ["FollowEvent", "FollowReport", "Follower", "Position", "follow_positions"]
log = logging.getLogger("tracedb.follow")


class _Changed(Exception):
    """A file's bytes before the position changed while it was read: the poll is undone."""


def _json_object(data: bytes) -> bool:
    """Whether ``data`` is one whole JSON object (a record, not the end of a cut line)."""
    try:
        return isinstance(simdjson.Parser().parse(data), simdjson.Object)
    except (ValueError, TypeError):
        return False


def _skip_lines(chunks: Iterable[Chunk | LongLine], upto: int) -> Iterator[Chunk | LongLine]:
    """The chunks' lines after line ``upto`` (those before were read by an earlier poll)."""
    for chunk in chunks:
        if isinstance(chunk, LongLine):
            if chunk.number > upto:
                yield chunk
            continue
        if not len(chunk.numbers) or chunk.numbers[-1] <= upto:
            continue
        if chunk.numbers[0] > upto:
            yield chunk
            continue
        keep = chunk.numbers > upto
        yield Chunk(chunk.data, chunk.starts[keep], chunk.ends[keep], chunk.numbers[keep])


class _Counted:
    """A compressed file's chunks, counting its lines (the position after a whole read)."""

    def __init__(self, path: Path, skip: int) -> None:
        self.path = path
        self.skip = skip
        self.lines = 0

    def __iter__(self) -> Iterator[Chunk | LongLine]:
        yield from _skip_lines(self._all(), self.skip)

    def _all(self) -> Iterator[Chunk | LongLine]:
        for chunk in read_chunks(self.path):
            if isinstance(chunk, LongLine):
                self.lines = chunk.number
            elif len(chunk.numbers):
                self.lines = int(chunk.numbers[-1])
            yield chunk


class Follower:
    """Follows ``paths`` into the database of ``handle`` (which it writes through; give it
    a handle of its own when other threads use the database). :meth:`poll` ingests what
    is new once; :meth:`run` polls until stopped; :meth:`close` lets go of the files.

    ``rotated``: globs (in a followed file's directory; ``{name}`` is its name, ``{stem}``
    that name without ``.jsonl``) where a rotated copy of it may be, looked at besides
    ``NAME.1``, ``NAME.<n>`` and ``NAME-<date>``. ``on_event`` is called with each
    :class:`FollowEvent` once the poll that found it has committed."""

    def __init__(
        self,
        handle: Handle,
        paths: Sequence[str | Path],
        *,
        interval: float = 0.25,
        settle: float = 2.0,
        tags: Iterable[str | Tag] = (),
        allow_ragged: bool = False,
        batch_bytes: int | None = None,
        rotated: Iterable[str] = (),
        on_commit: Callable[[IngestReport], None] | None = None,
        on_event: Callable[[FollowEvent], None] | None = None,
    ) -> None:
        if interval <= 0 or settle < 0:
            raise ValueError(f"interval must be > 0 and settle >= 0 (got {interval}, {settle})")
        self.handle = handle
        self.paths = [Path(p) for p in paths]
        self.interval = interval
        self.settle = settle
        self.tags = parse_tags(tags)
        self.allow_ragged = allow_ragged
        knobs = runtime.settings()
        self.batch_bytes = batch_bytes or knobs.follow_batch_bytes
        self.on_commit = on_commit
        self.on_event = on_event
        self.report = FollowReport(watermark=handle.watermark())
        self.positions = positions.load(handle)
        self.open = OpenFiles(knobs.follow_open_files)
        self.planner = Planner(
            self.paths,
            self.positions,
            settle=settle,
            rotated=check_patterns(rotated),
            open_files=self.open,
            waiting=self.report.waiting,
        )
        self.behind = False
        """The last poll stopped at its byte budget with more to read."""

    def close(self) -> None:
        """Close the descriptors held on the followed files."""
        self.open.close()

    def __enter__(self) -> Follower:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _store(self, moved: list[Position], drops: set[str]) -> None:
        """Write the new positions and remove the dropped ones (inside the ingest's transaction)."""
        positions.store(self.handle, moved, drops)

    def files(self) -> list[Path]:
        """The files the paths name now (a path that does not exist yet names none)."""
        return self.planner.files()

    def poll(self) -> IngestReport | None:
        """Ingest what is new in the files, in one transaction; None when there was nothing."""
        self.report.polls += 1
        plan = self.planner.plan()
        self.report.files = plan.files
        if not plan.reads and not plan.touched and not plan.drops:
            self._after(plan)
            return None
        return self._ingest(plan)

    # ----------------------------------------------------------------- reading

    def _ingest(self, plan: Plan) -> IngestReport | None:
        report = IngestReport(files=len({str(r.source) for r in plan.reads}))
        run = IngestRun(self.handle, report, strict=False, allow_ragged=self.allow_ragged, tags=self.tags)
        moved: dict[str, Position] = dict(plan.touched)
        done: list[tuple[Read, int, int]] = []  # (read, from, to)
        budget = self.batch_bytes
        self.behind = False
        drops: set[str] = set()
        try:
            with transaction_for_ingest(self.handle):
                try:
                    run.start([r.source for r in plan.reads if r.source.exists()], progress=False)
                    deferred: set[str] = set()
                    for r in plan.reads:
                        deferrable = r.key is not None and not r.store and not r.final
                        if deferrable and (budget <= 0 or r.followed in deferred):
                            self.behind = True  # the rest at once, in the next poll
                            deferred.add(r.followed)
                            continue
                        end, position = self._read(run, r, budget)
                        done.append((r, r.start.offset, end))
                        if r.notice is not None and (end > r.start.offset or (r.loss is not None and r.loss.bytes)):
                            plan.note("rotation", r.followed, r.notice)
                        if position is not None:
                            moved[position.path] = position
                        budget -= max(0, end - r.start.offset)
                    drops = plan.drops - set(moved)
                    # Nothing moved (a writer was mid-line everywhere): an empty commit, no positions.
                    run.finish(
                        before_commit=lambda: self._store(list(moved.values()), drops) if moved or drops else None
                    )
                except BaseException:
                    run.abort()
                    raise
                finally:
                    run.close()
        except _Changed as e:
            log.info("%s changed while it was read; read again at the next poll", e)
            return None
        for name in drops:
            self.positions.pop(name, None)
        for position in moved.values():
            self.positions[position.path] = position
        for r, _, _ in done:
            if r.cut_first and r.fd is not None and r.key is not None and r.key in moved and moved[r.key].line > 0:
                self.open.watch(identity(os.fstat(r.fd))).cut_first = False
        self._after(plan)
        progressed = any(r.key in moved and moved[r.key] is not plan.touched.get(r.key) for r, _, _ in done)
        if not progressed and not report.lines:
            return None  # positions only (a tail hash taken, a rename): not a commit of lines
        self._count(report, done)
        if self.on_commit is not None:
            self.on_commit(report)
        return report

    def _after(self, plan: Plan) -> None:
        """Once the poll is over: let go of the files no longer followed, publish what happened."""
        followed = {(p.device, p.inode) for p in self.positions.values()}
        for key in plan.forget - followed:
            self.open.forget(key)
        events = list(plan.events)
        for loss in plan.losses:
            if loss.bytes:
                # The bytes known lost are of at least one line; how many more cannot be told.
                message = f"{loss.file}: lost at least {loss.bytes} bytes (1 line): " + "; ".join(loss.notes)
                events.append(FollowEvent("loss", loss.file, message, loss.bytes, 1))
        for event in events:
            if event.kind == "restart":
                self.report.restarts.append(event.message)
            elif event.kind == "rotation":
                self.report.rotations.append(event.message)
            else:
                self.report.lost.append(event)
                self.report.lost_bytes += event.bytes
                self.report.lost_lines += event.lines
            if self.on_event is not None:
                log.info(event.message)
                self.on_event(event)  # its owner says it
            else:
                (log.error if event.kind == "loss" else log.warning)(event.message)

    def _read(self, run: IngestRun, r: Read, budget: int) -> tuple[int, Position | None]:
        """Read one file into the ingest: the offset reached, and the position to store."""
        if r.compressed:
            return self._read_compressed(run, r)
        assert r.fd is not None
        start = r.start
        whole = r.final or r.key is None
        appended = Appended(r.source, start.offset, start.line, sys.maxsize if whole else budget, fd=r.fd)
        chunks: Iterable[Chunk | LongLine] = appended
        if r.cut_first and start.line == 0:
            chunks = self._cut_first(appended, r)
        run.read(str(r.source), chunks)
        self.behind = self.behind or appended.more
        if start.offset > 0 and start.tail is not None and tail_of(r.fd, start.offset) != start.tail:
            raise _Changed(str(r.source))
        end, line = appended.offset, appended.line
        if r.final:
            size = os.fstat(r.fd).st_size
            if size > end:
                line += 1
                self._fragment(run, r, end, size, line)
                end = size
        st = os.fstat(r.fd)
        self.open.watch(identity(st)).behind = appended.more
        if r.key is None:
            return end, None
        if end == start.offset and not r.store:
            return end, None  # no whole line yet
        head = start.head if start.offset >= HASH_BYTES and start.head is not None else head_of(r.fd, end)
        return end, Position(r.key, st.st_dev, st.st_ino, end, line, head, tail_of(r.fd, end), r.rotated_from)

    def _cut_first(self, chunks: Iterable[Chunk | LongLine], r: Read) -> Iterator[Chunk | LongLine]:
        """The chunks, without the first line when it is not a JSON object (the end of a
        line cut by a truncation, counted as lost)."""
        first = True
        for chunk in chunks:
            if first and isinstance(chunk, Chunk) and len(chunk.numbers):
                first = False
                raw = chunk.raw(0)
                if raw.strip() and not _json_object(raw):
                    assert r.loss is not None  # a cut-first read has one
                    r.loss.add(
                        len(raw), f"line 1 of {r.source} is the end of a line cut by the truncation ({len(raw)} bytes)"
                    )
                    keep = np.arange(len(chunk.numbers)) > 0
                    chunk = Chunk(chunk.data, chunk.starts[keep], chunk.ends[keep], chunk.numbers[keep])
                    if not len(chunk.numbers):
                        continue
            elif isinstance(chunk, LongLine):
                first = False
            yield chunk

    def _fragment(self, run: IngestRun, r: Read, end: int, size: int, line: int) -> None:
        """The unfinished last line of a file that will not grow: ingested when it is a
        whole JSON object (only its line break was missing), else counted as lost."""
        assert r.fd is not None
        n = size - end
        if n <= runtime.settings().max_line_bytes:
            data = os.pread(r.fd, n, end)
            if _json_object(data):
                one = np.zeros(1, np.int64)
                run.read(str(r.source), [Chunk(data + b"\n", one, one + n, one + line)])
                return
        assert r.loss is not None  # a final read has one
        r.loss.add(n, f"line {line} of {r.source} ends the file unfinished ({n} bytes, no line break)")

    def _read_compressed(self, run: IngestRun, r: Read) -> tuple[int, Position | None]:
        path, start = r.source, r.start
        counted = _Counted(path, start.line)
        try:
            run.read(str(path), counted)
        except InputError as e:
            run.unreadable(e)  # damaged (not merely unfinished): rejected, and not read again until it changes
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            head, tail = head_of(f.fileno(), st.st_size), tail_of(f.fileno(), st.st_size)
        position = Position(
            r.key or str(path), st.st_dev, st.st_ino, st.st_size, max(counted.lines, start.line), head, tail
        )
        return st.st_size, position

    def _count(self, report: IngestReport, done: list[tuple[Read, int, int]]) -> None:
        total = self.report
        total.commits += 1
        total.traces += report.traces
        total.skipped += report.skipped
        total.lines += report.lines
        total.rejected += len(report.rejected)
        total.bytes += sum(max(0, b - a) for _, a, b in done)
        if report.watermark is not None:
            total.watermark = report.watermark

    def run(self, stop: threading.Event | None = None, *, until_idle: bool = False) -> FollowReport:
        """Poll every ``interval`` seconds until ``stop`` is set (the poll under way, and
        its transaction, finish first), or, with ``until_idle``, until a poll finds nothing
        and no compressed file is waited for. A poll that stopped at its byte budget is
        followed by the next one at once."""
        stop = stop or threading.Event()
        while not stop.is_set():
            began = time.monotonic()
            result = self.poll()
            if until_idle and result is None and not self.report.waiting:
                break
            if result is None or not self.behind:
                stop.wait(max(0.0, self.interval - (time.monotonic() - began)))
        return self.report
