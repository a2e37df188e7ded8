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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tracedb import runtime

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
    """The file's bytes, decompressed when its name ends with ``.zst``."""
    if path.name.endswith(".zst"):
        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(open(path, "rb")), 1 << 20)
    return open(path, "rb", buffering=1 << 20)


def read_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """(line number, bytes) of each non-blank record; a ``.json`` file is one record."""
    with open_input(path) as f:
        if path.suffix == ".json":
            data = f.read()
            if data.strip():
                yield 1, data
            return
        for number, line in enumerate(f, 1):
            if line.strip():
                yield number, line.rstrip(b"\r\n")


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


def read_chunks(path: Path, chunk_bytes: int | None = None) -> Iterator[Chunk]:
    """The file's lines in chunks of at least ``chunk_bytes`` (default: the
    ``chunk_bytes`` setting) up to a line break; a ``.json`` file is one record. Each byte
    is copied once on the way (from the read block into its chunk)."""
    size = max(chunk_bytes or runtime.settings().chunk_bytes, 1)
    number = 1

    def cut(data: bytes) -> Iterator[Chunk]:
        nonlocal number
        start = 0
        while start < len(data):
            end = data.find(b"\n", start + size - 1) + 1 if len(data) - start >= 2 * size else 0
            piece = data[start : end or len(data)] if start or end else data
            chunk = _chunk(piece, number)
            number += len(chunk.starts)
            start = end or len(data)
            yield chunk

    with open_input(path) as f:
        if path.suffix == ".json":
            data = f.read()
            if data:
                end = np.array([len(data)], np.int64)
                yield Chunk(data + b"\n", np.zeros(1, np.int64), end, np.ones(1, np.int64))
            return
        carry = b""
        while block := f.read(max(size, 1 << 16)):
            last = block.rfind(b"\n")
            if last < 0:
                carry += block  # a line longer than a block
                continue
            if carry or last + 1 < len(block):
                data = b"".join((carry, memoryview(block)[: last + 1]))
            else:
                data = block
            carry = block[last + 1 :]
            yield from cut(data)
        if carry:
            yield from cut(carry)
