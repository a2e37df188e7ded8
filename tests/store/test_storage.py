"""``db.storage()`` (tracedb/storage.py): the file's bytes by table and column."""

from __future__ import annotations

from pathlib import Path

import pytest

import tracedb
from tracedb.storage import flat_rows
from tracedb.synthetic import write_sample

from support import FIXTURES


def _tables_and_columns(db: tracedb.Database) -> dict[str, list[str]]:
    rows = db.sql(
        "SELECT table_name, column_name FROM duckdb_columns() WHERE database_name = current_database() "
        "AND schema_name = current_schema() AND table_name IN (SELECT table_name FROM duckdb_tables() "
        "WHERE database_name = current_database()) ORDER BY table_name, column_index"
    ).to_pylist()
    out: dict[str, list[str]] = {}
    for r in rows:
        out.setdefault(r["table_name"], []).append(r["column_name"])
    return out


@pytest.fixture(scope="module")
def sample_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A file of several blocks per large column: 32 synthetic traces of 20k tokens,
    ingested and checkpointed (closed)."""
    tmp = tmp_path_factory.mktemp("storage")
    src = write_sample(tmp / "traces.jsonl", groups=4, group_size=8, tokens_per_trace=20_000, advantages=True)
    path = tmp / "runs.duckdb"
    with tracedb.connect(path) as db:
        assert db.ingest(src).ok
    return path


def test_the_parts_add_up_to_the_file(sample_file: Path) -> None:
    with tracedb.connect(sample_file, read_only=True) as db:
        b = db.storage()
        expected = _tables_and_columns(db)
        stored = db.stats()["stored_tokens"]
    size = sample_file.stat().st_size
    assert b["file_bytes"] == size and b["wal_bytes"] == 0
    blocks = b["blocks"]
    assert blocks["total"] == blocks["used"] + blocks["free"]
    assert blocks["data"] + blocks["metadata"] + blocks["indexes"] == blocks["used"]
    assert blocks["indexes"] > 0  # the primary keys' ART indexes (traces, episodes, the small tables)
    columns = sum(c["bytes"] for t in b["tables"] for c in t["columns"])
    # each column's share is rounded to a byte: the sum is the data blocks' to within a byte a column
    assert abs(columns - b["data_bytes"]) <= sum(len(v) for v in expected.values())
    parts = b["data_bytes"] + b["metadata_bytes"] + b["index_bytes"] + b["free_bytes"] + b["header_bytes"]
    assert parts == size
    flat = flat_rows(b)
    assert abs(sum(r["bytes"] for r in flat) - size) <= len(flat)
    assert all(r["bytes"] > 0 for r in flat)

    # Every table and every column, in the table's order.
    assert {t["table"]: [c["column"] for c in t["columns"]] for t in b["tables"]} == expected
    for t in b["tables"]:
        assert t["rows_not_checkpointed"] == 0
        assert t["bytes"] == sum(c["bytes"] for c in t["columns"])
        for c in t["columns"]:
            assert c["bytes"] >= c["tail_bytes"] >= 0
            assert sum(c["compression"].values()) == pytest.approx(c["bytes"], abs=len(c["compression"]))
            assert sum(c["parts"].values()) == pytest.approx(c["bytes"], abs=len(c["parts"]))

    # The token ids are the big column, and bit-packed: between 17 bits and 4 bytes an id.
    tables = {t["table"]: {c["column"]: c for c in t["columns"]} for t in b["tables"]}
    token_ids = tables["segment_store"]["token_ids"]  # uniform synthetic ids: kept as lists
    assert "BitPacking" in token_ids["compression"]
    assert stored * 17 / 8 <= token_ids["bytes"] <= stored * 4 + 2 * b["block_size"]
    assert token_ids == max((c for cols in tables.values() for c in cols.values()), key=lambda c: c["bytes"])
    assert tables["node_store"]["logprobs"]["bytes"] > 0 and tables["traces"]["record"]["bytes"] > 0


def test_rows_not_checkpointed_are_reported(tmp_path: Path) -> None:
    """A small ingest commits into the WAL: its rows have no blocks yet, and say so."""
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURES / "linear.traces.jsonl").ok
        b = db.storage()
        tables = {t["table"]: t for t in b["tables"]}
        assert b["wal_bytes"] > 0
        assert tables["node_store"]["rows_not_checkpointed"] == tables["node_store"]["rows"] > 0
        assert tables["traces"]["rows_not_checkpointed"] == 1
    with tracedb.connect(path, read_only=True) as db:  # closing checkpointed it
        b = db.storage()
        assert b["wal_bytes"] == 0
        assert all(t["rows_not_checkpointed"] == 0 for t in b["tables"])
        nodes = next(t for t in b["tables"] if t["table"] == "node_store")
        assert nodes["bytes"] > 0


def test_an_in_memory_database_has_no_file() -> None:
    with tracedb.connect(":memory:") as db:
        with pytest.raises(ValueError, match="in-memory database has no file"):
            db.storage()
