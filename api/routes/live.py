"""A live run's consumers: the selection parameters every live route shares, one rank's
micro-batches for a trainer (the layout ``tracedb pack`` writes), and the database's stats."""

from __future__ import annotations

import json
from dataclasses import replace
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query
from fastapi.responses import Response
from pydantic import Field, StringConstraints

from tracedb.batches import Replay
from tracedb.selection import Selection

from .. import encode, queries
from ..deps import BackendDep, CreditQuery, Reader, credit_of
from ..errors import JSONBody, dumps, invalid, responses
from ..models import Stats

router = APIRouter(tags=["live"], default_response_class=JSONBody)

MAX_SEQ = 2**62
"""The largest watermark a parameter takes (DuckDB binds 64-bit integers)."""
Text = Annotated[str, StringConstraints(max_length=500)]
Ids = Annotated[list[Text] | None, Query(max_length=10_000)]
BranchIndices = Annotated[
    list[Annotated[int, Field(ge=0, le=2**31 - 1)]] | None,
    Query(max_length=1000, description="Only branches of these indices (repeatable)."),
]


def live_selection(
    after: Annotated[
        int | None, Query(ge=0, le=MAX_SEQ, description="Only traces committed after this watermark.")
    ] = None,
    complete_groups: Annotated[
        int | None,
        Query(
            ge=1,
            le=1_000_000,
            description="Only groups of at least this many members that completed after `after`, each once.",
        ),
    ] = None,
    through: Annotated[
        int | None,
        Query(ge=0, le=MAX_SEQ, description="Read as of this watermark: calls with the same after/through agree."),
    ] = None,
    tag: Annotated[
        list[Annotated[str, StringConstraints(max_length=1000)]] | None,
        Query(
            max_length=50,
            description="An ingest tag filter, name=value (JSON when it reads as JSON: numbers compare as numbers) "
            "or name=low..high (inclusive; an end may be empty). Repeatable.",
        ),
    ] = None,
    policy: Annotated[
        int | None, Query(ge=0, le=2**31 - 1, description="The trainer's policy version V (with max_staleness).")
    ] = None,
    max_staleness: Annotated[
        int | None, Query(ge=0, le=2**31 - 1, description="K: groups older than V-K are stale.")
    ] = None,
    stale: Annotated[Literal["drop", "mask"] | None, Query(description="What a stale group gets.")] = None,
    unknown: Annotated[
        Literal["refuse", "keep", "drop"] | None, Query(description="A trace of unknown policy version under a bound.")
    ] = None,
    include_dropped: Annotated[
        bool | None, Query(description="Dropped traces: true keeps, false leaves out (default: the route's).")
    ] = None,
    include_eval: Annotated[bool | None, Query(description="Traces of eval episodes, as include_dropped.")] = None,
    max_groups: Annotated[
        int | None, Query(ge=1, le=1_000_000, description="At most this many groups, oldest first.")
    ] = None,
) -> Selection:
    """The live-run narrowing of a selection (``after``, ``complete_groups``, ``through``,
    ``tag``), from the query string; a route adds the id filters it takes."""
    return Selection(
        after=after,
        complete_groups=complete_groups,
        through=through,
        tags=queries.tag_filters(tag),
        policy=policy,
        max_staleness=max_staleness,
        stale=stale,
        unknown=unknown,
        include_dropped=include_dropped,
        include_eval=include_eval,
        max_groups=max_groups,
    )


LiveSelection = Annotated[Selection, Depends(live_selection)]

_ARROW = {
    200: {
        "description": "An Arrow IPC stream: `part=tokens`, one record batch per micro-batch (the schema of "
        "rank_R.arrow); `part=samples`, the samples table with its `micro_batch` column (rank_R.samples.arrow). "
        "Headers: X-Tracedb-Report (the plan's report, JSON), X-Tracedb-Watermark, X-Tracedb-Micro-Batches.",
        "content": {encode.ARROW_STREAM: {"schema": {"type": "string", "format": "binary"}}},
    }
}


