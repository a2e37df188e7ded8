"""Credit sets stored per trace (``layout='trace'``: one ``trace_credit`` row per trace) or
per node (``'node'``: ``credit`` rows), never both: what a trace-level stamp stores, that
every reader sees a per-trace set exactly as the same values stored per node (and as a
plain reference model: the trace's value on each sampled node, None elsewhere and for a
trace without a row), and the writes each layout takes or refuses."""

from __future__ import annotations

from typing import Any

import pyarrow as pa
import pytest
from fastapi.testclient import TestClient

import tracedb
import tracedb.credit
from tracedb.api import create_app
from tracedb.errors import WriteError
from tracedb.writeback import stamp_fresh

from support import FIXTURES
from support.writeback_model import (
    FORK,
    LINEAR,
    ODD_MASK,
    RECORDS,
    assert_reads,
    branch_layout,
    n_sampled,
    nodes_of,
    sampled_nodes,
    state,
    unassigned,
)


def count(db: tracedb.Database, query: str, params: list[Any] | None = None) -> int:
    return db.sql(f"SELECT count(*) AS n FROM ({query})", params).column("n")[0].as_py()


def trace_model(values: dict[str, float]) -> dict[str, list[Any]]:
    """Every fixture trace: ``values[trace]`` on each node with sampled tokens, None on the
    other nodes; a trace not in ``values`` unassigned."""
    model = unassigned(sorted(RECORDS))
    for tid, value in values.items():
        model[tid] = [[value] * n_sampled(tid, i) if n_sampled(tid, i) else None for i in range(len(nodes_of(tid)))]
    return model


def twin(db: tracedb.Database, name: str, per_trace: pa.Table) -> None:
    """The same credit stored per node: each trace's value on each of its sampled nodes."""
    db.create_credit_set(name)
    values = dict(zip(per_trace.column("trace_id").to_pylist(), per_trace.column("value").to_pylist()))
    rows = [
        {"trace_id": tid, "node_index": i, "value": value} for tid, value in values.items() for i in sampled_nodes(tid)
    ]
    if rows:
        db.write_nodes(rows, credit=name)


@pytest.fixture
def grpo_db(fixture_db):
    """grpo stamped as ``g`` (per trace) and as ``n`` (its twin, per node)."""
    tracedb.credit.run(fixture_db, "grpo", "g")
    twin(fixture_db, "n", tracedb.credit.compute(fixture_db, "grpo"))
    return fixture_db


# =========================================================================== storage


def test_a_trace_level_stamp_stores_one_row_per_trace(fixture_db):
    table = tracedb.credit.compute(fixture_db, "grpo")
    result = tracedb.credit.run(fixture_db, "grpo", "g")
    rows = fixture_db.sql("SELECT trace_id, value FROM trace_credit WHERE credit_set = 'g' ORDER BY 1").to_pylist()
    assert [r["trace_id"] for r in rows] == sorted(table.column("trace_id").to_pylist())
    want = dict(zip(table.column("trace_id").to_pylist(), table.column("value").to_pylist()))
    assert all(r["value"] == pytest.approx(want[r["trace_id"]], rel=1e-6, abs=1e-7) for r in rows)
    assert count(fixture_db, "SELECT * FROM credit WHERE credit_set = 'g'") == 0
    nodes = sum(len(sampled_nodes(t)) for t in want)
    (row,) = [r for r in fixture_db.credit_sets().to_pylist() if r["name"] == "g"]
    assert (row["layout"], row["assigned_nodes"], result["nodes"]) == ("trace", nodes, nodes)
    assert nodes > len(rows)  # the point: fewer rows than nodes
    per_node = tracedb.credit.run(fixture_db, "gae", "a")
    (row,) = [r for r in fixture_db.credit_sets().to_pylist() if r["name"] == "a"]
    assert row["layout"] == "node" and row["assigned_nodes"] == per_node["nodes"] > 0
    assert count(fixture_db, "SELECT * FROM trace_credit WHERE credit_set = 'a'") == 0


