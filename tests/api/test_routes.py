"""REST reads and their errors, in process: every route checked against the library.

One session-scoped client serves every read (datasette's habit); the database holds
every golden fixture plus a named credit set ``probe`` written through the library.
"""

from __future__ import annotations

import base64
import io
import json
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest
from fastapi.testclient import TestClient

import tracedb
from tracedb.api import create_app

from support import FIXTURES

ARROW = "application/vnd.apache.arrow.stream"


@pytest.fixture(scope="session")
def api_db_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("api") / "runs.duckdb")
    with tracedb.connect(path) as db:
        assert db.ingest(FIXTURES).ok
        db.create_credit_set("probe", algorithm="manual")
        rows = db.sql("SELECT trace_id, node_index, n_sampled FROM nodes WHERE n_sampled > 0 AND node_index % 3 = 2")
        db.write_nodes(
            [
                {"trace_id": t, "node_index": n, "values": [float(i % 5) - 2.0 for i in range(k)]}
                for t, n, k in zip(*(rows.column(c).to_pylist() for c in rows.column_names))
            ],
            credit="probe",
        )
    return path


@pytest.fixture(scope="session")
def client(api_db_path: str) -> TestClient:
    with TestClient(create_app(api_db_path), base_url="http://127.0.0.1") as c:
        yield c


@pytest.fixture(scope="session")
def lib(api_db_path: str, client: TestClient) -> tracedb.Database:
    """The library's answers, through the app's own database handle."""
    with client.app.state.backend.reader() as db:
        yield db


def ids(lib: tracedb.Database, where: str = "true", params: list[Any] | None = None) -> list[str]:
    return [r["trace_id"] for r in lib.sql(f"SELECT trace_id FROM traces WHERE {where} ORDER BY 1", params).to_pylist()]


def error(response: Any, status: int, *words: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) >= {"error", "detail"} and body["detail"]
    for word in words:
        assert word in body["detail"], body
    return body


def same_floats(got: list[float] | None, want: list[float] | None) -> bool:
    if got is None or want is None:
        return got is None and want is None
    return np.array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# --------------------------------------------------------------------------- health, schema


def test_health(client: TestClient) -> None:
    body = client.get("/health").json()
    assert body["status"] == "ok" and body["traces"] == 44 and body["schema_version"] == tracedb.SCHEMA_VERSION
    assert body["writes_enabled"] is False and body["sql_enabled"] is False


def test_openapi_describes_every_route(client: TestClient) -> None:
    schema = client.get("/openapi.json").json()
    paths = schema["paths"]
    for path, method in [
        ("/health", "get"),
        ("/traces", "get"),
        ("/traces/{trace_id}", "get"),
        ("/traces/{trace_id}/record", "get"),
        ("/traces/{trace_id}/branches", "get"),
        ("/traces/{trace_id}/branches/{index}", "get"),
        ("/groups/{group_id}", "get"),
        ("/sql", "post"),
        ("/ingest", "post"),
        ("/traces/{trace_id}/nodes/{index}/advantages", "put"),
        ("/credit-sets", "get"),
        ("/credit-sets", "post"),
        ("/", "get"),
        ("/view/{trace_id}", "get"),
    ]:
        assert method in paths[path], (path, method)
    branch = paths["/traces/{trace_id}/branches/{index}"]["get"]["responses"]
    assert set(branch["200"]["content"]) == {"application/json", ARROW}
    assert branch["404"]["content"]["application/json"]["schema"]["$ref"].endswith("/ErrorBody")
    assert "bearer" in json.dumps(paths["/ingest"]["post"]).lower() or "HTTPBearer" in json.dumps(schema)


# --------------------------------------------------------------------------- listing


