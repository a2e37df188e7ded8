"""POST /sql: one read-only SELECT, rows capped, time-limited; everything else refused."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import tracedb
from tracedb.api import create_app

from support import FIXTURES


@pytest.fixture(scope="module")
def sql_client(tmp_path_factory: pytest.TempPathFactory) -> TestClient:
    path = tmp_path_factory.mktemp("sql") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
    app = create_app(path, allow_sql=True, sql_row_limit=10, sql_timeout_s=0.5)
    with TestClient(app, base_url="http://127.0.0.1") as c:
        yield c


def counts(client: TestClient) -> dict[str, int]:
    with client.app.state.backend.reader() as db:
        return {t: db.handle.scalar(f"SELECT count(*) FROM {t}") for t in ("traces", "nodes", "credit_sets", "rejects")}


def test_select_with_macros(sql_client: TestClient) -> None:
    body = sql_client.post("/sql", json={"sql": "SELECT trace_id, n_tokens FROM branch_stats() ORDER BY 1, 2"}).json()
    assert [c["name"] for c in body["columns"]] == ["trace_id", "n_tokens"]
    assert body["row_count"] == 10 and body["limit"] == 10 and body["truncated"] is True
    assert all(isinstance(r[1], int) for r in body["rows"])


def test_row_limit_and_requested_limit(sql_client: TestClient) -> None:
    body = sql_client.post("/sql", json={"sql": "SELECT * FROM range(3)", "limit": 5}).json()
    assert body["rows"] == [[0], [1], [2]] and body["truncated"] is False
    body = sql_client.post("/sql", json={"sql": "SELECT * FROM range(100)", "limit": 4}).json()
    assert body["row_count"] == 4 and body["truncated"] is True
    body = sql_client.post("/sql", json={"sql": "SELECT * FROM range(100)", "limit": 500}).json()
    assert body["limit"] == 10 and body["row_count"] == 10


def test_values_json_cannot_hold_are_made_jsonable(sql_client: TestClient) -> None:
    sql = (
        "SELECT 170141183460469231731687303715884105727::HUGEINT AS big, 1.5::DECIMAL(10,2) AS dec, "
        "'\\x00\\xff'::BLOB AS blob, INTERVAL 3 DAY AS span, 'nan'::DOUBLE AS nan, DATE '2026-01-02' AS day, "
        "[1, 2] AS list, {'a': 1} AS st, MAP {'k': 1.0} AS m, NULL AS nothing"
    )
    body = sql_client.post("/sql", json={"sql": sql})
    assert body.status_code == 200, body.text
    (row,) = body.json()["rows"]
    assert row[0] == "170141183460469231731687303715884105727" and row[1] == "1.50"
    assert row[4] is None and row[5] == "2026-01-02" and row[6] == [1, 2] and row[7] == {"a": 1} and row[9] is None


@pytest.mark.parametrize(
    "sql",
    [
        "DELETE FROM traces",
        "INSERT INTO credit_sets (name, algorithm) VALUES ('x', 'y')",
        "UPDATE traces SET reward = 0",
        "CREATE TABLE t AS SELECT 1",
        "DROP TABLE traces",
        "ATTACH ':memory:' AS other",
        "COPY traces TO '/tmp/tracedb-api-test.csv'",
        "PRAGMA database_list",
        "SET threads = 1",
        "CHECKPOINT",
        "SELECT 1; DELETE FROM traces",
        "EXPORT DATABASE '/tmp/tracedb-export-test'",
        # what a read-only attachment alone does not stop (tracedb.sqlcheck judges every statement)
        "USE memory",
        "DETACH runs_0",
        "USE memory; DETACH runs_0; ATTACH 'runs.duckdb' AS w; DELETE FROM w.traces",
        "SELECT 1; SELECT 2",
        "CREATE TEMP TABLE t AS SELECT 1",
        "COPY (SELECT 1) TO '/tmp/tracedb-api-test-copy.csv'",
        "COPY credit_sets FROM '/tmp/tracedb-api-test.csv'",
        "EXPLAIN SELECT 1",
        "EXPLAIN ANALYZE DELETE FROM traces",
        "CALL checkpoint()",
        "FORCE CHECKPOINT",
        "PRAGMA force_checkpoint",
        "IMPORT DATABASE '/tmp/tracedb-export-test'",
        "SET enable_external_access = true",
        "RESET threads",
        "INSTALL json",
        "LOAD json",
        "UPDATE EXTENSIONS",
        "BEGIN TRANSACTION",
        "PIVOT (SELECT 'a' AS k, 1 AS v) ON k USING sum(v)",
        "PREPARE p AS SELECT 1",
    ],
)
def test_anything_but_a_read_is_refused(sql_client: TestClient, sql: str) -> None:
    before = counts(sql_client)
    response = sql_client.post("/sql", json={"sql": sql})
    assert response.status_code == 403, response.text
    assert response.json()["error"] == "not_a_read"
    assert "\n" not in response.json()["detail"]
    assert counts(sql_client) == before
    assert not Path("/tmp/tracedb-api-test-copy.csv").exists()


def test_a_write_hidden_in_a_select_changes_nothing(sql_client: TestClient) -> None:
    before = counts(sql_client)
    sql = "WITH ins AS (INSERT INTO credit_sets (name, algorithm) VALUES ('x', 'y') RETURNING 1) SELECT * FROM ins"
    response = sql_client.post("/sql", json={"sql": sql})
    assert response.status_code == 400 and "read-only" in response.json()["detail"]
    assert counts(sql_client) == before


def test_files_are_out_of_reach(sql_client: TestClient) -> None:
    response = sql_client.post("/sql", json={"sql": "SELECT * FROM read_text('/etc/hostname')"})
    assert response.status_code == 400 and "disabled" in response.json()["detail"]


def test_time_limit_interrupts(sql_client: TestClient) -> None:
    started = time.perf_counter()
    response = sql_client.post("/sql", json={"sql": "SELECT count(*) FROM range(10000000000) a, range(10) b"})
    assert response.status_code == 400 and response.json()["error"] == "sql_timeout"
    assert time.perf_counter() - started < 5
    assert sql_client.post("/sql", json={"sql": "SELECT 42"}).json()["rows"] == [[42]]  # still serving


@pytest.mark.parametrize("body", [{"sql": "SELEC 1"}, {"sql": "SELECT * FROM no_such_table"}])
def test_bad_sql_is_400(sql_client: TestClient, body: dict) -> None:
    response = sql_client.post("/sql", json=body)
    assert response.status_code == 400 and response.json()["error"] == "bad_sql" and response.json()["detail"]


@pytest.mark.parametrize("body", [{}, {"sql": ""}, {"sql": 3}, {"sql": "SELECT 1", "limit": 0}, {"query": "SELECT 1"}])
def test_malformed_body_is_422(sql_client: TestClient, body: dict) -> None:
    response = sql_client.post("/sql", json=body)
    assert response.status_code == 422 and response.json()["error"] == "invalid_request"


def test_not_json_is_422(sql_client: TestClient) -> None:
    response = sql_client.post("/sql", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422 and response.json()["detail"]
