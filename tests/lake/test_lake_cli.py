"""``tracedb lake init|push|pull|sql``: the shells call the library and report errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import tracedb

from support import FIXTURES

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

from tracedb.cli.main import app  # noqa: E402


def test_init_push_sql_pull(tmp_path):
    store = tmp_path / "runs.duckdb"
    with tracedb.connect(store) as db:
        db.ingest(FIXTURES / "groups.traces.jsonl")
        ids = db.sql("SELECT trace_id FROM traces ORDER BY trace_id").column("trace_id").to_pylist()
        expected = db.sql("SELECT * FROM branch_stats() ORDER BY ALL").to_pylist()
    run = CliRunner().invoke
    lake = str(tmp_path / "L")
    made = run(app, ["lake", "init", "--warehouse", lake, "--json"])
    assert made.exit_code == 0, made.output
    assert json.loads(made.output)["watermark"] == 0
    pushed = run(app, ["lake", "push", "--db", str(store), "--lake", lake, "--json"])
    assert pushed.exit_code == 0 and json.loads(pushed.output)["traces"] == len(ids)
    again = run(app, ["lake", "push", "--db", str(store), "--lake", lake, "--json"])
    assert json.loads(again.output)["skipped"] == len(ids)
    stats = run(app, ["lake", "sql", "SELECT * FROM branch_stats() ORDER BY ALL", "--lake", lake, "--json"])
    assert stats.exit_code == 0 and json.loads(stats.output) == json.loads(json.dumps(expected, default=str))
    local = tmp_path / "local.duckdb"
    pulled = run(app, ["lake", "pull", "--lake", lake, "--db", str(local), "--trace-ids", ",".join(ids[:2]), "--json"])
    assert pulled.exit_code == 0 and json.loads(pulled.output)["traces"] == 2
    bad = run(app, ["lake", "sql", "SELECT * FROM nope", "--lake", lake])
    assert bad.exit_code == 1 and "nope does not exist" in bad.output
    missing = run(app, ["lake", "push", "--db", str(store), "--lake", str(tmp_path / "none")])
    assert missing.exit_code == 2 and "no lake here" in missing.output


def test_pack_into_a_path_that_cannot_be_a_directory_names_out(tmp_path):
    """``pack`` and ``lake pack`` with ``--out`` a file (or under one): exit 1 naming
    ``--out``, no traceback."""
    store = tmp_path / "runs.duckdb"
    with tracedb.connect(store) as db:
        db.ingest(FIXTURES / "linear.traces.jsonl")
    run = CliRunner().invoke
    lake = str(tmp_path / "L")
    assert run(app, ["lake", "init", "--warehouse", lake]).exit_code == 0
    assert run(app, ["lake", "push", "--db", str(store), "--lake", lake]).exit_code == 0
    taken = tmp_path / "afile"
    taken.write_text("x")
    for out in (taken, taken / "step"):
        for command in (["pack", "--db", str(store)], ["lake", "pack", "--lake", lake]):
            result = run(app, [*command, "--out", str(out), "--seq-len", "64"])
            assert result.exit_code == 1 and not isinstance(result.exception, OSError), result.exception
            assert f"--out {out}:" in result.output, result.output
    assert taken.read_text() == "x"


def test_init_buckets_and_compact_full(tmp_path):
    """``lake init --buckets N`` makes a lake of N buckets and reports it (kept on a later
    init; another count, or one out of range, exits 2 naming it); ``lake compact`` merges
    the files added since the last compaction, ``--full`` rewrites every file again."""
    import tracedb.lake

    store = tmp_path / "runs.duckdb"
    with tracedb.connect(store) as db:
        db.ingest(FIXTURES / "groups.traces.jsonl")
        ids = db.sql("SELECT trace_id FROM traces ORDER BY trace_id").column("trace_id").to_pylist()
    run = CliRunner().invoke
    lake = str(tmp_path / "L")
    made = run(app, ["lake", "init", "--warehouse", lake, "--buckets", "4", "--json"])
    assert made.exit_code == 0, made.output
    assert json.loads(made.output)["buckets"] == 4 and tracedb.lake.open(lake).buckets == 4
    again = run(app, ["lake", "init", "--warehouse", lake, "--json"])
    assert again.exit_code == 0 and json.loads(again.output)["buckets"] == 4
    other = run(app, ["lake", "init", "--warehouse", lake, "--buckets", "8"])
    assert other.exit_code == 2 and "it has 4 buckets, fixed when it was made (not 8)" in other.output
    too_many = run(app, ["lake", "init", "--warehouse", str(tmp_path / "M"), "--buckets", "5000"])
    assert too_many.exit_code == 2 and "buckets is an int from 1 to 4096" in too_many.output
    from tracedb.lake.move import file_rows

    opened = tracedb.lake.open(lake)
    half = len(ids) // 2
    reports = []
    with tracedb.connect(store) as db:
        for part in (ids[:half], ids[half:]):  # each half in writes of 2 traces, then compacted
            for k in range(0, len(part), 2):
                opened.append(file_rows(db, part[k : k + 2], rejects=False))
            done = run(app, ["lake", "compact", "--lake", lake, "--grace", "0", "--json"])
            assert done.exit_code == 0, done.output
            reports.append(json.loads(done.output)["tables"]["nodes"])
    first, second = reports
    assert first["files_rewritten"] == first["files_before"] > first["files_after"]
    assert second["files_rewritten"] == second["files_before"] - first["files_after"]  # only the new ones
    idle = json.loads(run(app, ["lake", "compact", "--lake", lake, "--grace", "0", "--json"]).output)
    assert idle["tables"]["nodes"]["files_rewritten"] == 0  # nothing added since
    full = json.loads(run(app, ["lake", "compact", "--lake", lake, "--grace", "0", "--full", "--json"]).output)
    nodes = full["tables"]["nodes"]
    assert nodes["files_rewritten"] == second["files_after"] > nodes["files_after"]  # every file, merged
    assert nodes["rows_before"] == nodes["rows_after"] and nodes["files_after"] <= 4
    assert sorted(tracedb.lake.open(lake).tables()["traces"].column("trace_id").to_pylist()) == ids