def test_every_reader_sees_a_per_trace_set_as_the_same_values_per_node(grpo_db, tmp_path):
    db = grpo_db
    values = dict(zip(*(tracedb.credit.compute(db, "grpo").column(c).to_pylist() for c in ("trace_id", "value"))))
    sampled = [t for t in RECORDS if sampled_nodes(t)]
    assert any(t not in values for t in sampled)  # a trace without a row is None (zeros: the write test)
    model = trace_model(values)
    assert_reads(db, tmp_path, model, credit="g")  # view, branch_tokens(), export, db.trace()
    assert_reads(db, tmp_path, model, credit="n")
    for kwargs in ({}, {"train_once": True}, {"trace_ids": [FORK, ODD_MASK, LINEAR]}):
        assert db.branches(credit="g", **kwargs).equals(db.branches(credit="n", **kwargs)), kwargs
    batches = [pa.concat_tables(db.iter_branches(credit=c, batch_tokens=1)) for c in ("g", "n")]
    assert batches[0].equals(batches[1])
    for query in (
        "SELECT * FROM node_credit(credit := ?) WHERE ? IS NOT NULL",
        "SELECT * FROM credit_compare(?, 'default') WHERE ? IS NOT NULL",
        "SELECT * FROM credit_advantages(?) WHERE ? IS NOT NULL",
    ):
        got, want = (db.sql(query + " ORDER BY ALL", [c, c]).to_pylist() for c in ("g", "n"))
        assert got == want and got, query
    compare = db.sql("SELECT * FROM credit_compare('g', 'n') ORDER BY trace_id").to_pylist()
    assert all(r["mass_a"] == r["mass_b"] and r["assigned_nodes_a"] == r["assigned_nodes_b"] for r in compare)
    reweighted = [tracedb.credit.compute(db, "reweight", source=c, weights="logprobs") for c in ("g", "n")]
    assert reweighted[0].equals(reweighted[1]) and reweighted[0].num_rows
    sets = {r["name"]: r for r in db.credit_sets().to_pylist()}
    assert sets["g"]["assigned_nodes"] == sets["n"]["assigned_nodes"]


def test_the_api_serves_a_per_trace_set_as_the_same_values_per_node(tmp_path):
    path = str(tmp_path / "api.duckdb")
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURES).ok
        tracedb.credit.run(db, "grpo", "g")
        twin(db, "n", tracedb.credit.compute(db, "grpo"))
        groups = db.sql("SELECT DISTINCT group_id FROM traces WHERE group_id IS NOT NULL").column(0).to_pylist()
    with TestClient(create_app(path, token="t0ken"), base_url="http://127.0.0.1") as client:

        def get(url: str, credit: str) -> Any:
            response = client.get(url, params={"credit": credit})
            assert response.status_code == 200, response.text
            body = response.json()
            return {k: v for k, v in body.items() if k != "credit"} if isinstance(body, dict) else body

        for tid in sorted(RECORDS):
            for url in (f"/traces/{tid}", f"/traces/{tid}/branches", f"/traces/{tid}/record"):
                assert get(url, "g") == get(url, "n"), url
        for gid in groups:
            assert get(f"/groups/{gid}", "g") == get(f"/groups/{gid}", "n"), gid
        sets = {s["name"]: s for s in client.get("/credit-sets").json()}
        assert sets["g"]["assigned_nodes"] == sets["n"]["assigned_nodes"] > 0
        # A per-node write into the per-trace set is refused as the library refuses it.
        node = sampled_nodes(FORK)[0]
        before = client.get(f"/traces/{FORK}/record", params={"credit": "g"}).json()
        response = client.put(
            f"/traces/{FORK}/nodes/{node}/advantages",
            params={"credit": "g"},
            json={"values": [1.0] * n_sampled(FORK, node)},
            headers={"Authorization": "Bearer t0ken"},
        )
        assert response.status_code == 422 and "stored per trace" in response.json()["detail"], response.text
        assert client.get(f"/traces/{FORK}/record", params={"credit": "g"}).json() == before


# =========================================================================== writes


def test_a_per_trace_set_refuses_per_node_writes(grpo_db):
    db = grpo_db
    node = sampled_nodes(FORK)[0]
    (_, mask), *_ = branch_layout(db, FORK)
    writes = {
        "write_nodes values": lambda: db.write_nodes(
            [{"trace_id": FORK, "node_index": node, "values": [1.0] * n_sampled(FORK, node)}], credit="g"
        ),
        "write_nodes value": lambda: db.write_nodes([{"trace_id": FORK, "node_index": node, "value": 1.0}], credit="g"),
        "write_nodes null": lambda: db.write_nodes(
            [{"trace_id": FORK, "node_index": node, "values": None}], credit="g"
        ),
        "write_branches": lambda: db.write_branches(
            [{"trace_id": FORK, "branch_index": 0, "values": [1.0 if m else 0.0 for m in mask]}], credit="g"
        ),
        "write_traces values": lambda: db.write_traces(
            [{"trace_id": FORK, "values": [1.0] * sum(n_sampled(FORK, i) for i in sampled_nodes(FORK))}], credit="g"
        ),
    }
    before = state(db)
    for what, write in writes.items():
        with pytest.raises(WriteError, match=r"credit set 'g' is stored per trace .*nothing written"):
            write()
        assert state(db) == before, what