@router.get("/micro-batches", response_class=Response, responses={**_ARROW, **responses(404, 422)})
def get_micro_batches(
    db: Reader,
    backend: BackendDep,
    live: LiveSelection,
    seq_len: Annotated[int, Query(ge=1, le=1 << 24, description="Tokens per micro-batch, at most.")],
    rank: Annotated[
        int,
        Query(ge=0, le=1023, description="The rank whose micro-batches to answer (required: 0 for one rank)."),
    ],
    ranks: Annotated[int, Query(ge=1, le=1024, description="Data-parallel ranks the plan is balanced over.")] = 1,
    part: Annotated[Literal["tokens", "samples"], Query(description="Which file of the rank.")] = "tokens",
    trace_id: Ids = None,
    group: Ids = None,
    episode: Ids = None,
    all_branches: Annotated[bool, Query(description="Also untrainable branches (compaction attempts).")] = False,
    branch_index: BranchIndices = None,
    credit: CreditQuery = None,
    train_once: Annotated[bool, Query(description="A shared sampled token is in the loss once.")] = True,
    overflow: Annotated[Literal["truncate", "drop", "error"], Query(description="A sample over seq_len.")] = "truncate",
    cost_linear: Annotated[float, Query(ge=0, le=1e12, allow_inf_nan=False)] = 1.0,
    cost_quadratic: Annotated[float, Query(ge=0, le=1e12, allow_inf_nan=False)] = 0.0,
    pad_to_multiple_of: Annotated[int, Query(ge=1, le=4096)] = 1,
    pad_token_id: Annotated[int, Query(ge=-(2**31), le=2**31 - 1)] = 0,
    share_prefixes: Annotated[bool, Query(description="Store a prefix shared in a micro-batch once.")] = False,
    drop_zero_advantages: Annotated[bool, Query(description="Leave out samples whose advantages are all 0.")] = False,
    importance: Annotated[
        Literal["tis"] | None,
        Query(
            description="tis: add importance_weight = min(exp(trainer_logprobs - logprobs), clip) on each loss "
            "token holding both (1.0 elsewhere; the report counts both kinds)."
        ),
    ] = None,
    clip: Annotated[
        float | None,
        Query(gt=0, le=1e12, allow_inf_nan=False, description="The cap on the importance ratio (default 2.0)."),
    ] = None,
    replay: Annotated[
        bool,
        Query(
            description="Replace each zero-variance group by an earlier complete group with signal "
            "(needs complete_groups; see docs/replay.md). No use limit: a server writes no step manifests."
        ),
    ] = False,
    replay_max_staleness: Annotated[
        int | None,
        Query(ge=0, le=2**31 - 1, description="A replayed group is at most K versions behind `policy`."),
    ] = None,
    replay_priority: Annotated[
        Literal["signal", "uniform"] | None, Query(description="signal (mean |A| x reward std) or uniform.")
    ] = None,
    replay_seed: Annotated[
        int | None, Query(ge=0, le=2**63 - 1, description="Seeds the tie-breaking or the sampling (0).")
    ] = None,
) -> Any:
    """One rank's packed micro-batches of a selection (the arguments of ``db.micro_batches``),
    read as of one watermark: every rank (and both parts) of a step asked with the same
    arguments and ``through`` answers from the same plan."""
    if rank >= ranks:
        raise invalid(f"rank: {rank} is not one of the {ranks} ranks (0-{ranks - 1})")
    replaying = replay_of(replay, replay_max_staleness, replay_priority, replay_seed)
    name, _ = credit_of(db, credit)
    pinned = replace(live, trace_ids=trace_id, group=group, episode=episode).pinned(db.watermark())
    arguments: dict[str, Any] = {
        "ranks": ranks,
        **pinned.kwargs(),
        "trainable": None if all_branches else True,
        "branch_index": branch_index,
        "credit": name,
        "train_once": train_once,
        "overflow": overflow,
        "cost": (cost_linear, cost_quadratic),
        "pad_to_multiple_of": pad_to_multiple_of,
        "pad_token_id": pad_token_id,
        "share_prefixes": share_prefixes,
        "drop_zero_advantages": drop_zero_advantages,
        "importance": importance,
        "clip": clip,
    }
    settings = None if replaying is None else replaying.manifest()
    key = (seq_len, json.dumps({**arguments, "replay": settings}, sort_keys=True, default=str), backend.edits)
    try:
        plan = backend.plans.get(key, lambda: db.micro_batches(seq_len, **arguments, replay=replaying))
    except (ValueError, TypeError) as e:  # the library names the argument
        raise invalid(str(e)) from None
    report = plan.report
    headers = {
        "X-Tracedb-Report": dumps(report.to_dict()).decode(),
        "X-Tracedb-Watermark": str(report.watermark),
        "X-Tracedb-Micro-Batches": str(len(plan[rank])),
    }
    table = queries.rank_table(plan, rank, part)
    return Response(encode.to_arrow(table), media_type=encode.ARROW_STREAM, headers=headers)


def replay_of(on: bool, max_staleness: int | None, priority: str | None, seed: int | None) -> Replay | None:
    """The ``Replay`` of the ``replay*`` parameters (None without ``replay=true``); a
    ``replay_*`` parameter without it is a 422 naming it."""
    if not on:
        given = {"replay_max_staleness": max_staleness, "replay_priority": priority, "replay_seed": seed}
        named = [name for name, value in given.items() if value is not None]
        if named:
            raise invalid(f"{named[0]}: goes with replay=true")
        return None
    try:
        return Replay(max_staleness=max_staleness, priority=priority or "signal", seed=seed or 0)
    except ValueError as e:
        raise invalid(str(e)) from None


@router.get("/stats", response_model=Stats)
def get_stats(db: Reader) -> Any:
    """Counts and sizes of the database (``db.stats()``), with the watermark."""
    return JSONBody(db.stats())
