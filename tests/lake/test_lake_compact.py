"""``tracedb lake compact``: what readers never see is removed, their answers unchanged."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest
from typer.testing import CliRunner

import tracedb

from support import FIXTURES

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb.cli.main import app  # noqa: E402
from tracedb.lake import write  # noqa: E402
from tracedb.lake.move import file_rows  # noqa: E402


def _answers(lake):
    tables = {}
    for name, table in lake.tables().items():
        keys = [f.name for f in table.schema if not pa.types.is_nested(f.type)]
        tables[name] = table.sort_by([(c, "ascending") for c in keys])
    stats = lake.sql("SELECT * FROM branch_stats() ORDER BY ALL")
    plan = lake.micro_batches(300, ranks=2)
    return tables, stats, [[(mb.tokens, mb.samples) for mb in rank] for rank in plan], lake.watermark()


def _raw(lake, name):
    return lake.table(name).scan().to_arrow().num_rows


def test_compact_removes_leftovers_and_keeps_answers(tmp_path):
    store = tmp_path / "runs.duckdb"
    with tracedb.connect(store) as db:
        db.ingest(FIXTURES)
        ids = db.sql("SELECT trace_id FROM traces ORDER BY trace_id LIMIT 5").column("trace_id").to_pylist()
        rows = file_rows(db, ids)
    lake = lakes.init(tmp_path / "L")
    lake.push(store, batch_traces=10)  # several writes: several small files per table
    for name in ("nodes", "branches", "episodes"):  # a killed writer: rows, no traces commit
        lake.table(name).append(write.lake_rows(name, rows[name], "killed-writer"))
    lake.table("segments").append(write.lake_rows("segments", rows["segments"], "killed-writer"))  # duplicates
    before = _answers(lake)
    visible = lake.tables()
    assert _raw(lake, "nodes") > visible["nodes"].num_rows and _raw(lake, "segments") > visible["segments"].num_rows

    young = lake.compact()  # the leftovers are in files of this minute: a writer may still be at work
    assert young.tables["nodes"]["rows_after"] == _raw(lake, "nodes") > visible["nodes"].num_rows
    assert young.tables["nodes"]["files_after"] < young.tables["nodes"]["files_before"]  # small files rewritten
    assert _answers(lake) == before

    report = lake.compact(grace=0)
    assert _answers(lake) == before
    for name in ("nodes", "branches", "episodes", "segments"):
        assert _raw(lake, name) == visible[name].num_rows, name
        entry = report.tables[name]
        assert entry["rows_before"] > entry["rows_after"] and entry["files_after"] <= entry["files_before"], name
    assert "traces" not in report.tables

    run = CliRunner().invoke(app, ["lake", "compact", "--lake", lake.where, "--grace", "0", "--json"])
    assert run.exit_code == 0, run.output
    again = json.loads(run.output)["tables"]
    assert all(e["rows_before"] == e["rows_after"] for e in again.values())  # nothing left to remove
    assert _answers(lake) == before
    with pytest.raises(ValueError, match="grace is a number of seconds"):
        lake.compact(grace=-1)