def test_a_stamp_refuses_a_set_stored_the_other_way(fixture_db):
    db = fixture_db
    node = sampled_nodes(FORK)[0]
    per_trace = pa.table({"trace_id": [FORK], "value": [0.5]})
    per_node = pa.table({"trace_id": [FORK], "node_index": pa.array([node], pa.int32()), "value": [0.5]})
    db.create_credit_set("by-node")
    db.create_credit_set("by-trace", layout="trace")
    before = state(db)
    with pytest.raises(WriteError, match=r"'by-node' is stored per node .*layout='trace'"):
        stamp_fresh(db.handle, "by-node", per_trace, "trace")
    with pytest.raises(WriteError, match=r"'by-trace' is stored per trace .*layout='node'"):
        stamp_fresh(db.handle, "by-trace", per_node, "node")
    assert state(db) == before
    assert stamp_fresh(db.handle, "by-trace", per_trace, "trace") == len(sampled_nodes(FORK))
    assert stamp_fresh(db.handle, "by-node", per_node, "node") == 1


def test_write_traces_and_clear_on_a_per_trace_set(fixture_db, tmp_path):
    db = fixture_db
    db.create_credit_set("m", layout="trace")
    values = {FORK: 0.25, ODD_MASK: 0.0, LINEAR: -1.5}
    written = db.write_traces([{"trace_id": t, "value": v} for t, v in values.items()], credit="m")
    assert written == sum(len(sampled_nodes(t)) for t in values)
    assert count(db, "SELECT * FROM trace_credit WHERE credit_set = 'm'") == 3
    assert count(db, "SELECT * FROM credit WHERE credit_set = 'm'") == 0
    assert_reads(db, tmp_path, trace_model(values), credit="m")
    # A second write replaces the traces it names (a repeated equal row is one), a null clears one.
    rows = [{"trace_id": FORK, "value": 2.0}, {"trace_id": FORK, "value": 2.0}, {"trace_id": LINEAR, "value": None}]
    db.write_traces(
        pa.Table.from_pylist(rows, schema=pa.schema([("trace_id", pa.string()), ("value", pa.float64())])), credit="m"
    )
    values[FORK] = 2.0
    del values[LINEAR]
    assert count(db, "SELECT * FROM trace_credit WHERE credit_set = 'm'") == 2
    assert_reads(db, tmp_path, trace_model(values), credit="m")
    before = state(db)
    with pytest.raises(WriteError, match=f"trace {FORK}: two different advantages values"):
        db.write_traces([{"trace_id": FORK, "value": 1.0}, {"trace_id": FORK, "value": 3.0}], credit="m")
    with pytest.raises(WriteError, match="not in the database"):
        db.write_traces([{"trace_id": "nope", "value": 1.0}], credit="m")
    assert state(db) == before
    assert db.clear(credit="m", trace_ids=[FORK]) == len(nodes_of(FORK))
    del values[FORK]
    assert_reads(db, tmp_path, trace_model(values), credit="m")
    db.clear(credit="m")
    assert count(db, "SELECT * FROM trace_credit WHERE credit_set = 'm'") == 0
    assert_reads(db, tmp_path, trace_model({}), credit="m")


def test_create_refuses_an_unknown_layout(fixture_db):
    before = state(fixture_db)
    with pytest.raises(WriteError, match=r"layout must be one of \['node', 'trace'\], not 'branch'"):
        fixture_db.create_credit_set("x", layout="branch")
    assert state(fixture_db) == before


def test_replace_moves_a_set_between_layouts(fixture_db, tmp_path):
    db = fixture_db
    tracedb.credit.run(db, "gae", "x")
    nodes = count(db, "SELECT * FROM credit WHERE credit_set = 'x'")
    assert nodes > 0
    tracedb.credit.run(db, "grpo", "x", replace=True)
    assert count(db, "SELECT * FROM credit WHERE credit_set = 'x'") == 0
    tracedb.credit.run(db, "grpo", "ref")
    assert db.branches(credit="x").equals(db.branches(credit="ref"))
    tracedb.credit.run(db, "gae", "x", replace=True)
    assert count(db, "SELECT * FROM trace_credit WHERE credit_set = 'x'") == 0
    assert count(db, "SELECT * FROM credit WHERE credit_set = 'x'") == nodes
    db.drop_credit_set("ref")
    assert count(db, "SELECT * FROM trace_credit WHERE credit_set = 'ref'") == 0
