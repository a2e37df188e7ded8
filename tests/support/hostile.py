"""Hostile input for the reliability tests (``tests/ingest/test_hostile_input.py``,
``tests/store/test_open_refusals.py``, ``tests/store/test_migrations.py``,
``tests/cli/test_reliability_cli.py``): lines written as text (repeated keys, literals
Python's ``json`` reads but JSON does not allow), damaged zstd files, and snapshots of
what a database file holds on disk."""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import duckdb
import zstandard

from support import FIXTURES, REPO

BASE: dict[str, Any] = json.loads((FIXTURES / "linear.traces.jsonl").read_text())
"""The ``linear`` episode: node 2 is a sampled assistant turn (28 tokens, 25 sampled)."""
BASE_TRACE: str = BASE["traces"][0]["id"]
GOOD_LINES: list[str] = (FIXTURES / "groups.traces.jsonl").read_text().splitlines()
"""32 good lines, one episode (one trace) each."""
V1_FIXTURE = REPO / "tests" / "fixtures" / "schema" / "v1.duckdb"
"""A database file written by tracedb at schema version 1 (see its README)."""
PLACEHOLDER = "@@literal@@"


def write_lines(path: Path, lines: list[str | bytes], *, newline_at_end: bool = True) -> Path:
    """``lines`` as the lines of ``path``."""
    data = b"\n".join(x.encode() if isinstance(x, str) else x for x in lines)
    path.write_bytes(data + (b"\n" if newline_at_end else b""))
    return path


def episode_with(mutate: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """A copy of :data:`BASE` changed by ``mutate``."""
    e = copy.deepcopy(BASE)
    mutate(e)
    return e


def with_literal(record: dict[str, Any], literal: str) -> str:
    """``record`` as JSON text with its one :data:`PLACEHOLDER` string replaced by
    ``literal`` as written (``NaN``, ``-Infinity``, ``1e400``...)."""
    text = json.dumps(record)
    assert text.count(json.dumps(PLACEHOLDER)) == 1, "exactly one placeholder"
    return text.replace(json.dumps(PLACEHOLDER), literal)


def inserted_after(text: str, anchor: str, insert: str) -> str:
    """``text`` with ``insert`` written right after its one ``anchor``."""
    assert text.count(anchor) == 1, anchor
    return text.replace(anchor, anchor + insert)


def first_wins(text: str) -> Any:
    """``text`` read with the first value of a repeated key kept (what simdjson's lookup
    gives): a repeated-key case is meaningful only where this differs from ``json``."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            out.setdefault(key, value)
        return out

    return json.loads(text, object_pairs_hook=hook)


def zst_frames(lines: list[str], per_frame: int = 1, *, content_size: bool = True) -> tuple[bytes, list[int]]:
    """The lines (each with its line break) compressed ``per_frame`` lines to a frame;
    also the offset at which each frame ends."""
    compressor = zstandard.ZstdCompressor(write_content_size=content_size)
    frames = [
        compressor.compress("".join(line + "\n" for line in lines[i : i + per_frame]).encode())
        for i in range(0, len(lines), per_frame)
    ]
    ends, total = [], 0
    for frame in frames:
        total += len(frame)
        ends.append(total)
    return b"".join(frames), ends


def cut_inside_a_line(lines: list[str], fraction: float = 0.6) -> tuple[bytes, int, bytes]:
    """One zstd frame of ``lines`` (no content size, so the decompressor hands out what it
    has) cut at ``fraction`` of its length, where what decompresses ends inside a line.
    Returns the cut bytes, how many whole lines come out of them and the start of the
    line the cut lost."""
    data, _ = zst_frames(lines, len(lines), content_size=False)
    cut = data[: int(len(data) * fraction)]
    out = zstandard.ZstdDecompressor().decompressobj().decompress(cut)
    assert out and not out.endswith(b"\n"), "the cut must land inside a line"
    return cut, out.count(b"\n"), out[out.rfind(b"\n") + 1 :]


def on_disk(path: Path) -> dict[str, bytes]:
    """Every file of ``path``'s directory that belongs to it (itself, its ``.wal``), by name."""
    return {p.name: p.read_bytes() for p in sorted(path.parent.glob(path.name + "*")) if p.is_file()}


def stored_version(path: Path) -> str | None:
    """The ``schema_version`` row of a closed database file, read with DuckDB directly."""
    con = duckdb.connect(str(path), read_only=True)
    try:
        rows = con.execute("SELECT value FROM tracedb_meta WHERE key = 'schema_version'").fetchall()
    finally:
        con.close()
    return rows[0][0] if rows else None


def duckdb_run(path: Path, *statements: str) -> None:
    """Run SQL on a database file with a DuckDB connection of its own."""
    con = duckdb.connect(str(path))
    try:
        for statement in statements:
            con.execute(statement)
    finally:
        con.close()
