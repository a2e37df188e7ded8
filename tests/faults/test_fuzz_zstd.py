"""Input fuzz, compressed: ``.jsonl.zst`` files cut short, with bytes flipped, with garbage
after the last frame, or not zstd at all, through both parse paths.

The file is good fixture lines in several zstd frames (two lines each, with checksums,
as the ``zstd`` tool writes them). What it must come to is decided with ``zstandard``
alone (:func:`decoded`): the frames before the damage decode, so their lines must be
kept; ingest may keep no line after the damage, names the file and the first line lost
in one reject, and lists the file in ``report.unreadable``. A cut exactly between frames
leaves a valid, shorter file: its lines, no reject. Damage that ``zstandard`` decodes
cleanly to the same bytes (a flipped bit the format does not use) is no damage either.
``strict=True`` and ``whole_files=True`` raise a :class:`TraceDBError` and write nothing;
``tracedb ingest`` exits 1 on a damaged file and 0 on a whole one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import zstandard
from typer.testing import CliRunner

import tracedb
from tracedb import runtime
from tracedb.cli.main import app
from tracedb.errors import InputError, TraceDBError

from support.faults import base_seed, contents
from support.ingested import FIXTURE_FILES

SEED = base_seed()
PATHS = ("always", "never")
LINES = [line for f in FIXTURE_FILES for line in f.read_bytes().splitlines() if line.strip()]
PER_FRAME = 2
N_LINES = 10


def compressed(lines: list[bytes]) -> tuple[bytes, list[int]]:
    """The lines as zstd frames of PER_FRAME lines (checksummed); where each frame ends."""
    c = zstandard.ZstdCompressor(write_checksum=True)
    data, ends = b"", []
    for k in range(0, len(lines), PER_FRAME):
        data += c.compress(b"".join(line + b"\n" for line in lines[k : k + PER_FRAME]))
        ends.append(len(data))
    return data, ends


def decoded(data: bytes) -> tuple[bytes, bool]:
    """The bytes of the frames that decode whole (checksums checked), and whether all of the file did."""
    d = zstandard.ZstdDecompressor()
    out, rest = b"", data
    while rest:
        frame = d.decompressobj()
        try:
            chunk = frame.decompress(rest)
        except zstandard.ZstdError:
            return out, False
        if not frame.eof:
            return out, False  # the file ends inside a frame
        out, rest = out + chunk, frame.unused_data
    return out, True


def damages(data: bytes, ends: list[int]) -> list[tuple[str, bytes]]:
    rng = random.Random(f"{SEED}:zstd")
    out = [(f"cut at {n}", data[:n]) for n in sorted(rng.sample(range(1, len(data)), 4))]
    out.append((f"cut between frames at {ends[1]}", data[: ends[1]]))
    for _ in range(4):
        at = rng.randrange(len(data))
        flipped = bytearray(data)
        flipped[at] ^= rng.randrange(1, 256)
        out.append((f"byte {at} flipped", bytes(flipped)))
    out.append(("garbage after the last frame", data + b"not a frame"))
    out.append(("not zstd at all", b"".join(line + b"\n" for line in LINES[:3])))
    out.append(("empty file", b""))
    return out


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, str]]:
    """Per path, ``db.trace`` of every line of the plain (uncompressed) file."""
    plain = tmp_path_factory.mktemp("zstd") / "plain.traces.jsonl"
    plain.write_bytes(b"".join(line + b"\n" for line in LINES))
    out = {}
    for mode in PATHS:
        with runtime.configure(scanner=mode), tracedb.connect(":memory:") as db:
            assert db.ingest(plain).ok
            ids = db.sql("SELECT trace_id FROM traces").column("trace_id").to_pylist()
            out[mode] = {t: json.dumps(db.trace(t), sort_keys=True) for t in ids}
    return out


def trace_ids(lines: list[bytes]) -> list[str]:
    return [t["id"] for line in lines for t in json.loads(line)["traces"]]


SAMPLE = random.Random(f"{SEED}:zstd-lines").sample(LINES, N_LINES)
DAMAGES = damages(*compressed(SAMPLE))


@pytest.mark.parametrize(("what", "damaged"), DAMAGES, ids=[w for w, _ in DAMAGES])
def test_damaged_zstd(what: str, damaged: bytes, tmp_path: Path, reference: dict[str, dict[str, str]]) -> None:
    print(f"seed {SEED}: {what}")
    lines = SAMPLE
    path = tmp_path / "damaged.traces.jsonl.zst"
    path.write_bytes(damaged)
    good, whole = decoded(damaged)
    if what == "not zstd at all":
        lines = LINES[:3]
    sure = good.count(b"\n")  # lines of frames that decode: these must be kept
    seen = {}
    for mode in PATHS:
        with runtime.configure(scanner=mode), tracedb.connect(":memory:") as db:
            report = db.ingest(path)  # no exception: the damage is a reject
            rows = db.sql("SELECT trace_id, line FROM traces ORDER BY line").to_pylist()
            kept = [r["line"] for r in rows]
            k = len(kept)
            assert kept == list(range(1, k + 1)), f"{mode} {what}: kept lines are not the lines before the damage"
            assert [r["trace_id"] for r in rows] == trace_ids(lines[:k])
            for r in rows:
                assert json.dumps(db.trace(r["trace_id"]), sort_keys=True) == reference[mode][r["trace_id"]]
            rejects = [(r.file, r.line, r.field, r.reason) for r in report.rejected]
            stored = db.sql("SELECT source, line FROM rejects").to_pylist()
        if whole:
            assert good in (b"".join(line + b"\n" for line in lines[:k]), b""), "zstandard decodes other bytes"
            assert k == sure and not rejects and not report.unreadable, (mode, what, k, rejects)
        else:
            assert sure <= k < len(lines) or (sure == k == len(lines)), (mode, what, sure, k)
            assert rejects == [(str(path), k + 1, None, rejects[0][3])], (mode, what, rejects)
            assert report.unreadable == [str(path)]
            assert stored == [{"source": str(path), "line": k + 1}]
        seen[mode] = (kept, rejects)
    assert seen["always"] == seen["never"], f"{what}: the paths disagree"
    if not whole:
        check_refusals(path, tmp_path)
    runner = CliRunner()
    result = runner.invoke(app, ["ingest", str(path), "--db", str(tmp_path / "cli.duckdb"), "--json"])
    assert result.exit_code == (0 if whole else 1), result.output[-2000:]


def check_refusals(path: Path, tmp_path: Path) -> None:
    """``strict=True`` and ``whole_files=True`` on a damaged file: an error, nothing written."""
    with tracedb.connect(":memory:") as db:
        db.ingest(FIXTURE_FILES[0])
        before = contents(db)
        with pytest.raises(TraceDBError):
            db.ingest(path, strict=True)
        assert contents(db) == before
        with pytest.raises(InputError) as caught:
            db.ingest(path, whole_files=True)
        assert caught.value.file == str(path)
        assert contents(db) == before