def test_traces_pages_through_every_trace_once(client: TestClient, lib: tracedb.Database) -> None:
    seen, cursor = [], None
    while True:
        params = {"limit": 7} | ({"cursor": cursor} if cursor else {})
        page = client.get("/traces", params=params).json()
        assert len(page["traces"]) <= 7
        seen += [t["trace_id"] for t in page["traces"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == ids(lib)


@pytest.mark.parametrize("sort", ["reward", "-reward"])
def test_traces_sorted_by_reward_across_pages(client: TestClient, lib: tracedb.Database, sort: str) -> None:
    rows, cursor = [], None
    while True:
        page = client.get("/traces", params={"sort": sort, "limit": 5, **({"cursor": cursor} if cursor else {})})
        rows += page.json()["traces"]
        if (cursor := page.json()["next_cursor"]) is None:
            break
    sign = -1 if sort == "-reward" else 1
    want = sorted(
        lib.sql("SELECT trace_id, reward FROM traces").to_pylist(),
        key=lambda r: (r["reward"] is None, sign * (r["reward"] or 0.0), r["trace_id"]),
    )
    assert [r["trace_id"] for r in rows] == [r["trace_id"] for r in want]


def test_trace_rows_carry_the_listing_fields(client: TestClient, lib: tracedb.Database) -> None:
    row = client.get("/traces", params={"limit": 1}).json()["traces"][0]
    want = lib.sql(
        "SELECT trace_id, episode_id, group_id, reward, ok, stop_condition, n_nodes, n_branches, n_tokens, n_sampled "
        "FROM traces ORDER BY trace_id LIMIT 1"
    ).to_pylist()[0]
    assert row == want


@pytest.mark.parametrize(
    ("params", "where", "args"),
    [
        ({"group": "group-1"}, "group_id = ?", ["group-1"]),
        ({"ok": "false"}, "ok = false", []),
        ({"min_reward": 0.5}, "reward >= 0.5", []),
        ({"max_reward": 0.5, "ok": "true"}, "reward <= 0.5 AND ok", []),
        ({"stop_condition": "max_turns"}, "stop_condition = 'max_turns'", []),
        (
            {"group": "group-3", "min_reward": 0.1, "max_reward": 0.9},
            "group_id = 'group-3' AND reward BETWEEN 0.1 AND 0.9",
            [],
        ),
    ],
)
def test_traces_filters(client: TestClient, lib: tracedb.Database, params: dict, where: str, args: list) -> None:
    got = [t["trace_id"] for t in client.get("/traces", params={**params, "limit": 1000}).json()["traces"]]
    assert got == ids(lib, where, args) and got


def test_traces_filter_by_episode(client: TestClient, lib: tracedb.Database) -> None:
    episode = lib.sql("SELECT episode_id FROM traces ORDER BY trace_id LIMIT 1").to_pylist()[0]["episode_id"]
    got = client.get("/traces", params={"episode": episode}).json()["traces"]
    assert [t["trace_id"] for t in got] == ids(lib, "episode_id = ?", [episode])


# --------------------------------------------------------------------------- one trace


def test_trace_detail_matches_the_record(client: TestClient, lib: tracedb.Database) -> None:
    for trace_id in ids(lib):
        body = client.get(f"/traces/{trace_id}", params={"messages": "true"}).json()
        record = lib.trace(trace_id)
        assert body["trace_id"] == trace_id and body["credit"] == "default"
        assert len(body["nodes"]) == len(record["nodes"]) == body["n_nodes"]
        for node, rec in zip(body["nodes"], record["nodes"]):
            assert node["parent"] == rec.get("parent")
            assert node["role"] == rec["message"]["role"] and node["message"] == rec["message"]
            assert node["sampled"] == rec.get("sampled")
            assert node["n_tokens"] == len(rec["token_ids"]) and node["n_sampled"] == sum(rec["mask"])
            assert node["has_logprobs"] == bool(rec.get("logprobs"))
            held = [
                s
                for s in ("advantages", "reference_logprobs", "trainer_logprobs", "entropies")
                if rec.get(s) is not None
            ]
            assert node["streams"] == held
            assert node["loss_weight_names"] == sorted(rec.get("loss_weights") or {})
            assert "tokens" not in node


def test_trace_detail_tokens_are_full_layout(client: TestClient, lib: tracedb.Database) -> None:
    for trace_id in ids(lib)[:12]:
        body = client.get(f"/traces/{trace_id}", params={"tokens": "true", "credit": "probe"}).json()
        record = lib.trace(trace_id, credit="probe")
        for node, rec in zip(body["nodes"], record["nodes"]):
            tokens = node["tokens"]
            assert tokens["token_ids"] == rec["token_ids"]
            assert tokens["sampled_mask"] == rec["mask"]
            for name in ("logprobs", "advantages", "entropies"):
                compact = rec.get(name)
                if name != "logprobs" and compact is None:
                    assert tokens[name] is None
                    continue
                want = np.zeros(len(rec["mask"]), np.float32)
                slots = np.flatnonzero(rec["mask"])
                values = np.asarray(compact or [], np.float32)[: len(slots)]
                want[slots[: len(values)]] = values
                assert same_floats(tokens[name], want.tolist()), (trace_id, name)
            assert ("advantages" in node["streams"]) == (rec.get("advantages") is not None)


def test_record_is_the_record_as_ingested(client: TestClient, lib: tracedb.Database) -> None:
    for trace_id in ids(lib)[:10]:
        assert client.get(f"/traces/{trace_id}/record").json() == lib.trace(trace_id)
    first = ids(lib)[0]
    assert client.get(f"/traces/{first}/record", params={"credit": "probe"}).json() == lib.trace(first, credit="probe")


# --------------------------------------------------------------------------- branches


def test_branch_list(client: TestClient, lib: tracedb.Database) -> None:
    for credit in ("default", "probe"):
        view = lib.branches(credit=None if credit == "default" else credit).to_pylist()
        for trace_id in ids(lib):
            body = client.get(f"/traces/{trace_id}/branches", params={"credit": credit}).json()
            want = [r for r in view if r["trace_id"] == trace_id]
            assert body["credit"] == credit and len(body["branches"]) == len(want)
            for got, row in zip(body["branches"], want):
                assert got["branch_index"] == row["branch_index"] and got["trainable"] == row["trainable"]
                assert got["n_tokens"] == len(row["token_ids"]) and got["n_sampled"] == sum(row["sampled_mask"])
                assert got["credit_assigned"] == (row["advantages"] is not None)
                assert (got["credit_status"] == "unassigned") == (row["advantages"] is None)


def _check_json(body: dict[str, Any], row: dict[str, Any]) -> None:
    assert set(body) == set(row)
    for key, want in row.items():
        if key == "loss_weights":
            assert set(body[key]) == {k for k, _ in want}
            for name, values in want:
                assert same_floats(body[key][name], values)
        elif key in ("logprobs", "advantages", "reference_logprobs", "trainer_logprobs", "entropies"):
            assert same_floats(body[key], want), key
        else:
            assert body[key] == want, key


def test_every_branch_as_json_equals_the_library_view(client: TestClient, lib: tracedb.Database) -> None:
    for row in lib.branches().to_pylist():
        response = client.get(f"/traces/{row['trace_id']}/branches/{row['branch_index']}")
        assert response.headers["content-type"] == "application/json"
        _check_json(response.json(), row)


def test_every_branch_as_arrow_equals_the_library_view(client: TestClient, lib: tracedb.Database) -> None:
    for trace_id in ids(lib):
        table = lib.branches(trace_ids=[trace_id])
        for i, index in enumerate(table.column("branch_index").to_pylist()):
            response = client.get(f"/traces/{trace_id}/branches/{index}", headers={"Accept": ARROW})
            assert response.headers["content-type"] == ARROW
            got = ipc.open_stream(io.BytesIO(response.content)).read_all()
            assert got.schema.equals(tracedb.BRANCH_SCHEMA)
            assert tracedb.watermark_of(got) == lib.watermark()  # the read's watermark travels with it
            assert got.equals(table.slice(i, 1))


@pytest.mark.parametrize(
    ("query", "credit", "train_once"),
    [("credit=probe", "probe", False), ("train_once=true", None, True), ("credit=default&train_once=true", None, True)],
)
def test_branch_options_follow_the_library(
    client: TestClient, lib: tracedb.Database, query, credit, train_once
) -> None:
    view = lib.branches(credit=credit, train_once=train_once)
    for row in view.to_pylist():
        base = f"/traces/{row['trace_id']}/branches/{row['branch_index']}?{query}"
        _check_json(client.get(base).json(), row)
        arrow = ipc.open_stream(io.BytesIO(client.get(base + "&format=arrow").content)).read_all()
        assert arrow.to_pylist() == [row]


def test_branch_fields_pick_columns(client: TestClient, lib: tracedb.Database) -> None:
    trace_id = ids(lib)[0]
    want = lib.branches(trace_ids=[trace_id], columns=["token_ids", "advantages"])
    body = client.get(f"/traces/{trace_id}/branches/0", params={"fields": ["token_ids", "advantages"]}).json()
    assert set(body) == {"trace_id", "branch_index", "trainable", "token_ids", "advantages"}
    _check_json(body, want.slice(0, 1).to_pylist()[0])
    response = client.get(
        f"/traces/{trace_id}/branches/0?fields=advantages&fields=token_ids", headers={"Accept": ARROW}
    )
    got = ipc.open_stream(io.BytesIO(response.content)).read_all()
    assert got.schema.equals(want.schema) and got.equals(want.slice(0, 1))


def test_null_advantages_stay_null_and_zeros_stay_zeros(client: TestClient, lib: tracedb.Database) -> None:
    nulls = lib.branches().filter(pa.compute.is_null(lib.branches().column("advantages")))
    assert nulls.num_rows
    row = nulls.slice(0, 1).to_pylist()[0]
    body = client.get(f"/traces/{row['trace_id']}/branches/{row['branch_index']}").json()
    assert body["advantages"] is None and body["reference_logprobs"] is None
    assert '"advantages":null' in client.get(f"/traces/{row['trace_id']}/branches/{row['branch_index']}").text


def test_accept_header_negotiation(client: TestClient, lib: tracedb.Database) -> None:
    url = f"/traces/{ids(lib)[0]}/branches/0"
    for accept, kind in [
        ("*/*", "application/json"),
        ("application/json", "application/json"),
        (f"application/json;q=0.5, {ARROW}", ARROW),
        (f"{ARROW};q=0", "application/json"),
    ]:
        assert client.get(url, headers={"Accept": accept}).headers["content-type"] == kind
    assert client.get(url + "?format=json", headers={"Accept": ARROW}).headers["content-type"] == "application/json"


# --------------------------------------------------------------------------- groups, credit sets


def test_group(client: TestClient, lib: tracedb.Database) -> None:
    for group in ("group-0", "group-1", "group-2", "group-3"):
        body = client.get(f"/groups/{group}").json()
        members = lib.sql("SELECT trace_id, reward FROM traces WHERE group_id = ? ORDER BY 1", [group]).to_pylist()
        assert [t["trace_id"] for t in body["traces"]] == [m["trace_id"] for m in members]
        rewards = np.array([m["reward"] for m in members])
        assert body["n_traces"] == len(members)
        assert body["reward_mean"] == pytest.approx(rewards.mean()) and body["reward_std"] == pytest.approx(
            rewards.std()
        )
        assert body["zero_variance"] == bool(np.all(rewards == rewards[0]))
        for t in body["traces"]:
            credited = lib.sql(
                "SELECT count(*) AS n FROM nodes WHERE trace_id = ? AND advantages IS NOT NULL", [t["trace_id"]]
            ).to_pylist()[0]["n"]
            assert t["credited_nodes"] == credited
            assert (t["credit_status"] == "unassigned") == (credited == 0)
    probe = client.get("/groups/group-0", params={"credit": "probe"}).json()
    statuses = {t["credit_status"] for t in probe["traces"]}
    assert probe["credit"] == "probe" and statuses <= {"partial", "assigned", "zero"}


def test_credit_sets(client: TestClient) -> None:
    sets = client.get("/credit-sets").json()
    assert [s["name"] for s in sets] == ["default", "probe"]
    assert sets[1]["algorithm"] == "manual" and sets[1]["assigned_nodes"] > 0


# --------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "url",
    [
        "/traces/no-such-trace",
        "/traces/no-such-trace/record",
        "/traces/no-such-trace/branches",
        "/traces/no-such-trace/branches/0",
        "/groups/no-such-group",
        "/view/no-such-trace",
    ],
)
def test_unknown_ids_are_404(client: TestClient, url: str) -> None:
    error(client.get(url), 404, "no-such")


def test_unknown_branch_and_credit_set_are_404(client: TestClient, lib: tracedb.Database) -> None:
    trace_id = ids(lib)[0]
    error(client.get(f"/traces/{trace_id}/branches/7"), 404, "branches", "no 7")
    for url in (
        f"/traces/{trace_id}",
        f"/traces/{trace_id}/branches",
        f"/traces/{trace_id}/branches/0",
        "/groups/group-0",
    ):
        error(client.get(url, params={"credit": "nope"}), 404, "credit set 'nope'")


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("/traces?limit=0", ["limit"]),
        ("/traces?limit=abc", ["limit"]),
        ("/traces?limit=100000", ["limit"]),
        ("/traces?sort=size", ["sort"]),
        ("/traces?ok=maybe", ["ok"]),
        ("/traces?min_reward=nan", ["min_reward"]),
        ("/traces?max_reward=inf", ["max_reward"]),
        ("/traces?cursor=garbage", ["cursor"]),
        ("/traces/x/branches/-1", ["index"]),
        ("/traces/x/branches/abc", ["index"]),
        ("/traces/x/branches/99999999999999999999", ["index"]),
        ("/traces/x/branches/0?format=xml", ["format"]),
        ("/traces/x/branches/0?train_once=perhaps", ["train_once"]),
        ("/traces/x?tokens=lots", ["tokens"]),
    ],
)
def test_malformed_parameters_are_422(client: TestClient, url: str, words: list[str]) -> None:
    body = error(client.get(url), 422, *words)
    assert body["error"] == "invalid_request"


