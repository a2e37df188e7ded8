"""A schema-7 file whose decoding macros (schema/encoded.sql) are another release's, opened
read-only: its views ``nodes`` and ``segments`` read through this tracedb's macros (made
temporary on the reader's connections), and the file is not written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import duckdb

import tracedb

from support import FIXTURES

READ = "SELECT trace_id, node_index, logprobs, advantages FROM nodes ORDER BY ALL"


def test_a_read_only_reader_decodes_with_this_tracedbs_macros(tmp_path: Path) -> None:
    path = tmp_path / "old.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
        want = db.sql(READ)
        tokens = db.sql("SELECT * FROM segments ORDER BY segment_id")
    con = duckdb.connect(str(path))
    con.execute("CREATE OR REPLACE MACRO tdb_value(c) AS 0")  # another release's decoding
    con.execute("UPDATE tracedb_meta SET value = 'an older release' WHERE key = 'macros_sha256'")
    con.close()
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    with tracedb.connect(path, read_only=True) as db:
        assert db.sql(READ).equals(want)
        assert db.sql("SELECT * FROM segments ORDER BY segment_id").equals(tokens)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
