"""Fuzz the OpenAPI schema (schemathesis) against the in-process app: no input may
produce a 500, and every response must match the schema (status, content type, body).

Positive and negative cases for every operation, reads and writes (with the token),
over a database holding the golden fixtures; bounded so the run stays well under a minute.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, assume, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import positive_data_acceptance

import tracedb
from tracedb.api import create_app

from support import FIXTURES

TOKEN = "fuzz-token"
OPERATIONS = [
    ("GET", "/health"),
    ("GET", "/traces"),
    ("GET", "/traces/{trace_id}"),
    ("GET", "/traces/{trace_id}/record"),
    ("GET", "/traces/{trace_id}/branches"),
    ("GET", "/traces/{trace_id}/branches/{index}"),
    ("GET", "/groups/{group_id}"),
    ("GET", "/branches"),
    ("GET", "/micro-batches"),
    ("GET", "/stats"),
    ("POST", "/ingest"),
    ("PUT", "/traces/{trace_id}/nodes/{index}/advantages"),
    ("GET", "/credit-sets"),
    ("POST", "/credit-sets"),
    ("POST", "/sql"),
    ("GET", "/policy-versions"),
    ("PUT", "/policy-versions"),
    ("GET", "/"),
    ("GET", "/view/{trace_id}"),
    ("GET", "/run"),
    ("GET", "/api/run"),
    ("GET", "/view/group/{group_id}"),
    ("GET", "/traces/{trace_id}/turns"),
    ("GET", "/runs"),
    ("GET", "/api/runs/compare"),
    ("GET", "/runs/compare"),
]
STRING_LISTS = ("trace_id", "group", "episode")
"""Repeatable query parameters of strings: whatever the fuzzer puts there (a number, a
boolean, a list of them) is a list of strings on the wire, hence valid, though it counts
it as a violation; negative cases keep only what the wire can carry as invalid there."""
NO_INPUT = {
    ("GET", "/health"),
    ("GET", "/credit-sets"),
    ("GET", "/stats"),
    ("GET", "/policy-versions"),
    ("GET", "/runs"),
}  # nothing to make invalid


@pytest.fixture(scope="module")
def api_schema(tmp_path_factory: pytest.TempPathFactory) -> schemathesis.BaseSchema:
    path: Path = tmp_path_factory.mktemp("fuzz") / "runs.duckdb"
    with tracedb.connect(path) as db:
        db.ingest(FIXTURES)
        db.create_credit_set("probe")
    # schemathesis sends Host: testserver; the host check itself is tested in tests/api/test_hardening.py.
    # A long-poll (GET /traces?wait=) waits at most 0.1 s here: the waits are tested in tests/api/test_live_api.py.
    app = create_app(
        path, token=TOKEN, allow_sql=True, sql_timeout_s=1.0, allowed_hosts=["testserver"], max_wait_s=0.1
    )  # 413: elsewhere
    return schemathesis.openapi.from_asgi("/openapi.json", app)


def test_every_operation_is_fuzzed(api_schema: schemathesis.BaseSchema) -> None:
    found = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert found == set(OPERATIONS)


CASES = [(m, p, mode) for m, p in OPERATIONS for mode in GenerationMode if (m, p) not in NO_INPUT or mode.is_positive]


@pytest.mark.parametrize(("method", "path", "mode"), CASES)
def test_no_input_breaks_the_api(api_schema: schemathesis.BaseSchema, method: str, path: str, mode) -> None:
    """Every built-in check but positive_data_acceptance, which expects every schema-valid
    input to succeed: a well-formed but unknown cursor, a misaligned advantages list or
    bad SQL are schema-valid and rightly refused (422 / 400) with a JSON error."""
    operation = api_schema[path][method]
    # Writes get the token in positive mode; negative mode may drop the Authorization
    # header on purpose and expects the refusal (401), so it is left alone there.
    auth = {"Authorization": f"Bearer {TOKEN}"} if method in ("POST", "PUT") and mode.is_positive else None

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=int(os.environ.get("TRACEDB_FUZZ_EXAMPLES", "60")),  # more, and random: TRACEDB_FUZZ_EXAMPLES=500
        deadline=None,
        suppress_health_check=list(HealthCheck),
        derandomize="TRACEDB_FUZZ_EXAMPLES" not in os.environ,
    )
    def run(case: schemathesis.Case) -> None:
        if not mode.is_positive and path in ("/traces", "/branches", "/micro-batches"):
            query = case.query or {}
            wire = [query[name] for name in STRING_LISTS if name in query]
            assume(all(isinstance(v, list) and all(isinstance(x, str) for x in v) for v in wire))
        if not mode.is_positive and path.endswith("/runs/compare"):
            # `runs` is one string and `run` a list of strings on the wire whatever was
            # generated: only their lengths can be invalid there.
            query = case.query or {}
            assume("runs" not in query or isinstance(query["runs"], str))
            run_names = query.get("run", [])
            assume(isinstance(run_names, list) and all(isinstance(x, str) for x in run_names))
        response = case.call_and_validate(headers=auth, excluded_checks=[positive_data_acceptance])
        assert response.status_code < 500, response.text

    run()
