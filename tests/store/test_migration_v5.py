"""Schema 4 -> 5 (``tracedb/migrations.py`` ``_v4_to_v5``) on the file schema 4 really wrote
(``tests/fixtures/schema/v4.duckdb``, see its README: three follower positions among its
rows): every position keeps its row, with no ``tail`` hash (the migration reads no
followed file) and no ``rotated_from``; the file's layout is exactly a fresh database's;
and a follower takes a migrated position as schema 4 left it, hashes the bytes before
its offset at its first poll, and from then on tells a file cut back and grown again."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path

import duckdb
import pytest
import zstandard

import tracedb
from tracedb.ingest.follow import Follower, follow_positions

from support import FIXTURES, REPO

SCHEMA_DIR = REPO / "tests" / "fixtures" / "schema"
V4_RUN = Path("/tmp/tracedb-v4-run")
"""Where the follower that wrote the v4 fixture ran (the paths in its positions)."""
V4_POSITIONS = [
    ("b/traces.jsonl", 1744, 1),
    ("part.jsonl.zst", 2687, 1),
    ("traces.jsonl", 22520, 2),
]


def copy_of(tmp_path: Path, version: int) -> Path:
    path = tmp_path / f"v{version}.duckdb"
    shutil.copy(SCHEMA_DIR / f"v{version}.duckdb", path)
    return path


def query(path: Path, sql: str, params: list | None = None) -> list[tuple]:
    con = duckdb.connect(str(path), read_only=True)
    try:
        return con.execute(sql, params or []).fetchall()
    finally:
        con.close()


def layout(path: Path) -> tuple[list[tuple], list[tuple]]:
    here = "database_name = current_database() AND schema_name = 'main'"
    columns = query(
        path,
        "SELECT table_name, column_index, column_name, data_type, is_nullable, column_default "
        f"FROM duckdb_columns() WHERE {here} ORDER BY ALL",
    )
    constraints = query(
        path, f"SELECT table_name, constraint_type, constraint_text FROM duckdb_constraints() WHERE {here} ORDER BY ALL"
    )
    return columns, constraints


def blake(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def test_the_fixture_is_a_version_4_file_with_follower_positions():
    path = SCHEMA_DIR / "v4.duckdb"
    assert query(path, "SELECT value FROM tracedb_meta WHERE key = 'schema_version'") == [("4",)]
    columns = [
        r[0] for r in query(path, "SELECT column_name FROM duckdb_columns() WHERE table_name = 'follow_positions'")
    ]
    assert columns == ["path", "device", "inode", "offset", "line", "head", "updated_at"]
    rows = query(path, 'SELECT path, "offset", line FROM follow_positions ORDER BY path')
    assert rows == [(str(V4_RUN / name), offset, line) for name, offset, line in V4_POSITIONS]
    layouts = dict(query(path, "SELECT name, layout FROM credit_sets"))
    assert layouts == {"grpo": "trace", "rloo": "trace", "gae": "node", "manual": "node", "manual-trace": "trace"}


def test_positions_keep_their_rows_without_a_tail(tmp_path):
    path = copy_of(tmp_path, 4)
    before = query(
        path, 'SELECT path, device, inode, "offset", line, head, updated_at FROM follow_positions ORDER BY path'
    )
    credit = query(path, "SELECT credit_set, trace_id, value FROM trace_credit ORDER BY ALL")
    with tracedb.connect(path) as db:
        assert db.stats()["traces"] == 38 and db.watermark() == 38
        positions = follow_positions(db.handle)
        assert [(p.path, p.device, p.inode, p.offset, p.line, p.head) for p in positions] == [r[:6] for r in before]
        assert all(p.tail is None and p.rotated_from is None for p in positions)
        assert db.traces(tags={"step": 3}).num_rows == 4  # what the follower added, with its tag
    assert query(path, "SELECT value FROM tracedb_meta WHERE key = 'schema_version'") == [
        (str(tracedb.SCHEMA_VERSION),)
    ]
    assert query(path, "SELECT updated_at FROM follow_positions ORDER BY path") == [(r[6],) for r in before]
    assert query(path, "SELECT credit_set, trace_id, value FROM trace_credit ORDER BY ALL") == credit


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_the_migrated_layout_is_a_fresh_databases(tmp_path, version):
    path = copy_of(tmp_path, version)
    fresh = tmp_path / "fresh.duckdb"
    with tracedb.connect(path), tracedb.connect(fresh):
        pass
    assert layout(path) == layout(fresh)
    columns = [r[2] for r in layout(fresh)[0] if r[0] == "follow_positions"]
    assert columns[-2:] == ["tail", "rotated_from"]


def v4_run(root: Path) -> dict[str, bytes]:
    """The two plain files of the v4 fixture's run, byte for byte as its follower saw them."""
    main = (FIXTURES / "compaction.traces.jsonl").read_bytes() + (FIXTURES / "subagent_fork.traces.jsonl").read_bytes()
    main += (FIXTURES / "partial_credit.traces.jsonl").read_bytes()[:100]
    files = {"traces.jsonl": main, "b/traces.jsonl": (FIXTURES / "empty_tokens.traces.jsonl").read_bytes()}
    for name, data in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_bytes(data)
    return files


