"""Branches: a trace's branch list and one branch's token view, and the branch views of
a whole selection (a live run's new traces), as JSON or Arrow IPC."""

from __future__ import annotations

from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Header, Path, Query
from fastapi.responses import Response

from tracedb.tables import TOKEN_COLUMNS

from .. import encode, queries
from ..deps import BackendDep, CreditQuery, Reader, credit_of
from ..errors import JSONBody, dumps, not_found, responses
from ..models import BranchList, BranchSelection, BranchView
from .live import BranchIndices, Ids, LiveSelection
from .traces import WATERMARK_HEADER, TraceId

router = APIRouter(tags=["branches"], default_response_class=JSONBody)

TokenField = Literal[TOKEN_COLUMNS]  # type: ignore[valid-type]  # the view's token columns, one list
Fields = Annotated[
    list[TokenField] | None,
    Query(description="Token columns to include (repeat the parameter); default all of them."),
]
Format = Annotated[Literal["json", "arrow"] | None, Query(description="Overrides the Accept header.")]
_VIEW = {
    "description": "JSON by default; an Arrow IPC stream with the schema of db.branches() for "
    "`Accept: application/vnd.apache.arrow.stream` or ?format=arrow.",
    "content": {encode.ARROW_STREAM: {"schema": {"type": "string", "format": "binary"}}},
}


@router.get("/traces/{trace_id}/branches", response_model=BranchList, responses=responses(404, 422))
def list_branches(
    db: Reader,
    backend: BackendDep,
    trace_id: TraceId,
    live: LiveSelection,
    credit: CreditQuery = None,
    branches_from: Annotated[
        int, Query(ge=0, le=2**31 - 1, description="The first branch index listed (next_from of the last page).")
    ] = 0,
    limit: Annotated[
        int | None, Query(ge=1, le=2**31 - 1, description="Branches listed at most (the server's row limit at most).")
    ] = None,
) -> Any:
    """Each branch: index, trainable, path, tokens, sampled tokens, whether credit is assigned;
    a page of at most the server's branch row limit (``next_from`` names the next page).
    With ``after`` (``complete_groups``, ``through``, ``tag``): none when the trace is not in
    that selection."""
    name, label = credit_of(db, credit)
    size = backend.branch_row_limit if limit is None else min(limit, backend.branch_row_limit)
    total = queries.trace_meta(db, trace_id)["n_branches"]
    body: dict[str, Any] = {"trace_id": trace_id, "credit": label, "n_branches": total, "branches_from": branches_from}
    if live.is_live:
        mark = queries.in_selection(db, trace_id, live)
        body["watermark"] = mark if mark is not None else db.watermark()
        if mark is None:
            return JSONBody({**body, "limit": size, "next_from": None, "branches": []})
    rows = queries.branch_list(db, trace_id, name, start=branches_from, limit=size)
    following = rows[-1]["branch_index"] + 1 if rows else None
    more = following is not None and following < total
    return JSONBody({**body, "limit": size, "next_from": following if more else None, "branches": rows})


@router.get(
    "/branches",
    response_model=BranchSelection,
    responses={**responses(404, 422), 200: _VIEW},
)
def select_branches(
    db: Reader,
    backend: BackendDep,
    live: LiveSelection,
    trace_id: Ids = None,
    group: Ids = None,
    episode: Ids = None,
    trainable: Annotated[bool | None, Query(description="Only trainable (true) or untrainable (false) ones.")] = None,
    branch_index: BranchIndices = None,
    credit: CreditQuery = None,
    fields: Fields = None,
    train_once: Annotated[bool, Query(description="A shared node stays trainable only in its first branch.")] = False,
    format: Format = None,
    accept: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Any:
    """The branch views of a selection (``db.branches``'s filters, ``after`` included), whole
    traces in arrival order up to the server's token limit and branch row limit; the
    watermark to pass as ``after`` next time is in the X-Tracedb-Watermark header (and the
    Arrow schema's ``tracedb.watermark`` metadata), X-Tracedb-Truncated says which limit
    was reached (``tokens``, ``branches``; ``no``)."""
    name, _ = credit_of(db, credit)
    table, info = queries.select_branches(
        db,
        replace(live, trace_ids=trace_id, group=group, episode=episode),
        trainable=trainable,
        branch_index=branch_index,
        columns=list(fields) if fields else None,
        train_once=train_once,
        credit=name,
        token_limit=backend.branch_token_limit,
        row_limit=backend.branch_row_limit,
    )
    headers = {
        WATERMARK_HEADER: str(info["watermark"]),
        "X-Tracedb-Tokens": str(info["tokens"]),
        "X-Tracedb-Token-Limit": str(info["token_limit"]),
        "X-Tracedb-Branches": str(info["n_branches"]),
        "X-Tracedb-Branch-Limit": str(info["branch_limit"]),
        "X-Tracedb-Truncated": info["truncated_by"] or "no",
    }
    if encode.wants_arrow(accept, format):
        return Response(encode.to_arrow(table), media_type=encode.ARROW_STREAM, headers=headers)
    head = dumps(info)[:-1]  # the object without its closing brace; the rows follow
    rows = b",".join(encode.json_rows(table))
    return Response(head + b',"branches":[' + rows + b"]}", media_type="application/json", headers=headers)


@router.get(
    "/traces/{trace_id}/branches/{index}",
    response_model=BranchView,
    responses={**responses(404, 422), 200: _VIEW},
)
def get_branch(
    db: Reader,
    backend: BackendDep,
    trace_id: TraceId,
    index: Annotated[int, Path(ge=0, le=2**31 - 1, description="Branch index (verifiers Branch.index).")],
    live: LiveSelection,
    credit: CreditQuery = None,
    fields: Fields = None,
    train_once: Annotated[bool, Query(description="A shared node stays trainable only in its first branch.")] = False,
    format: Format = None,
    accept: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Any:
    """One branch's aligned per-token arrays: the fields and null rules of ``db.branches()``.
    With ``after`` (``complete_groups``, ``through``, ``tag``): 404 when the trace is not in
    that selection."""
    name, _ = credit_of(db, credit)
    if live.is_live and queries.in_selection(db, trace_id, live) is None:
        raise not_found(f"trace {trace_id!r} is not in the selection (after, complete_groups, through, tag)")
    views = backend.views.branches(db, trace_id, name, train_once)
    table = queries.pick_branch(db, views, trace_id, index, list(fields) if fields else None)
    if encode.wants_arrow(accept, format):
        return Response(encode.to_arrow(table), media_type=encode.ARROW_STREAM)
    return Response(encode.to_json(table), media_type="application/json")
