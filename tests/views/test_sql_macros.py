"""The SQL macros live in the database file: a plain DuckDB client, without tracedb, uses them."""

from __future__ import annotations

from pathlib import Path

import duckdb

import tracedb

from support import FIXTURES


def test_plain_duckdb_client_reads_the_views(tmp_path: Path) -> None:
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
        expected = db.branches()
    con = duckdb.connect(str(path), read_only=True)  # no tracedb code involved from here on
    try:
        got = con.sql("SELECT * FROM branch_tokens()").to_arrow_table()
        assert got.num_rows == expected.num_rows
        for name in ("trace_id", "branch_index", "trainable", "token_ids", "sampled_mask", "logprobs", "advantages"):
            assert got.column(name).to_pylist() == expected.column(name).to_pylist(), name
        stats = con.sql("SELECT count(*), sum(n_tokens) FROM branch_stats()").fetchall()
        assert stats == [(expected.num_rows, sum(len(t) for t in expected.column("token_ids").to_pylist()))]
        credited = con.sql("SELECT count(*) FROM node_credit() WHERE assigned").fetchall()[0][0]
        assert credited == con.sql("SELECT count(*) FROM nodes WHERE advantages IS NOT NULL").fetchall()[0][0] > 0
        summary = con.sql("SELECT count(*) FROM trace_summary()").fetchall()[0][0]
        assert summary == 44
    finally:
        con.close()


def test_train_once_in_sql(fixture_db) -> None:
    sql = fixture_db.sql("SELECT trace_id, branch_index, sampled_mask FROM branch_tokens(train_once := true)")
    py = fixture_db.branches(columns=["sampled_mask"], train_once=True)
    assert sql.column("sampled_mask").to_pylist() == py.column("sampled_mask").to_pylist()
    plain = fixture_db.branches(columns=["sampled_mask"])
    # Shared sampled nodes exist in the fixtures, so train_once changes something.
    assert sum(map(sum, py.column("sampled_mask").to_pylist())) < sum(
        map(sum, plain.column("sampled_mask").to_pylist())
    )
