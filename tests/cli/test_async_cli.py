"""The asynchronous trainer's options on the command line and over REST: --policy /
--max-staleness / --stale / --unknown / --include-dropped / --include-eval / --max-groups on
pack and export, `tracedb policy-versions`, and the same parameters on the routes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from typer.testing import CliRunner

import tracedb
from tracedb.api import create_app
from tracedb.batches import read_micro_batches
from tracedb.cli.main import app

from support import FIXTURES_041

runner = CliRunner()
TOKEN = "t0ken"


def invoke(*args: object):
    return runner.invoke(app, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(sorted(FIXTURES_041.glob("*.traces.jsonl")))
        every = db.sql("SELECT trace_id FROM traces").column(0).to_pylist()
        db.create_credit_set("flat", layout="trace")
        db.write_traces([{"trace_id": t, "value": 0.5} for t in every], credit="flat")
    return path


def packed(out: Path) -> set[str]:
    return {t for mb in read_micro_batches(out, rank=0) for t in mb.samples.column("trace_id").to_pylist()}


def test_pack_leaves_out_dropped_and_eval_unless_asked(db_path, tmp_path):
    with tracedb.connect(db_path, read_only=True) as db:
        dropped = set(db.sql("SELECT trace_id FROM traces WHERE dropped IS NOT NULL").column(0).to_pylist())
        evals = set(db.sql("SELECT trace_id FROM traces WHERE work_type = 'eval'").column(0).to_pylist())
    base = ("pack", "--db", db_path, "--seq-len", 4096, "--credit", "flat", "--all-branches", "--json")
    result = invoke(*base, "--out", tmp_path / "a")
    assert result.exit_code == 0, result.output
    manifest = json.loads(result.stdout)
    assert not packed(tmp_path / "a") & (dropped | evals)
    assert manifest["report"]["dropped"] == len(dropped)
    result = invoke(*base, "--out", tmp_path / "b", "--include-dropped", "--include-eval")
    assert result.exit_code == 0 and packed(tmp_path / "b") >= dropped | evals


def test_pack_with_a_staleness_bound_and_its_refusals(db_path, tmp_path):
    base = ("pack", "--db", db_path, "--seq-len", 4096, "--credit", "flat", "--out", tmp_path / "s")
    refused = invoke(*base, "--policy", 12, "--max-staleness", 1)
    assert refused.exit_code == 2 and "unknown policy version" in refused.stderr and "Traceback" not in refused.output
    ok = invoke(*base, "--policy", 12, "--max-staleness", 1, "--unknown", "drop", "--json")
    assert ok.exit_code == 0, ok.output
    report = json.loads(ok.stdout)["report"]
    assert report["policy"] == 12 and report["staleness_bound"] == 11 and report["stale_groups"] >= 1
    bad = invoke(*base, "--policy", 12)
    assert bad.exit_code == 2 and "max_staleness" in bad.stderr


def test_policy_versions_command_maps_and_lists(db_path):
    listed = invoke("policy-versions", "--db", db_path, "--json")
    assert listed.exit_code == 0 and json.loads(listed.stdout) == []
    mapped = invoke("policy-versions", "--db", db_path, "--set", "ckpt-abc=41", "--json")
    assert mapped.exit_code == 0, mapped.output
    assert json.loads(mapped.stdout)["labels"] == 1
    listed = json.loads(invoke("policy-versions", "--db", db_path, "--json").stdout)
    assert [(r["label"], r["version"]) for r in listed] == [("ckpt-abc", 41)]
    for bad in ("noequals", "step_3=4", "x=-1", "x=1.5"):
        result = invoke("policy-versions", "--db", db_path, "--set", bad)
        assert result.exit_code == 2 and "Traceback" not in result.output, (bad, result.output)


def test_the_routes_take_the_same_parameters(db_path):
    app_ = create_app(db_path, token=TOKEN, allowed_hosts=["testserver"])
    with TestClient(app_) as client:
        plain = client.get("/traces", params={"after": 0}).json()
        assert {"dropped", "work_type", "policy_min"} <= set(plain["traces"][0])
        r = client.get(
            "/micro-batches", params={"seq_len": 4096, "rank": 0, "credit": "flat", "policy": 12, "max_staleness": 1}
        )
        assert r.status_code == 422 and "unknown policy version" in r.json()["detail"]
        r = client.get(
            "/micro-batches",
            params={"seq_len": 4096, "rank": 0, "credit": "flat", "policy": 12, "max_staleness": 1, "unknown": "drop"},
        )
        assert r.status_code == 200
        report = json.loads(r.headers["X-Tracedb-Report"])
        assert report["staleness_bound"] == 11
        assert client.put("/policy-versions", json={"versions": {"ckpt-abc": 41}}).status_code == 401
        put = client.put(
            "/policy-versions", json={"versions": {"ckpt-abc": 41}}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert put.status_code == 200, put.text
        assert client.get("/policy-versions").json()[0]["version"] == 41
        own = client.put(
            "/policy-versions", json={"versions": {"step_3": 4}}, headers={"Authorization": f"Bearer {TOKEN}"}
        )
        assert own.status_code == 422 and "names its policy version itself" in own.json()["detail"]
