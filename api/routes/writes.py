"""Writes, all behind the bearer token: ingest a traces.jsonl body, stamp a node's
advantages, register a credit set. Each runs in one transaction under the write lock:
a rejected write changes nothing, and readers keep reading meanwhile."""

from __future__ import annotations

import tempfile
from pathlib import Path as FilePath
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from starlette.concurrency import run_in_threadpool

from tracedb.credit_sets import DEFAULT_SET
from tracedb.errors import InputError

from .. import queries
from ..backend import Backend
from ..deps import Authorized, BackendDep, CreditQuery, Reader, backend
from ..errors import JSONBody, invalid, responses
from ..models import (
    AdvantagesWrite,
    CreditSet,
    CreditSetCreate,
    IngestResult,
    PolicyLabel,
    PolicyVersionsResult,
    PolicyVersionsWrite,
    WriteResult,
)
from .traces import TraceId

router = APIRouter(tags=["writes"], default_response_class=JSONBody)

ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"
_BODY = {
    "description": "A verifiers traces.jsonl file (one Episode per line), plain or zstd-compressed.",
    "required": True,
    "content": {
        "application/x-ndjson": {"schema": {"type": "string", "format": "binary"}},
        "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
    },
}


@router.post(
    "/ingest",
    response_model=IngestResult,
    dependencies=[Authorized],
    responses=responses(401, 403, 413, 422),
    openapi_extra={"requestBody": _BODY},
)
async def ingest(
    request: Request,
    backend: Annotated[Backend, Depends(backend)],
    strict: Annotated[bool, Query(description="Any bad record aborts the ingest (422); nothing is written.")] = False,
    allow_ragged: Annotated[bool, Query(description="Accept compact streams of another length.")] = False,
) -> Any:
    """Ingest a traces.jsonl / .jsonl.zst body; the report lists rejected records and why."""
    with tempfile.TemporaryDirectory(prefix="tracedb-ingest-") as tmp:
        # The body goes to a file as it arrives (held in memory it cost its whole size).
        path = FilePath(tmp) / "request-body"
        blank = True
        with path.open("wb") as out:
            async for chunk in request.stream():
                out.write(chunk)
                blank = blank and not chunk.strip()
        if blank:
            raise invalid("empty body: send traces.jsonl lines (or a .jsonl.zst file)")
        with path.open("rb") as f:
            head = f.read(len(ZSTD_MAGIC))
        named = path.rename(path.with_name(path.name + (".jsonl.zst" if head == ZSTD_MAGIC else ".jsonl")))
        return JSONBody(await run_in_threadpool(_ingest, backend, named, strict, allow_ragged))


def _ingest(backend: Backend, path: FilePath, strict: bool, allow_ragged: bool) -> dict[str, Any]:
    try:
        with backend.writer() as db:
            report = db.ingest(path, strict=strict, allow_ragged=allow_ragged, whole_files=True)
    except InputError as e:  # a body is one unit: nothing of it was written
        raise invalid(f"request body: {e.reason}") from None
    result = report.to_dict()
    for reject in result["rejected"]:
        if reject["file"] == str(path):
            reject["file"] = "request body"
    return result


@router.put(
    "/traces/{trace_id}/nodes/{index}/advantages",
    response_model=WriteResult,
    dependencies=[Authorized],
    responses=responses(400, 401, 403, 404, 413, 422),
)
def put_advantages(
    backend: BackendDep,
    trace_id: TraceId,
    index: Annotated[int, Path(ge=0, le=2**31 - 1, description="Node index (position in Trace.nodes).")],
    body: AdvantagesWrite,
    credit: CreditQuery = None,
) -> Any:
    """Set (or, with null, clear) one node's advantages in a credit set, validated as the library validates."""
    with backend.writer() as db:
        queries.node_exists(db, trace_id, index)
        name = queries.credit_name(db, credit)
        written = db.write_nodes([{"trace_id": trace_id, "node_index": index, "values": body.values}], credit=name)
    return JSONBody(
        {"trace_id": trace_id, "node_index": index, "credit": name or DEFAULT_SET, "nodes_written": written}
    )


@router.get("/credit-sets", response_model=list[CreditSet], tags=["credit"])
def list_credit_sets(db: Reader) -> Any:
    """The credit sets side by side: the ingested 'default' and every named set."""
    return JSONBody(queries.credit_sets(db))


@router.post(
    "/credit-sets",
    response_model=CreditSet,
    status_code=201,
    dependencies=[Authorized],
    responses=responses(400, 401, 403, 413, 422),
    tags=["credit"],
)
def create_credit_set(backend: BackendDep, body: CreditSetCreate) -> Any:
    """Register a named credit set; its advantages are then written with ?credit=NAME."""
    with backend.writer() as db:
        db.create_credit_set(
            body.name, algorithm=body.algorithm, params=body.params, description=body.description, replace=body.replace
        )
        created = next(s for s in queries.credit_sets(db) if s["name"] == body.name)
    return JSONBody(created, status_code=201)


@router.get("/policy-versions", response_model=list[PolicyLabel], tags=["policy"])
def list_policy_versions(db: Reader) -> Any:
    """The weight labels mapped to policy versions (a label such as ``step_12`` names its own)."""
    rows = db.policy_versions().to_pylist()
    for row in rows:
        row["set_at"] = None if row["set_at"] is None else row["set_at"].isoformat()
    return JSONBody(rows)


@router.put(
    "/policy-versions",
    response_model=PolicyVersionsResult,
    dependencies=[Authorized],
    responses=responses(400, 401, 403, 413, 422),
    tags=["policy"],
)
def put_policy_versions(backend: BackendDep, body: PolicyVersionsWrite) -> Any:
    """Map weight labels with no number of their own (a checkpoint name, a hash) to policy
    versions; the traces using them get their policy-version bounds again."""
    with backend.writer() as db:
        updated = db.set_policy_versions(body.versions)
    return JSONBody({"labels": len(body.versions), "traces": updated})
