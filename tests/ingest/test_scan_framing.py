"""How files are cut into lines and chunks, on the scanner's path and on the legacy one:
line endings, whitespace-only lines, no final newline, zstd, pretty-printed ``.json``
files, files without records, chunks of any size, the scanner's buffers and the byte
after a line.

The differential contract and the harness: :mod:`support.scan_harness`; the hand-written cases:
:mod:`support.scan_cases`.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard
from hypothesis import given, settings
from hypothesis import strategies as st

from tracedb.ingest import read_lines
from tracedb.ingest.files import Chunk, read_chunks
from tracedb.ingest.scanned import Scanner, scan_chunk

from support import REPO
from support.scan_cases import (
    FIRST_LINES,
    FIXTURE_FILES,
    FULL,
    GOOD_BARE,
    SMALL_TEXT,
    WHITESPACE_LINES,
    episode,
    node,
    nonblank_lines,
)
from support.scan_harness import assert_no_differences, assert_same, meant_taken, run_ingest, scanned, unique, write

# --------------------------------------------------------------------------- files


def _fixture_variant(variant: str) -> tuple[str, bytes]:
    """(file name, bytes) of the fixture lines written another way."""
    lines = FIRST_LINES
    if variant == "crlf":
        data = b"".join(line + b"\r\n" for line in lines)
    elif variant == "whitespace-lines":
        parts = [WHITESPACE_LINES[0]]
        for i, line in enumerate(lines):
            parts += [line, WHITESPACE_LINES[(i + 1) % len(WHITESPACE_LINES)]]
        data = b"\n".join(parts) + b"\n"
    elif variant == "no-final-newline":
        data = b"\n".join(lines)
    elif variant == "zst":
        data = b"\n".join(lines) + b"\n"
    elif variant == "zst-crlf-whitespace-no-final-newline":
        data = b"\r\n \x0c\r\n\r\n".join(lines)
    else:
        raise AssertionError(variant)
    return ("all.traces.jsonl.zst" if variant.startswith("zst") else "all.traces.jsonl"), data


@pytest.mark.parametrize(
    "variant", ["crlf", "whitespace-lines", "no-final-newline", "zst", "zst-crlf-whitespace-no-final-newline"]
)
def test_fixture_lines_written_otherwise(tmp_path: Path, variant: str) -> None:
    name, data = _fixture_variant(variant)
    raw = zstandard.ZstdCompressor().compress(data) if name.endswith(".zst") else data
    fast, _ = assert_same(write(tmp_path, name, raw), taken=meant_taken(data))
    assert fast.report is not None and fast.report["traces"] > 0 and not fast.report["rejected"]


def test_fixture_traces_pretty_printed_as_json_files(tmp_path: Path) -> None:
    """The first trace of every fixture as a bare Trace in a ``.json`` file, indent=2."""
    paths = []
    for path, line in zip(FIXTURE_FILES, FIRST_LINES):
        trace = json.loads(line)["traces"][0]
        out = write(tmp_path, path.name.split(".")[0] + ".json", json.dumps(trace, indent=2) + "\n")
        want = [not any(isinstance(n.get("loss_weights"), dict) for n in trace["nodes"])]
        assert scanned(out) == want, out.name
        paths.append(out)
    fast, _ = assert_same(paths)
    assert fast.report is not None and fast.report["traces"] == len(paths) and not fast.report["rejected"]


@pytest.mark.parametrize(
    "name, data",
    [
        ("empty.traces.jsonl", b""),
        ("blank.traces.jsonl", b"\n\n"),
        ("whitespace.traces.jsonl", b"  \n\t\r\n\x0b\x0c"),
        ("empty.json", b""),
        ("whitespace.json", b" \n\t\n"),
        ("empty.traces.jsonl.zst", zstandard.ZstdCompressor().compress(b"")),
    ],
)
def test_files_without_records(tmp_path: Path, name: str, data: bytes) -> None:
    fast, _ = assert_same(write(tmp_path, name, data))
    assert fast.report is not None and fast.report["lines"] == 0


# --------------------------------------------------------------------------- chunks


def _chunk_lines(path: Path, chunk_bytes: int | None) -> list[tuple[int, bytes]]:
    """(line number, line) of the non-blank lines, as read_chunks cuts them."""
    chunks = read_chunks(path) if chunk_bytes is None else read_chunks(path, chunk_bytes)
    out = []
    for chunk in chunks:
        assert chunk.data.endswith(b"\n")
        assert len(chunk.starts) == len(chunk.ends) == len(chunk.numbers)
        for k in range(len(chunk.starts)):
            assert b"\n" not in chunk.data[chunk.starts[k] : chunk.ends[k]]
            raw = chunk.raw(k)
            if raw.strip():
                out.append((int(chunk.numbers[k]), raw))
    return out


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64, 1000, None])
@pytest.mark.parametrize("variant", ["lf", "crlf", "no-final-newline", "zst"])
def test_read_chunks_cuts_lines_like_read_lines(tmp_path: Path, variant: str, chunk_bytes: int | None) -> None:
    data = SMALL_TEXT + FIRST_LINES[-1] + b"\n"
    if variant == "crlf":
        data = data.replace(b"\n", b"\r\n")
    elif variant == "no-final-newline":
        data = data.rstrip(b"\n")
    name = "c.traces.jsonl"
    if variant == "zst":
        data, name = zstandard.ZstdCompressor().compress(data), name + ".zst"
    path = write(tmp_path, name, data)
    assert _chunk_lines(path, chunk_bytes) == list(read_lines(path))


@settings(max_examples=150, deadline=None, database=None)
@given(
    parts=st.lists(
        st.sampled_from([b"a", b"{}", b" ", b"\n", b"\r", b"\r\n", b"\x0b", b"xyz" * 7, b"\n\n"]), max_size=40
    ),
    chunk_bytes=st.integers(1, 48),
)
def test_read_chunks_cuts_any_text_like_read_lines(parts: list[bytes], chunk_bytes: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = write(Path(tmp), "r.jsonl", b"".join(parts))
        assert _chunk_lines(path, chunk_bytes) == list(read_lines(path))
        numbers = [n for chunk in read_chunks(path, chunk_bytes) for n in chunk.numbers.tolist()]
        assert numbers == list(range(1, len(numbers) + 1))


def _tiny_chunk_file(tmp_path: Path) -> tuple[Path, list[bool]]:
    """Lines of a few fixtures with blank and malformed lines between them, CRLF."""
    lines = []
    for i, path in enumerate(FIXTURE_FILES[:3]):
        lines += nonblank_lines(path)
        malformed = [FULL + b"x", b"{}", episode(node(',"parent":0'))][i]
        lines += [
            WHITESPACE_LINES[i + 1],
            unique(malformed, i),
            GOOD_BARE.encode().replace(b"tr-bare", b"tr-bare%d" % i),
        ]
    data = b"\r\n".join(lines)
    taken = [
        ok and not line.startswith((b'{"id":"ep', b"{}")) for ok, line in zip(meant_taken(data), data.split(b"\n"))
    ]
    return write(tmp_path, "tiny.traces.jsonl", data), taken


@pytest.mark.parametrize("chunk_bytes", [7, 64, 1000])
def test_ingest_in_tiny_chunks(tmp_path: Path, chunk_bytes: int, knobs: Any) -> None:
    """Ingest reading a few bytes at a time (chunks of whole lines, each scanned on its
    own, the scanner's buffers sized for tiny chunks and grown) against the legacy path
    reading the default chunks."""
    path, taken = _tiny_chunk_file(tmp_path)
    reference = run_ingest(path, legacy=True)
    knobs(chunk_bytes=chunk_bytes)
    chunks = list(read_chunks(path))
    assert len(chunks) > 1
    scanner = Scanner()
    assert [p is not None for chunk in chunks for p in scan_chunk(chunk, scanner)[1]] == taken
    assert_no_differences(run_ingest(path, legacy=False).whole(), reference.whole(), " in tiny chunks")
    assert reference.report is not None and reference.report["rejected"] and reference.report["traces"]


def test_many_tiny_traces_stay_inside_the_scanner_buffers(tmp_path: Path) -> None:
    """One 4.9 MB line of 700,000 traces ``{"":0}`` (no id: the legacy path rejects it).
    The scanner writes a row per trace before Python looks for an id, into a trace table
    of len(chunk) // 10 + 4 rows, and 7 bytes make a trace here: the line must come back
    to the legacy path without a row written past the table. Run in a child process (a
    write past the end may crash it, or go unnoticed: the child also reports the rows the
    scan counted against the table's size)."""
    script = textwrap.dedent(
        """
        import json
        import sys
        from pathlib import Path

        from tracedb.ingest import _scan
        from tracedb.ingest.files import read_chunks
        from tracedb.ingest.scanned import Scanner, scan_chunk

        path = Path(sys.argv[1])
        path.write_bytes(b'{"id":"ep","traces":[' + b",".join([b'{"":0}'] * 700_000) + b"]}\\n")
        scanner = Scanner()
        _, parsed = scan_chunk(next(read_chunks(path)), scanner)
        try:
            rows, capacity = int(scanner.out["counts"][_scan.C_TRACE]), len(scanner.out["traces"])
        except (AttributeError, KeyError):  # the scanner's internals changed: rely on the rest
            rows = capacity = 0
        print(json.dumps({"taken": [p is not None for p in parsed], "rows": rows, "capacity": capacity}))
        """
    )
    child = subprocess.run(
        [sys.executable, "-c", script, str(tmp_path / "tiny-traces.jsonl")],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
    )
    assert child.returncode == 0, f"the scan died (exit code {child.returncode}): {child.stderr[-500:]!r}"
    result = json.loads(child.stdout)
    assert result["taken"] == [False]
    assert result["rows"] <= result["capacity"], (
        f"{result['rows']} trace rows written into a table of {result['capacity']}"
    )


def test_a_line_not_followed_by_its_line_break_falls_back() -> None:
    """The digit loops stop at the byte after a line without checking bounds; a chunk whose
    line is followed by anything but its line break is not scanned (a hand-built chunk)."""
    line = b'{"id":"e","traces":[{"id":"t","nodes":[{"message":{},"token_ids":[1],"mask":[true]}]}]}'
    for after in (b"\n", b"2", b"-", b"."):
        data = line + after
        chunk = Chunk(data, np.array([0]), np.array([len(line)]), np.array([1]))
        _, lines = scan_chunk(chunk)
        assert (lines[0] is not None) == (after == b"\n"), after
