"""benchmarks/encodings.py (the storage experiments of issue 24) on a small file: every
candidate is written and measured, the chunked layouts decode to exactly the source's
token ids and logprobs, and the fixed-point encoding refuses values it would not keep."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import tracedb
from tracedb.synthetic import write_sample

pytest.importorskip("zstandard")


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("enc")
    src = write_sample(tmp / "traces.jsonl", groups=2, group_size=4, tokens_per_trace=3_000, advantages=True)
    path = tmp / "runs.duckdb"
    with tracedb.connect(path) as db:
        assert db.ingest(src).ok
    return path


def test_every_candidate_is_measured_and_exact(source: Path, tmp_path: Path) -> None:
    from benchmarks.encodings import run

    results = run(source, tmp_path / "out", 1, None, log=lambda _: None)
    c = results["candidates"]
    assert set(c) == {
        "copy",
        "block-64k",
        "block-16k",
        "no-pk",
        "no-pk+block-16k",
        "zstd-strings",
        "fixed-streams",
        "chunked-zstd-3",
        "chunked-zstd-19",
    }
    for name, cand in c.items():
        b = cand["breakdown"]
        parts = b["data_bytes"] + b["metadata_bytes"] + b["index_bytes"] + b["free_bytes"] + b["header_bytes"]
        assert parts == b["file_bytes"] == cand["bytes"] > 0, name
    assert c["copy"]["breakdown"]["index_bytes"] > 0 and c["no-pk"]["breakdown"]["index_bytes"] == 0
    assert c["block-16k"]["breakdown"]["block_size"] == 16_384
    assert c["block-16k"]["bytes"] < c["copy"]["bytes"]  # a small file: whole 256 KiB blocks dominate
    for name in ("chunked-zstd-3", "chunked-zstd-19"):
        assert c[name]["decode"]["exact"] is True
        assert "token_chunks" in c[name]["tables"] and "stream_chunks" in c[name]["tables"]
    assert results["decode_today"]["view_bytes"] == c["chunked-zstd-3"]["decode"]["view_bytes"]
    json.dumps(results, default=str)  # the results file can be written


def test_fixed_point_refuses_a_value_with_more_decimals(source: Path, tmp_path: Path) -> None:
    import duckdb

    from benchmarks.encodings import chunked_candidate, source_tables

    bad = tmp_path / "bad.duckdb"
    con = duckdb.connect(str(bad))
    con.execute(f"ATTACH '{source}' AS s (READ_ONLY)")
    for t in source_tables(con, "s"):  # schema 6's tables (a schema-7 file's views)
        con.execute(f'CREATE TABLE "{t}" AS SELECT * FROM s."{t}"')
    con.execute(
        "UPDATE nodes SET logprobs = [CAST(-0.123456 AS FLOAT)] || logprobs[2:] "
        "WHERE node_index = (SELECT min(node_index) FROM nodes WHERE len(logprobs) > 0)"
    )
    con.close()
    with pytest.raises(ValueError, match="not a 4-decimal number"):
        chunked_candidate(bad, tmp_path / "c.duckdb", 3)
