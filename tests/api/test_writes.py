"""Authenticated writes: ingest a body, stamp a node's advantages, register a credit set.

Each test gets its own server over its own database. A refused write is checked to
change nothing: the whole stored state is compared before and after.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import zstandard
from fastapi.testclient import TestClient

import tracedb
from tracedb.api import create_app
from tracedb.api.encode import to_json

from support import FIXTURES

TOKEN = "s3cret-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
LINEAR = FIXTURES / "linear.traces.jsonl"


def make_client(tmp_path: Path, *, ingest: bool = True, **kwargs: Any) -> TestClient:
    path = tmp_path / "runs.duckdb"
    with tracedb.connect(path) as db:
        if ingest:
            db.ingest(FIXTURES)
    return TestClient(create_app(path, **({"token": TOKEN} | kwargs)), base_url="http://127.0.0.1")


@pytest.fixture
def client(tmp_path: Path) -> TestClient:
    with make_client(tmp_path) as c:
        yield c


def state(client: TestClient) -> dict[str, Any]:
    """Everything a write could touch."""
    with client.app.state.backend.reader() as db:
        return {
            t: db.sql(f"SELECT * EXCLUDE ({skip}) FROM {t} ORDER BY ALL").to_pylist()
            for t, skip in [
                ("traces", "ingested_at"),
                ("nodes", "message"),
                ("credit", "value"),
                ("credit_sets", "created_at"),
                ("rejects", "rejected_at"),
                ("episodes", "ingested_at"),
            ]
        }


def a_node(client: TestClient, sampled: int = 3) -> tuple[str, int, int]:
    with client.app.state.backend.reader() as db:
        row = db.sql(
            "SELECT trace_id, node_index, n_sampled FROM nodes WHERE n_sampled >= ? ORDER BY ALL LIMIT 1", [sampled]
        ).to_pylist()[0]
    return row["trace_id"], row["node_index"], row["n_sampled"]


# --------------------------------------------------------------------------- auth


def test_missing_token_is_401_and_wrong_token_403(client: TestClient) -> None:
    before = state(client)
    for method, url, kw in [
        ("post", "/ingest", {"content": LINEAR.read_bytes()}),
        ("put", "/traces/x/nodes/0/advantages", {"json": {"values": None}}),
        ("post", "/credit-sets", {"json": {"name": "x"}}),
    ]:
        response = client.request(method, url, **kw)
        assert response.status_code == 401 and response.headers["www-authenticate"] == "Bearer"
        assert "Bearer" in response.json()["detail"]
        for headers in ({"Authorization": "Bearer nope"}, {"Authorization": f"Basic {TOKEN}"}):
            response = client.request(method, url, headers=headers, **kw)
            assert response.status_code in (401, 403) and response.json()["detail"]
        assert client.request(method, url, headers={"Authorization": "Bearer nope"}, **kw).status_code == 403
    assert state(client) == before


def test_empty_token_is_refused_at_startup(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty token"):
        create_app(tmp_path / "x.duckdb", token="")


# --------------------------------------------------------------------------- ingest


def test_ingest_returns_the_report(tmp_path: Path) -> None:
    with make_client(tmp_path, ingest=False) as client:
        body = client.post("/ingest", content=LINEAR.read_bytes(), headers=AUTH).json()
        assert body["traces"] > 0 and body["rejected"] == [] and body["skipped"] == 0
        listed = client.get("/traces", params={"limit": 1000}).json()["traces"]
        assert len(listed) == body["traces"]
        again = client.post("/ingest", content=LINEAR.read_bytes(), headers=AUTH).json()
        assert again["traces"] == 0 and again["skipped"] == body["traces"]


def test_ingest_zstd_body(tmp_path: Path) -> None:
    with make_client(tmp_path, ingest=False) as client:
        packed = zstandard.ZstdCompressor().compress(LINEAR.read_bytes())
        body = client.post("/ingest", content=packed, headers=AUTH | {"Content-Type": "application/zstd"}).json()
        assert body["traces"] > 0 and body["rejected"] == []


def test_ingest_keeps_good_lines_and_reports_bad_ones(tmp_path: Path) -> None:
    lines = LINEAR.read_bytes().splitlines()
    record = json.loads(lines[0])
    record["traces"][0]["nodes"][2]["logprobs"] = [0.0]  # wrong length for its mask
    broken = json.dumps(record).encode()
    with make_client(tmp_path, ingest=False) as client:
        body = client.post("/ingest", content=b"\n".join([broken, *lines[1:], b"{not json"]), headers=AUTH).json()
        assert body["traces"] == len(lines) - 1
        assert [r["line"] for r in body["rejected"]] == [1, len(lines) + 1]
        assert body["rejected"][0]["file"] == "request body" and "logprobs" in body["rejected"][0]["reason"]


def test_strict_ingest_of_a_bad_body_changes_nothing(client: TestClient) -> None:
    before = state(client)
    response = client.post("/ingest?strict=true", content=LINEAR.read_bytes() + b"\n{nope\n", headers=AUTH)
    assert response.status_code == 422 and "database unchanged" in response.json()["detail"]
    assert state(client) == before


@pytest.mark.parametrize("content", [b"", b"\n\n  \n", b"\x28\xb5\x2f\xfdgarbage"])
def test_empty_or_corrupt_bodies_are_422(client: TestClient, content: bytes) -> None:
    before = state(client)
    response = client.post("/ingest", content=content, headers=AUTH)
    assert response.status_code == 422 and response.json()["detail"]
    assert state(client) == before


def test_oversized_bodies_are_413(tmp_path: Path) -> None:
    with make_client(tmp_path, max_body_bytes=1000) as client:
        before = state(client)
        response = client.post("/ingest", content=LINEAR.read_bytes(), headers=AUTH)
        assert response.status_code == 413 and "1000 bytes" in response.json()["detail"]

        def chunks():  # no Content-Length: a chunked upload
            for _ in range(10):
                yield b"x" * 500

        response = client.post("/ingest", content=chunks(), headers=AUTH)
        assert response.status_code == 413 and response.json()["error"] == "too_large"
        response = client.put("/traces/x/nodes/0/advantages", json={"values": [0.0] * 500}, headers=AUTH)
        assert response.status_code == 413
        assert state(client) == before
        small = client.post("/ingest", content=b"{}", headers=AUTH)  # under the limit: reaches the route
        assert small.status_code == 200 and small.json()["rejected"]


# --------------------------------------------------------------------------- advantages


def test_put_advantages_into_a_credit_set(client: TestClient) -> None:
    trace_id, node, n = a_node(client)
    assert client.post("/credit-sets", json={"name": "mine", "params": {"beta": 0.1}}, headers=AUTH).status_code == 201
    values = [0.5 * i - 1 for i in range(n)]
    url = f"/traces/{trace_id}/nodes/{node}/advantages?credit=mine"
    body = client.put(url, json={"values": values}, headers=AUTH).json()
    assert body == {"trace_id": trace_id, "node_index": node, "credit": "mine", "nodes_written": 1}
    detail = client.get(f"/traces/{trace_id}", params={"credit": "mine", "tokens": "true"}).json()
    mine = detail["nodes"][node]
    assert mine["streams"][:1] == ["advantages"]
    mask = np.asarray(mine["tokens"]["sampled_mask"])
    assert np.allclose(np.asarray(mine["tokens"]["advantages"])[mask], values)
    with client.app.state.backend.reader() as db:
        view = db.branches(trace_ids=[trace_id], credit="mine").to_pylist()
    for row in view:
        got = client.get(f"/traces/{trace_id}/branches/{row['branch_index']}", params={"credit": "mine"}).json()
        assert (got["advantages"] is None) == (row["advantages"] is None)
        if row["advantages"] is not None:
            assert np.array_equal(np.float32(got["advantages"]), np.float32(row["advantages"]))
    cleared = client.put(url, json={"values": None}, headers=AUTH)
    assert cleared.status_code == 200
    assert (
        "advantages"
        not in client.get(f"/traces/{trace_id}", params={"credit": "mine"}).json()["nodes"][node]["streams"]
    )


def test_put_advantages_into_the_default_set(client: TestClient) -> None:
    trace_id, node, n = a_node(client)
    views = client.app.state.backend.views
    url = f"/traces/{trace_id}/branches/0"
    before = client.get(url).json()["advantages"]
    hits = views.hits
    assert client.get(url).json()["advantages"] == before and views.hits == hits + 1  # served from the cache
    response = client.put(f"/traces/{trace_id}/nodes/{node}/advantages", json={"values": [7.0] * n}, headers=AUTH)
    assert response.status_code == 200 and response.json()["credit"] == "default"
    with client.app.state.backend.reader() as db:
        assert db.trace(trace_id)["nodes"][node]["advantages"] == [7.0] * n
        assert client.get(url).json() == orjson.loads(to_json(db.branches(trace_ids=[trace_id]).slice(0, 1)))
    assert 7.0 in client.get(url).json()["advantages"]  # the write emptied the view cache


@pytest.mark.parametrize(
    ("make_url", "body", "status", "words"),
    [
        (lambda t, i: f"/traces/{t}/nodes/{i}/advantages", {"values": [1.0]}, 422, ["needs", "got 1"]),
        (lambda t, i: f"/traces/{t}/nodes/{i}/advantages", b'{"values": [NaN, 1, 2]}', 422, ["NaN"]),
        (lambda t, i: f"/traces/{t}/nodes/{i}/advantages", {"values": "high"}, 422, ["values"]),
        (lambda t, i: f"/traces/{t}/nodes/{i}/advantages", {}, 422, ["values"]),
        (lambda t, i: f"/traces/{t}/nodes/{i}/advantages?credit=nope", {"values": None}, 404, ["nope"]),
        (lambda t, i: f"/traces/{t}/nodes/999/advantages", {"values": None}, 404, ["no node 999"]),
        (lambda t, i: f"/traces/{t}/nodes/-1/advantages", {"values": None}, 422, ["index"]),
        (lambda t, i: "/traces/no-such/nodes/0/advantages", {"values": None}, 404, ["no-such"]),
    ],
)
def test_refused_advantages_change_nothing(client: TestClient, make_url, body, status: int, words: list[str]) -> None:
    trace_id, node, n = a_node(client)
    if isinstance(body, bytes) and b"NaN" in body:
        body = json.dumps({"values": [float("nan")] + [1.0] * (n - 1)}).encode()
    before = state(client)
    kwargs = (
        {"content": body, "headers": AUTH | {"Content-Type": "application/json"}}
        if isinstance(body, bytes)
        else {
            "json": body,
            "headers": AUTH,
        }
    )
    response = client.put(make_url(trace_id, node), **kwargs)
    assert response.status_code == status, response.text
    for word in words:
        assert word in response.json()["detail"]
    assert state(client) == before


def test_credit_set_registration(client: TestClient) -> None:
    created = client.post("/credit-sets", json={"name": "g", "algorithm": "grpo", "description": "d"}, headers=AUTH)
    assert created.status_code == 201 and created.json()["algorithm"] == "grpo"
    before = state(client)
    dup = client.post("/credit-sets", json={"name": "g"}, headers=AUTH)
    assert dup.status_code == 422 and "exists" in dup.json()["detail"]
    assert client.post("/credit-sets", json={"name": "default"}, headers=AUTH).status_code == 422
    assert client.post("/credit-sets", json={"name": ""}, headers=AUTH).status_code == 422
    for name in ("   ", " g", "g\n"):  # what no path may name a set
        refused = client.post("/credit-sets", json={"name": name}, headers=AUTH)
        assert refused.status_code == 422 and "cannot name a credit set" in refused.json()["detail"], name
    assert state(client) == before
    assert [s["name"] for s in client.get("/credit-sets").json()] == ["default", "g"]


def test_reads_see_writes_through_every_thread_cursor(client: TestClient) -> None:
    trace_id, node, n = a_node(client)
    db = client.app.state.backend.db
    pool = ThreadPoolExecutor(2)
    barrier = threading.Barrier(2)

    def view(_: int) -> list:
        barrier.wait()  # both workers busy at once: two threads, two cursors, two caches
        return db.branches(trace_ids=[trace_id]).column("advantages").to_pylist()

    before = list(pool.map(view, range(2)))
    client.put(f"/traces/{trace_id}/nodes/{node}/advantages", json={"values": [3.0] * n}, headers=AUTH)
    after = list(pool.map(view, range(2)))
    pool.shutdown()
    assert db.handle.open_handles() >= 2
    for old, new in zip(before, after):
        assert old != new and any(a and 3.0 in a for a in new)
