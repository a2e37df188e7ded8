"""Input files: which ones a path names, and their lines.

``traces.jsonl`` (one record per line), ``.jsonl.zst`` (the same, zstd-compressed) and
``.json`` (one record, possibly pretty-printed); a directory stands for the ``.jsonl`` and
``.jsonl.zst`` files below it. Trace ingest reads chunks of whole lines
(:func:`read_chunks`, for the compiled scanner); counterfactual-edit-credit ingest reads
line by line (:func:`read_lines`). Both follow the same line rules: a line is what lies
between line breaks, its ``\\r\\n`` or ``\\n`` is not part of it, and blank lines are
skipped but counted.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Generator, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracedb import runtime
from tracedb.errors import InputError

SUFFIXES = (".jsonl", ".jsonl.zst")
"""What a directory's files must end with to be ingested."""


def find_files(paths: Iterable[str | Path]) -> list[Path]:
    """Expand directories (recursively, sorted) into their ``.jsonl`` / ``.jsonl.zst`` files."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_dir():
            found = [q for q in p.rglob("*") if q.is_file() and q.name.endswith(SUFFIXES)]
            out.extend(sorted(found))
        elif p.exists():
            out.append(p)
        else:
            raise FileNotFoundError(f"no such file or directory: {p}")
    return out


def open_input(path: Path) -> io.BufferedIOBase:
    """The file's bytes, decompressed when its name ends with ``.zst``; a compressed file
    that is not zstd, is corrupt, or ends inside a frame raises :class:`InputError` when
    the reading gets there (everything before it has been handed out)."""
    if path.name.endswith(".zst"):
        return io.BufferedReader(_Zstd(path), 1 << 20)
    return open(path, "rb", buffering=1 << 20)


class _Zstd(io.RawIOBase):
    """A zstd file's decompressed bytes, frame after frame, that knows where it ends: the
    stream readers of ``zstandard`` stop quietly at a frame cut short, which would ingest
    half a file as if it were all of it."""

    def __init__(self, path: Path) -> None:
        import zstandard

        self._path = path
        self._file = open(path, "rb")
        self._zstd = zstandard
        self._decompressor = zstandard.ZstdDecompressor()
        self._frame = self._decompressor.decompressobj()
        self._in_frame = False  # bytes of a frame fed, its end not reached yet
        self._ready = b""
        self._error: InputError | None = None
        self._ended = False  # the read before the damage's said "end"

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        # A damage found first reads as the end (0 bytes), and is raised by the read after
        # that: a buffered read of many blocks would drop the bytes before it with the error.
        while not self._ready:
            if self._error is not None:
                if not self._ended:
                    self._ended = True
                    return 0
                raise self._error
            data = self._file.read(1 << 20)
            if not data:
                if self._in_frame:
                    self._error = InputError(str(self._path), "truncated: the file ends inside a zstd frame")
                    self._in_frame = False
                    continue
                return 0
            self._ready = self._feed(data)
        n = min(len(buffer), len(self._ready))
        buffer[:n] = self._ready[:n]
        self._ready = self._ready[n:]
        return n

    def _feed(self, data: bytes) -> bytes:
        out = []
        while data:
            try:
                out.append(self._frame.decompress(data))
            except self._zstd.ZstdError as e:
                self._error = InputError(str(self._path), f"not valid zstd data: {e}")
                break
            self._in_frame = True
            if self._frame.eof:  # a frame ended: the rest is the next one
                data = self._frame.unused_data
                self._frame = self._decompressor.decompressobj()
                self._in_frame = False
            else:
                data = b""
        return b"".join(out)

    def close(self) -> None:
        self._file.close()
        super().close()


def read_lines(path: Path) -> Iterator[tuple[int, bytes | LongLine]]:
    """(line number, bytes) of each non-blank record; a ``.json`` file is one record. A
    line over the ``max_line_bytes`` setting comes as a :class:`LongLine`, read past without
    being held. A file cut short raises :class:`InputError` naming the first line lost."""
    number = 0  # the lines read whole so far
    knobs = runtime.settings()
    limit = knobs.max_line_bytes
    line = b""
    try:
        with open_input(path) as f:
            if path.suffix == ".json":
                if path.stat().st_size > limit:
                    yield 1, LongLine(1, path.stat().st_size, f.read(knobs.reject_record_bytes))
                    return
                data = f.read()
                if data.strip():
                    yield 1, data
                return
            # A line without its line break ends the file, or was cut by a damage: the
            # read after it (f.read(1)) raises the damage, and the line is the first lost.
            while line := f.readline(limit + 1):
                if len(line) > limit and not line.endswith(b"\n"):
                    size, prefix = len(line), line[: knobs.reject_record_bytes]
                    while (rest := f.readline(1 << 20)) and not rest.endswith(b"\n"):
                        size += len(rest)
                    if not rest:
                        f.read(1)
                    size += len(rest.rstrip(b"\r\n"))
                    number += 1
                    yield number, LongLine(number, size, prefix)
                    continue
                if not line.endswith(b"\n"):
                    f.read(1)
                number += 1
                if line.strip():
                    yield number, line.rstrip(b"\r\n")
            f.read(1)  # at the end: a damage found there is raised now
    except InputError as e:
        raise InputError(e.file, e.reason, number + 1, line[: knobs.reject_record_bytes]) from None


@dataclass
class Chunk:
    """Whole lines of a file: ``data[starts[k]:ends[k]]`` is line ``numbers[k]``."""

    data: bytes
    starts: np.ndarray
    ends: np.ndarray
    numbers: np.ndarray

    def raw(self, k: int) -> bytes:
        """Line ``k`` as ``read_lines`` gives it (without its line break)."""
        return self.data[self.starts[k] : self.ends[k]].rstrip(b"\r\n")


def _chunk(data: bytes, first_number: int) -> Chunk:
    if not data.endswith(b"\n"):
        data += b"\n"  # every line is followed by a byte (see tracedb.ingest._scan)
    starts, ends = [], []
    start, find = 0, data.find
    while (end := find(b"\n", start)) >= 0:
        starts.append(start)
        ends.append(end)
        start = end + 1
    numbers = np.arange(first_number, first_number + len(starts), dtype=np.int64)
    return Chunk(data, np.array(starts, np.int64), np.array(ends, np.int64), numbers)


@dataclass
class LongLine:
    """A line over the ``max_line_bytes`` setting: never held whole, rejected unread."""

    number: int
    size: int
    """Its length in bytes (without the line break)."""
    prefix: bytes
    """Its first bytes (``reject_record_bytes``), kept with the reject."""

    @property
    def reason(self) -> str:
        limit = runtime.settings().max_line_bytes
        return f"line of {self.size} bytes is over the limit of {limit} bytes (max_line_bytes); not read"


class _Lines:
    """Cuts read bytes into numbered chunks of whole lines, counting the lines handed out."""

    def __init__(self, chunk_bytes: int | None, first_number: int = 1) -> None:
        self.knobs = runtime.settings()
        self.size = max(chunk_bytes or self.knobs.chunk_bytes, 1)
        self.number = first_number
        """The number the next line gets."""

    def cut(self, data: bytes) -> Iterator[Chunk]:
        size, start = self.size, 0
        while start < len(data):
            end = data.find(b"\n", start + size - 1) + 1 if len(data) - start >= 2 * size else 0
            piece = data[start : end or len(data)] if start or end else data
            chunk = _chunk(piece, self.number)
            self.number += len(chunk.starts)
            start = end or len(data)
            yield chunk

    def long_line(self, size: int, prefix: bytes) -> LongLine:
        self.number += 1
        return LongLine(self.number - 1, size, prefix[: self.knobs.reject_record_bytes])


def read_chunks(path: Path, chunk_bytes: int | None = None) -> Iterator[Chunk | LongLine]:
    """The file's lines in chunks of at least ``chunk_bytes`` (default: the
    ``chunk_bytes`` setting) up to a line break; a ``.json`` file is one record. Each byte
    is copied once on the way (from the read block into its chunk). A line longer than the
    ``max_line_bytes`` setting that spans blocks comes as a :class:`LongLine` instead,
    read past without being held. A file cut short raises :class:`InputError` naming the
    first line lost, after every whole line before it."""
    lines = _Lines(chunk_bytes)
    knobs = lines.knobs
    try:
        with open_input(path) as f:
            if path.suffix == ".json":
                if path.stat().st_size > knobs.max_line_bytes:
                    yield lines.long_line(path.stat().st_size, f.read(knobs.reject_record_bytes))
                    return
                data = f.read()
                if data:
                    end = np.array([len(data)], np.int64)
                    yield Chunk(data + b"\n", np.zeros(1, np.int64), end, np.ones(1, np.int64))
                return
            yield from _blocks(f, max(lines.size, 1 << 16), knobs.max_line_bytes, lines.cut, lines.long_line)
    except _Cut as e:
        raise InputError(e.error.file, e.error.reason, lines.number, e.partial[: knobs.reject_record_bytes]) from None


@dataclass(frozen=True)
class ByteRange:
    """The lines of a plain ``.jsonl`` file that start in bytes ``[start, stop)``,
    numbered from ``first_line`` (the file's line number of the first of them). ``start``
    and ``stop`` are line starts: 0, just after a line break, or the file's size."""

    path: Path
    start: int
    stop: int
    first_line: int = 1

    @property
    def size(self) -> int:
        return self.stop - self.start


def read_range(part: ByteRange, chunk_bytes: int | None = None) -> Iterator[Chunk | LongLine]:
    """:func:`read_chunks` of the lines of ``part`` alone, numbered as in the whole file."""
    if part.path.name.endswith(".zst") or part.path.suffix == ".json":
        raise ValueError(f"{part.path}: only a plain .jsonl file is read in byte ranges")
    lines = _Lines(chunk_bytes, part.first_line)
    with open(part.path, "rb", buffering=0) as raw:
        raw.seek(part.start)
        f = io.BufferedReader(_Bounded(raw, part.size), 1 << 20)
        yield from _blocks(f, max(lines.size, 1 << 16), lines.knobs.max_line_bytes, lines.cut, lines.long_line)


class Appended:
    """The whole lines appended to a plain ``.jsonl`` file since a position: iterate for
    the chunks (numbered on from the position's line), then :attr:`offset` and
    :attr:`line` are the position after the last whole line read. A last line without its
    line break yet is left for later (a writer may be in the middle of it), and so is a
    line over ``max_line_bytes`` until its end is there. ``fd``: read through this open
    descriptor (a follower's, on a file that may have been renamed or deleted since) rather
    than by opening ``path``."""

    def __init__(
        self, path: Path, offset: int, line: int, budget: int, chunk_bytes: int | None = None, fd: int | None = None
    ) -> None:
        self.path = path
        self.fd = fd
        self.offset = offset
        self.line = line
        self.budget = budget
        """Read about this many bytes at most (more when one line is longer)."""
        self.chunk_bytes = chunk_bytes
        self.more = False
        """The file held more bytes than the budget let this read take."""

    def __iter__(self) -> Iterator[Chunk | LongLine]:
        lines = _Lines(self.chunk_bytes, self.line + 1)
        limit = lines.knobs.max_line_bytes
        opened = (
            open(self.path, "rb", buffering=0) if self.fd is None else os.fdopen(os.dup(self.fd), "rb", buffering=0)
        )
        with opened as raw:
            end = os.fstat(raw.fileno()).st_size
            stop = min(end, self.offset + max(self.budget, limit + 1))
            self.more = stop < end
            if stop <= self.offset:
                return
            raw.seek(self.offset)
            f = io.BufferedReader(_Bounded(raw, stop - self.offset), 1 << 20)
            tail = yield from _blocks(f, max(lines.size, 1 << 16), limit, lines.cut, lines.long_line, hold_tail=True)
        self.offset = stop - tail
        self.line = lines.number - 1


class _Bounded(io.RawIOBase):
    """At most ``left`` bytes of a file, from where it is."""

    def __init__(self, raw: io.RawIOBase, left: int) -> None:
        self._raw = raw
        self._left = left

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        if self._left <= 0:
            return 0
        view = memoryview(buffer)[: self._left]
        n = self._raw.readinto(view) or 0
        self._left -= n
        return n


class _Cut(Exception):
    """An :class:`InputError` met after ``partial`` (the start of the line it cut) was read."""

    def __init__(self, error: InputError, partial: bytes) -> None:
        self.error = error
        self.partial = partial


def _blocks(
    f: io.BufferedIOBase,
    block_size: int,
    limit: int,
    cut: Callable[[bytes], Iterator[Chunk]],
    long_line: Callable[[int, bytes], LongLine],
    hold_tail: bool = False,
) -> Generator[Chunk | LongLine, None, int]:
    """Read ``f`` in blocks and cut them into chunks of whole lines; the line a block ends
    inside is carried (as parts, not grown by copying) into the next block, and one that
    grows past ``limit`` is read past to its end and handed out as a :class:`LongLine`.
    The last line, when no line break ends it, is handed out too, unless ``hold_tail``:
    then it is not, and the return value is its length (0 otherwise)."""
    parts: list[bytes] = []  # the carried line, so far
    carried = 0
    skipped = 0  # > 0: reading past a long line, this many bytes so far
    prefix = b""
    try:
        while block := f.read(block_size):
            if skipped:
                end = block.find(b"\n")
                if end < 0:
                    skipped += len(block)
                    continue
                yield long_line(skipped + end, prefix)
                skipped, block = 0, block[end + 1 :]
            last = block.rfind(b"\n")
            if last < 0:
                parts.append(block)
                carried += len(block)
                if carried > limit:  # a long line: read past it from here
                    prefix, skipped = b"".join(parts[:4]), carried  # its start, for the reject
                    parts, carried = [], 0
                continue
            if parts:
                first = block.find(b"\n")
                if carried + first > limit:  # the carried line ends here, too long
                    yield long_line(carried + first, b"".join(parts))
                    parts, carried, block = [], 0, block[first + 1 :]
                    last = block.rfind(b"\n")
                    if last < 0:
                        parts, carried = ([block], len(block)) if block else ([], 0)
                        continue
            data = b"".join((*parts, memoryview(block)[: last + 1])) if parts or last + 1 < len(block) else block
            tail = block[last + 1 :]
            parts, carried = ([tail], len(tail)) if tail else ([], 0)
            yield from cut(data)
        # The read that reaches the end returns nothing; a damage found there is raised
        # by the read after it (a file cut inside its first frame hands out no bytes at all).
        f.read(1)
    except InputError as e:
        raise _Cut(e, b"".join(parts) or prefix) from None
    if hold_tail:
        return skipped or carried
    if skipped:
        yield long_line(skipped, prefix)
    elif parts:
        yield from cut(b"".join(parts))
    return 0