def test_a_follower_continues_from_a_migrated_position(tmp_path):
    path = copy_of(tmp_path, 4)
    run = tmp_path / "run"
    files = v4_run(run)
    with tracedb.connect(path):
        pass  # migrated
    con = duckdb.connect(str(path))
    try:  # the run moved here: the positions say so (its files are new inodes, same bytes)
        for name in files:
            st = (run / name).stat()
            con.execute(
                "UPDATE follow_positions SET path = ?, device = ?, inode = ? WHERE path = ?",
                [str(run / name), st.st_dev, st.st_ino, str(V4_RUN / name)],
            )
    finally:
        con.close()
    main = run / "traces.jsonl"
    with tracedb.connect(path) as db, Follower(db.handle, [main, run / "b" / "traces.jsonl"], settle=0) as follower:
        assert follower.poll() is None  # nothing new: no lines, the tails taken and committed
        assert follower.report.restarts == [] and follower.report.rotations == []
        tails = {p.path: p.tail for p in follow_positions(db.handle)}
        assert tails[str(main)] == blake(files["traces.jsonl"][22520 - 4096 : 22520])
        assert tails[str(run / "b" / "traces.jsonl")] == blake(files["b/traces.jsonl"])
        assert tails[str(V4_RUN / "part.jsonl.zst")] is None  # not followed here: left as it was
        with open(main, "ab") as f:  # the line it was in the middle of is finished
            f.write((FIXTURES / "partial_credit.traces.jsonl").read_bytes()[100:])
        report = follower.poll()
        assert report is not None and (report.traces, report.skipped) == (1, 0)
        assert db.stats()["traces"] == 39 and db.stats()["rejects"] == 1
        # From now on, a file cut back and grown past its position is told.
        offset = main.stat().st_size
        with open(main, "r+b") as f:
            f.truncate(len((FIXTURES / "compaction.traces.jsonl").read_bytes()))
        with open(main, "ab") as f:
            f.write((FIXTURES / "loss_weights.traces.jsonl").read_bytes() * 3)
        assert main.stat().st_size > offset
        follower.poll()
        (message,) = follower.report.restarts
        assert str(main) in message and "rewritten" in message
        assert db.stats()["rejects"] == 1  # no bogus reject from reading on mid-line


def test_a_compressed_files_position_without_a_tail_gets_one(tmp_path):
    """As a schema-4 position of a ``.jsonl.zst`` is after the migration (no tail): taken
    as it is, its tail hashed and committed, the file not read again."""
    path = tmp_path / "part.jsonl.zst"
    path.write_bytes(zstandard.ZstdCompressor().compress((FIXTURES / "zero_credit.traces.jsonl").read_bytes()))
    with tracedb.connect(tmp_path / "runs.duckdb") as db:
        with Follower(db.handle, [path], settle=0) as follower:
            assert follower.poll().traces == 1
        db.sql("UPDATE follow_positions SET tail = NULL")
        with Follower(db.handle, [path], settle=0) as follower:
            assert follower.poll() is None and follower.report.restarts == []
        (position,) = follow_positions(db.handle)
        assert position.tail == blake(path.read_bytes()[-4096:])
        assert db.stats()["traces"] == 1