def test_unknown_fields_are_422(client: TestClient, lib: tracedb.Database) -> None:
    error(client.get(f"/traces/{ids(lib)[0]}/branches/0?fields=token_ids&fields=bogus"), 422, "fields")
    error(client.get(f"/traces/{ids(lib)[0]}/branches/0?fields=token_ids,advantages"), 422, "fields")


def test_cursor_of_another_sort_is_422(client: TestClient) -> None:
    cursor = client.get("/traces", params={"limit": 2, "sort": "reward"}).json()["next_cursor"]
    error(client.get("/traces", params={"cursor": cursor}), 422, "sort")
    forged = base64.urlsafe_b64encode(b'{"sort":"trace_id","after":[1,2]}').decode()
    error(client.get("/traces", params={"cursor": forged}), 422, "cursor")


def test_sql_and_writes_are_refused_on_a_default_server(client: TestClient) -> None:
    error(client.post("/sql", json={"sql": "SELECT 1"}), 403, "--allow-sql")
    error(client.post("/ingest", content=b"{}"), 403, "--token")
    error(client.put("/traces/x/nodes/0/advantages", json={"values": None}), 403, "--token")
    error(client.post("/credit-sets", json={"name": "x"}), 403, "--token")


def test_unknown_route_and_method_are_json(client: TestClient) -> None:
    error(client.get("/nowhere"), 404)
    error(client.delete("/traces"), 405)
