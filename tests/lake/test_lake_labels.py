"""Weight labels mapped to policy versions in a lake: ``Lake.set_policy_versions`` stores
the mapping and the bounds the file store's ``db.set_policy_versions`` stores (each trace
keeping its seq); a pull carries the mapping; a push or pull of another mapping of a label
is refused before anything is written; an ingest task starts from the lake's mapping."""

from __future__ import annotations

import pytest

import tracedb
from tracedb.errors import WriteError

from support import FIXTURES_041

pytest.importorskip("pyiceberg_core", reason="the lake extra is not installed (pip install '.[lake]')")

import tracedb.lake as lakes  # noqa: E402
from tracedb.lake import write  # noqa: E402
from tracedb.lake.ingest import ingest_files  # noqa: E402

LABELS = FIXTURES_041 / "labels.traces.jsonl"
MAPPING = {"ckpt-abc": 5, "3f9a1c0de2b4": 9}
"""The labels of the fixture that name no number of their own."""
BOUNDS = "SELECT trace_id, policy_min, policy_max, policy_unknown FROM traces ORDER BY trace_id"


def _bounds(table):
    return table.select(["trace_id", "policy_min", "policy_max", "policy_unknown"]).sort_by("trace_id").to_pylist()


def test_a_mapping_in_the_lake_stores_the_file_stores_bounds(tmp_path):
    store = tmp_path / "run.duckdb"
    with tracedb.connect(store) as db:
        db.ingest(LABELS)
        unmapped = db.sql(BOUNDS).to_pylist()
    lake = lakes.init(tmp_path / "L")
    lake.push(store)
    seqs = lake.tables()["traces"].select(["trace_id", "seq"]).sort_by("trace_id").to_pylist()
    assert _bounds(lake.tables()["traces"]) == unmapped and lake.policy_versions() == {}
    with tracedb.connect(store) as db:
        assert db.set_policy_versions(MAPPING) == 1
        mapped = db.sql(BOUNDS).to_pylist()
    assert mapped != unmapped
    assert lake.set_policy_versions(MAPPING) == 1
    tables = lake.tables()
    assert _bounds(tables["traces"]) == mapped and lake.policy_versions() == MAPPING
    assert tables["traces"].select(["trace_id", "seq"]).sort_by("trace_id").to_pylist() == seqs
    with tracedb.connect(store, read_only=True) as db:
        want = db.micro_batches(4096, policy=12, max_staleness=9, trainable=None)  # no unknown token left
    got = lake.micro_batches(4096, policy=12, max_staleness=9, trainable=None)
    assert got.report.to_dict() | {"watermark": 0} == want.report.to_dict() | {"watermark": 0}
    with tracedb.connect(tmp_path / "pulled.duckdb") as db:  # a pull carries the mapping
        lake.pull(db)
        assert {r["label"]: r["version"] for r in db.policy_versions().to_pylist()} == MAPPING
        assert db.sql(BOUNDS).to_pylist() == mapped

    other = tmp_path / "other.duckdb"
    with tracedb.connect(other) as db:
        db.ingest(LABELS)
        db.set_policy_versions({"ckpt-abc": 6})
    before = {name: lake.table(name).current_snapshot() for name in ("traces", "nodes", "policy_labels")}
    with pytest.raises(WriteError, match=r"weight label 'ckpt-abc': the lake maps it to policy version 5, this write"):
        lake.push(other)
    assert {name: lake.table(name).current_snapshot() for name in before} == before  # nothing written
    with pytest.raises(WriteError, match=r"weight label 'ckpt-abc': this file maps it to policy version 6, the lake"):
        lake.pull(other)


def test_an_ingest_task_starts_from_the_lakes_mapping(tmp_path):
    lake = lakes.init(tmp_path / "L")
    assert lake.set_policy_versions(MAPPING) == 0  # no trace yet: the mapping alone
    done = ingest_files(lake.location, [str(LABELS)], allow_ragged=False)
    assert write.commit(lake, [done["staged"]]).rows["traces"] == 1
    with tracedb.connect(":memory:") as db:
        db.set_policy_versions(MAPPING)
        db.ingest(LABELS)
        want = db.sql(BOUNDS).to_pylist()
    assert _bounds(lake.tables()["traces"]) == want and want[0]["policy_unknown"] == 0
    assert lake.tables()["policy_labels"].num_rows == len(MAPPING)  # the task's equal rows not written again


def test_lake_policy_versions_command(tmp_path):
    import json

    from typer.testing import CliRunner

    from tracedb.cli.main import app

    run = CliRunner().invoke
    lakes.init(tmp_path / "L")
    where = str(tmp_path / "L")
    done = run(app, ["lake", "policy-versions", "--lake", where, "--set", "ckpt-abc=5", "--json"])
    assert done.exit_code == 0, done.output
    assert json.loads(done.output) == {"labels": 1, "traces": 0}
    listed = run(app, ["lake", "policy-versions", "--lake", where, "--json"])
    assert json.loads(listed.output) == [{"label": "ckpt-abc", "version": 5}]
    again = run(app, ["lake", "policy-versions", "--lake", where, "--set", "ckpt-abc=7", "--json"])
    assert again.exit_code == 0, again.output
    listed = run(app, ["lake", "policy-versions", "--lake", where, "--json"])
    assert json.loads(listed.output) == [{"label": "ckpt-abc", "version": 7}]  # the latest mapping
    sql = lakes.open(where).sql("SELECT label, version FROM policy_labels").to_pylist()
    assert sql == [{"label": "ckpt-abc", "version": 7}]
    for bad, message in (("ckpt", "expected LABEL=N"), ("step_3=4", "names its policy version itself")):
        refused = run(app, ["lake", "policy-versions", "--lake", where, "--set", bad])
        assert refused.exit_code == 2 and message in refused.output and "Traceback" not in refused.output
