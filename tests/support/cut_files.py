"""A traces file with bad lines placed at, across and around the cuts of a range size:
the byte-range tests of the lake's ingest (``tests/lake/test_lake_ranges.py`` and
``tests/lake/test_lake_ray.py``)."""

from __future__ import annotations

from pathlib import Path

from support import FIXTURES
from support.reject_cases import CASES, LAYOUT

GOOD = [line for f in sorted(FIXTURES.glob("*.traces.jsonl")) for line in f.read_bytes().splitlines() if line.strip()]
BAD = [b'{"not": "a trace"', b"[1, 2]", CASES[0].line(), LAYOUT[0].line(), b'{"traces": 7}']


def write_cut_file(
    path: Path, range_bytes: int, *, last: str = "good", newline_at_end: bool = False, goods: int | None = None
) -> Path:
    """A traces file whose bad lines sit at, across and around multiples of ``range_bytes``
    (aligned with blank lines, which are counted but skipped): one starting at a cut, one
    ending just before a cut, one straddling a cut, one just after one, two adjacent across
    a cut, one after a good line that ends at a cut; a ``\\r\\n`` line, a repeated trace,
    and a last line (``last``: good or bad) with or without its line break. ``goods``:
    how many good lines (at least 7; default: every line of the fixtures)."""
    out = bytearray()
    chosen = GOOD if goods is None else GOOD[: goods - 1] + GOOD[-1:]
    lines, bads = iter(chosen[:-1]), iter(BAD * 3)

    def put(line: bytes, end: bytes = b"\n") -> None:
        out.extend(line + end)

    def cut_after(margin: int) -> int:
        """The first multiple of range_bytes at least ``margin`` bytes past the end so far."""
        return -(-(len(out) + margin) // range_bytes) * range_bytes

    def pad_to(where: int) -> None:
        """One blank line (spaces) up to ``where``."""
        assert where > len(out)
        out.extend(b" " * (where - len(out) - 1) + b"\n")

    put(next(lines))
    put(next(lines))
    pad_to(cut_after(1))
    put(next(bads))  # starts at a cut
    put(next(lines))
    bad = next(bads)
    pad_to(cut_after(len(bad) + 2) - len(bad) - 1)
    put(bad)  # its line break is the last byte before a cut
    put(next(lines), b"\r\n")
    bad = next(bads)
    pad_to(cut_after(4) - 3)
    put(bad)  # straddles a cut
    put(next(lines))
    pad_to(cut_after(2))
    put(b"")
    put(next(bads))  # just after a cut (an empty line starts at it)
    first, second = next(bads), next(bads)
    pad_to(cut_after(len(first) + 2) - len(first) - 1)
    put(first)  # two bad lines, the second starting at a cut
    put(second)
    good = next(lines)
    pad_to(cut_after(len(good) + 2) - len(good) - 1)
    put(good)  # a good line ending at a cut, a bad one after it
    put(next(bads))
    put(GOOD[0])  # a trace seen before: skipped, as the file store skips it
    for line in lines:
        put(line)
    put(next(bads) if last == "bad" else chosen[-1], b"\n" if newline_at_end else b"")
    path.write_bytes(bytes(out))
    return path
