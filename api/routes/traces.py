"""Traces: the paginated listing, one trace's metadata and nodes, its record as ingested."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query

from .. import queries
from ..deps import CreditQuery, Reader, credit_of
from ..errors import JSONBody, responses
from ..models import TraceDetail, TracePage

router = APIRouter(tags=["traces"], default_response_class=JSONBody)

TraceId = Annotated[str, Path(description="The trace's id (verifiers Trace.id).", max_length=500)]


@router.get("/traces", response_model=TracePage, responses=responses(422))
def list_traces(
    db: Reader,
    group: Annotated[str | None, Query(description="Only this group (episode.group.id).", max_length=500)] = None,
    episode: Annotated[str | None, Query(description="Only this episode.", max_length=500)] = None,
    ok: Annotated[bool | None, Query(description="Only traces whose ok flag is this.")] = None,
    min_reward: Annotated[float | None, Query(allow_inf_nan=False, description="reward >= this")] = None,
    max_reward: Annotated[float | None, Query(allow_inf_nan=False, description="reward <= this")] = None,
    stop_condition: Annotated[str | None, Query(max_length=500)] = None,
    sort: Annotated[
        Literal["trace_id", "reward", "-reward"], Query(description="Order; unscored traces come last.")
    ] = "trace_id",
    cursor: Annotated[
        str | None, Query(description="next_cursor of the previous page.", max_length=2000, pattern=r"^[A-Za-z0-9_-]+$")
    ] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> Any:
    """Traces with their episode, group, reward, sizes and stop condition, a page at a time."""
    return queries.list_traces(
        db,
        group=group,
        episode=episode,
        ok=ok,
        min_reward=min_reward,
        max_reward=max_reward,
        stop_condition=stop_condition,
        sort=sort,
        cursor=cursor,
        limit=limit,
    )


@router.get("/traces/{trace_id}", response_model=TraceDetail, responses=responses(404, 422))
def get_trace(
    db: Reader,
    trace_id: TraceId,
    credit: CreditQuery = None,
    tokens: Annotated[bool, Query(description="Include each node's token arrays (full layout).")] = False,
    messages: Annotated[bool, Query(description="Include each node's message.")] = False,
) -> Any:
    """Metadata and the node list: role, parent, sampled, sizes, which streams each node holds."""
    meta = queries.trace_meta(db, trace_id)
    name, label = credit_of(db, credit)
    nodes = queries.trace_nodes(db, trace_id, name, tokens=tokens, messages=messages)
    return JSONBody({**meta, "credit": label, "nodes": nodes})


@router.get(
    "/traces/{trace_id}/record",
    responses={**responses(404, 422), 200: {"description": "The verifiers Trace record, as ingested."}},
    response_model=dict[str, Any],
)
def get_record(db: Reader, trace_id: TraceId, credit: CreditQuery = None) -> Any:
    """The full verifiers record as ingested (with later write-backs; ``credit`` picks the set on the nodes)."""
    name, _ = credit_of(db, credit)
    return JSONBody(db.trace(trace_id, credit=name))
