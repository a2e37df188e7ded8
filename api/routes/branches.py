"""Branches: a trace's branch list and one branch's token view, as JSON or Arrow IPC."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query
from fastapi.responses import Response

from tracedb.tables import TOKEN_COLUMNS

from .. import encode, queries
from ..deps import Backend_, CreditQuery, Reader, credit_of
from ..errors import JSONBody, responses
from ..models import BranchList, BranchView
from .traces import TraceId

router = APIRouter(tags=["branches"], default_response_class=JSONBody)

TokenField = Literal[TOKEN_COLUMNS]  # type: ignore[valid-type]  # the view's token columns, one list


@router.get("/traces/{trace_id}/branches", response_model=BranchList, responses=responses(404, 422))
def list_branches(db: Reader, trace_id: TraceId, credit: CreditQuery = None) -> Any:
    """Each branch: index, trainable, path, tokens, sampled tokens, whether credit is assigned."""
    name, label = credit_of(db, credit)
    return JSONBody({"trace_id": trace_id, "credit": label, "branches": queries.branch_list(db, trace_id, name)})


@router.get(
    "/traces/{trace_id}/branches/{index}",
    response_model=BranchView,
    responses={
        **responses(404, 422),
        200: {
            "description": "The branch view. JSON by default; an Arrow IPC stream with the schema of "
            "db.branches() for `Accept: application/vnd.apache.arrow.stream` or ?format=arrow.",
            "content": {encode.ARROW_STREAM: {"schema": {"type": "string", "format": "binary"}}},
        },
    },
)
def get_branch(
    db: Reader,
    backend: Backend_,
    trace_id: TraceId,
    index: Annotated[int, Path(ge=0, le=2**31 - 1, description="Branch index (verifiers Branch.index).")],
    credit: CreditQuery = None,
    fields: Annotated[
        list[TokenField] | None,
        Query(description="Token columns to include (repeat the parameter); default all of them."),
    ] = None,
    train_once: Annotated[bool, Query(description="A shared node stays trainable only in its first branch.")] = False,
    format: Annotated[Literal["json", "arrow"] | None, Query(description="Overrides the Accept header.")] = None,
    accept: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Any:
    """One branch's aligned per-token arrays: the fields and null rules of ``db.branches()``."""
    name, _ = credit_of(db, credit)
    views = backend.views.branches(db, trace_id, name, train_once)
    table = queries.pick_branch(db, views, trace_id, index, list(fields) if fields else None)
    if encode.wants_arrow(accept, format):
        return Response(encode.to_arrow(table), media_type=encode.ARROW_STREAM)
    return Response(encode.to_json(table), media_type="application/json")
