"""Traces: the paginated listing (or, for a live run, what arrived since a watermark,
long-polled), one trace's metadata and nodes, its record as ingested."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Path, Query
from pydantic import Field
from starlette.concurrency import run_in_threadpool

from .. import queries
from ..deps import BackendDep, CreditQuery, Reader, credit_of
from ..errors import JSONBody, invalid, responses
from ..models import LiveTracePage, TraceDetail, TracePage
from .live import Ids, LiveSelection

router = APIRouter(tags=["traces"], default_response_class=JSONBody)

TraceId = Annotated[str, Path(description="The trace's id (verifiers Trace.id).", max_length=500)]
WATERMARK_HEADER = "X-Tracedb-Watermark"


@router.get("/traces", response_model=TracePage | LiveTracePage, responses=responses(422))
async def list_traces(
    db: Reader,
    backend: BackendDep,
    live: LiveSelection,
    trace_id: Ids = None,
    group: Ids = None,
    episode: Ids = None,
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
    limit: Annotated[
        int | None, Query(ge=1, le=1000, description="Traces per answer (default 50; a live listing 1000).")
    ] = None,
    wait: Annotated[
        float | None,
        Query(
            ge=0,
            le=60,
            allow_inf_nan=False,
            description="Live: when nothing past `after` matches yet, wait up to this many seconds for it.",
        ),
    ] = None,
) -> Any:
    """Traces with their episode, group, reward, sizes and stop condition, a page at a time.

    For a live run (any of ``after``, ``complete_groups``, ``through``, ``tag``, ``wait``):
    the traces in arrival order with the ``watermark`` to pass as ``after`` next time (also
    in the X-Tracedb-Watermark header); ``wait=S`` answers as soon as a matching trace is
    committed, or after S seconds with none."""
    if not live.is_live and wait is None:
        page = await run_in_threadpool(
            queries.list_traces,
            db,
            trace_ids=trace_id,
            group=group,
            episode=episode,
            ok=ok,
            min_reward=min_reward,
            max_reward=max_reward,
            stop_condition=stop_condition,
            sort=sort,
            cursor=cursor,
            limit=50 if limit is None else limit,
        )
        return JSONBody(page)
    for name, value in (
        ("ok", ok),
        ("min_reward", min_reward),
        ("max_reward", max_reward),
        ("stop_condition", stop_condition),
        ("cursor", cursor),
        ("sort", None if sort == "trace_id" else sort),
    ):
        if value is not None:
            raise invalid(
                f"{name}: not with after, complete_groups, through, tag or wait (a live listing is in arrival order)"
            )
    limit = 1000 if limit is None else limit
    loop = asyncio.get_running_loop()
    deadline = loop.time() + min(wait or 0.0, backend.max_wait_s)
    selection = replace(live, trace_ids=trace_id, group=group, episode=episode)
    while True:
        page = await run_in_threadpool(queries.live_traces, db, selection, limit=limit)
        read_at = page.pop("read_at")
        left = deadline - loop.time()
        if page["traces"] or left <= 0 or (live.through is not None and read_at >= live.through):
            break
        if await backend.arrivals.wait(read_at, left) <= read_at:
            break  # nothing was committed in time
    return JSONBody(page, headers={WATERMARK_HEADER: str(page["watermark"])})


@router.get("/traces/{trace_id}", response_model=TraceDetail, responses=responses(404, 422))
def get_trace(
    db: Reader,
    trace_id: TraceId,
    credit: CreditQuery = None,
    tokens: Annotated[bool, Query(description="Include each node's token arrays (full layout).")] = False,
    messages: Annotated[bool, Query(description="Include each node's message.")] = False,
    node: Annotated[
        list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None,
        Query(max_length=1000, description="Only these nodes (repeatable; their index in Trace.nodes)."),
    ] = None,
) -> Any:
    """Metadata and the node list (``node``: only those): role, parent, sampled, sizes,
    which streams each node holds."""
    meta = queries.trace_meta(db, trace_id)
    name, label = credit_of(db, credit)
    nodes = queries.trace_nodes(db, trace_id, name, tokens=tokens, messages=messages, nodes=node)
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
