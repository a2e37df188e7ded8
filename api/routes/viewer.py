"""The web viewer: server-rendered pages, a little JS for the heat strips and the run
page's plots (drawn by the page itself), no CDN."""

from __future__ import annotations

import math
from importlib import resources
from typing import Annotated, Any, Literal
from urllib.parse import quote, urlencode

from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from tracedb.database import Database

from .. import pages, queries, tracepage, turns
from ..deps import CreditQuery, Reader, credit_of
from ..errors import ApiError, JSONBody, dumps, invalid, not_found, responses
from .traces import TraceId

router = APIRouter(tags=["viewer"], default_response_class=HTMLResponse)
templates = Jinja2Templates(directory=resources.files("tracedb.api").joinpath("templates"))
_HTML = {200: {"content": {"text/html": {}}, "description": "An HTML page."}}


def _optional(name: str, text: str | None, kind: type) -> Any:
    """A form field: empty means unset (HTML forms send every field), else parsed or 422."""
    if text is None or not text.strip():
        return None
    text = text.strip()
    if kind is bool:
        if text.lower() in ("true", "false"):
            return text.lower() == "true"
        raise invalid(f"{name}: expected true or false, got {text!r}")
    try:
        value = float(text)
    except ValueError:
        raise invalid(f"{name}: expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise invalid(f"{name}: expected a finite number, got {text!r}")
    return value


Field = Annotated[str | None, Query(max_length=500)]


@router.get("/", responses={**_HTML, **responses(422, html=True)})
def index(
    request: Request,
    db: Reader,
    group: Field = None,
    episode: Field = None,
    ok: Annotated[str | None, Query(max_length=10, description="true, false or empty (any).")] = None,
    min_reward: Annotated[str | None, Query(max_length=50, description="A number, or empty.")] = None,
    max_reward: Annotated[str | None, Query(max_length=50, description="A number, or empty.")] = None,
    stop_condition: Field = None,
    sort: Annotated[Literal["trace_id", "reward", "-reward"], Query()] = "trace_id",
    cursor: Annotated[str | None, Query(max_length=2000, pattern=r"^[A-Za-z0-9_-]+$")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
) -> Any:
    """The traces, filterable, sortable by reward, a page at a time."""
    filters = {
        "group": group or None,
        "episode": episode or None,
        "ok": _optional("ok", ok, bool),
        "min_reward": _optional("min_reward", min_reward, float),
        "max_reward": _optional("max_reward", max_reward, float),
        "stop_condition": stop_condition or None,
    }
    page = queries.list_traces(db, **filters, sort=sort, cursor=cursor, limit=limit)
    kept = {k: ("true" if v is True else "false" if v is False else v) for k, v in filters.items() if v is not None}

    def link(**changes: Any) -> str:
        params = {**kept, "sort": sort, "limit": limit, **changes}
        return "/?" + urlencode({k: v for k, v in params.items() if v is not None})

    stops = [r[0] for r in db.con.execute("SELECT DISTINCT stop_condition FROM traces ORDER BY 1").fetchall() if r[0]]
    return templates.TemplateResponse(
        request,
        "index.html",
        {
            "page": page,
            "filters": filters,
            "sort": sort,
            "stops": stops,
            "total": db.scalar("SELECT count(*) FROM traces"),
            "link": link,
            "next_link": link(cursor=page["next_cursor"]) if page["next_cursor"] else None,
        },
    )


def _pieces(tokenizer: Any, ids: Any) -> list[str]:
    """Each token decoded on its own (a piece of a multi-byte character shows as U+FFFD)."""
    ids = [int(i) for i in ids]
    pieces = tokenizer.decode_batch([[i] for i in ids], skip_special_tokens=False)
    return [p if p else (tokenizer.id_to_token(i) or f"<{i}>") for i, p in zip(ids, pieces)]


@router.get("/view/{trace_id}", responses={**_HTML, **responses(404, 422, html=True)})
def view(
    request: Request,
    db: Reader,
    trace_id: TraceId,
    credit: CreditQuery = None,
    color: Annotated[Literal["advantage", "logprob"], Query(description="Colour the strips by this.")] = "advantage",
    compare: Annotated[
        str | None,
        Query(
            max_length=200,
            description="Another credit set: the page shows the trace's sampled nodes in both sets side by "
            "side, with their difference (credit minus compare).",
        ),
    ] = None,
    branches_from: Annotated[
        int | None,
        Query(ge=0, le=2**31 - 1, description="The page's first branch (by index); default: the page of `branch`."),
    ] = None,
    branch_limit: Annotated[
        int, Query(ge=1, le=tracepage.MAX_BRANCHES, description="Branches a page shows.")
    ] = tracepage.BRANCHES,
    nodes_from: Annotated[
        int, Query(ge=0, le=2**31 - 1, description="The first of the page's nodes shown (the page shows at most 200).")
    ] = 0,
    branch: Annotated[
        int | None, Query(ge=0, le=2**31 - 1, description="Show only this branch's nodes (its page opens).")
    ] = None,
    sampled: Annotated[
        bool, Query(description="Only the sampled nodes (the model's turns): no prompts, no tool results.")
    ] = False,
) -> Any:
    """One trace: a summary of its turns' advantages, then its message graph as branches, a
    page of branches at a time, each node's tokens as a heat strip (``sampled``: the sampled
    nodes only); with ``compare``, its credit in two sets and their difference (a page of
    sampled nodes at a time)."""
    meta = queries.trace_meta(db, trace_id)
    name, label = credit_of(db, credit)
    if compare is not None:
        return _compare_page(request, db, meta, (name, label), credit_of(db, compare), color, nodes_from)
    start = tracepage.page_from(branch, branches_from, branch_limit)
    keep = turns.sampled_nodes(db, trace_id) if sampled else None
    page = tracepage.trace_page(
        db, trace_id, name, branches_from=start, branch_limit=branch_limit, nodes_from=nodes_from, only=keep
    )
    summary = turns.turn_summary(db, trace_id, name)
    shown = {n["node_index"] for n in page["nodes"]}
    for turn in summary["turns"]:
        turn["on_page"] = turn["node_index"] in shown
    tokenizer = request.app.state.backend.tokenizer
    if tokenizer is not None:
        for strip in page["strips"]:
            strip["pieces"] = _pieces(tokenizer, strip["token_ids"])
    window = page["window"]
    kept = {"credit": label, "color": color, "branch_limit": branch_limit, "sampled": "true" if sampled else None}

    def link(**changes: Any) -> str:
        params = {**kept, "branches_from": start, **changes}
        return f"/view/{quote(trace_id, safe='')}?" + urlencode({k: v for k, v in params.items() if v is not None})

    def at(key: str, value: int | None, **more: Any) -> str | None:
        return None if value is None else link(**{key: value}, **more)

    payload = {
        "trace_id": trace_id,
        "credit": label,
        "color": color,
        "nodes": page["strips"],
        "branches_from": start,
        "branch_limit": branch_limit,
        "turns": summary,
    }
    return templates.TemplateResponse(
        request,
        "view.html",
        {
            "turns": summary,
            "sampled": sampled,
            "show_links": {
                "all": link(sampled=None, nodes_from=None),
                "sampled": link(sampled="true", nodes_from=None),
            },
            "meta": page["meta"],
            "credit": label,
            "color": color,
            "credit_sets": [s["name"] for s in queries.credit_sets(db)],
            "branches": page["branches"],
            "nodes": page["nodes"],
            "window": window,
            "links": {
                "previous": at("branches_from", window["previous_from"]),
                "next": at("branches_from", window["next_from"]),
                "previous_nodes": at("nodes_from", window["previous_nodes"]),
                "next_nodes": at("nodes_from", window["next_nodes"]),
            },
            "tokenizer": tokenizer is not None,
            "payload": _embed(payload),
        },
    )


@router.get("/traces/{trace_id}/turns", response_class=JSONBody, responses=responses(404, 422), tags=["traces"])
def trace_turns(
    db: Reader,
    trace_id: TraceId,
    credit: CreditQuery = None,
    turns_from: Annotated[int, Query(ge=0, le=2**31 - 1, description="The first turn listed (0-based).")] = 0,
    limit: Annotated[int, Query(ge=1, le=turns.TURNS, description="Turns listed at most.")] = turns.TURNS,
) -> Any:
    """The trace's turns (its sampled nodes, in node order), each with its advantages' mean,
    min, max and sum in the credit set (null when the set leaves it unassigned), and the
    trace's totals: what ``/view/{id}``'s turn summary shows."""
    name, _ = credit_of(db, credit)
    return JSONBody(turns.turn_summary(db, trace_id, name, turns_from=turns_from, limit=limit))


def _compare_page(
    request: Request,
    db: Database,
    meta: dict[str, Any],
    a: tuple[str | None, str],
    b: tuple[str | None, str],
    color: str,
    nodes_from: int,
) -> Any:
    """The trace's credit in sets ``a`` and ``b`` ((library name, display name) each), a
    page of its sampled nodes from the ``nodes_from``-th on."""
    diff = pages.credit_diff(db, meta["trace_id"], a[0], b[0], nodes_from=nodes_from)
    tokenizer = request.app.state.backend.tokenizer
    if tokenizer is not None:
        for strip in diff["strips"]:
            strip["pieces"] = _pieces(tokenizer, strip["token_ids"])
    label = f"{a[1]}-{b[1]}"
    payload = {"trace_id": meta["trace_id"], "credit": label, "color": color, "nodes": diff["strips"]}
    window = diff["window"]

    def at(value: int | None) -> str | None:
        if value is None:
            return None
        query = urlencode({"credit": a[1], "compare": b[1], "color": color, "nodes_from": value})
        return f"/view/{quote(meta['trace_id'], safe='')}?{query}"

    return templates.TemplateResponse(
        request,
        "compare.html",
        {
            "meta": meta,
            "a": a[1],
            "b": b[1],
            "color": color,
            "credit_sets": [s["name"] for s in queries.credit_sets(db)],
            "nodes": diff["nodes"],
            "window": window,
            "links": {"previous_nodes": at(window["previous_nodes"]), "next_nodes": at(window["next_nodes"])},
            "tokenizer": tokenizer is not None,
            "payload": _embed(payload),
        },
    )


def _embed(content: Any) -> str:
    """JSON for a ``<script type="application/json">`` block (it cannot close the tag)."""
    return dumps(content).decode().replace("</", "<\\/")


# --------------------------------------------------------------------------- live runs

By = Annotated[
    str,
    Query(
        max_length=200,
        description="The x axis: seq (ingest sequence), work_step (the episodes' training step, run.work.step), "
        "tag:NAME (a numeric ingest tag, e.g. tag:step) or auto (tag:step when traces have it, else work_step "
        "when episodes have it, else seq).",
    ),
]
Bins = Annotated[int, Query(ge=1, le=pages.MAX_BINS, description="Bins over the x axis, at most.")]
MismatchC = Annotated[
    float,
    Query(
        ge=1,
        le=1e6,
        allow_inf_nan=False,
        description="The policy-mismatch band [1/c, c]: the share of ratios exp(trainer_logprobs - logprobs) "
        "outside it is plotted per bin.",
    ),
]


@router.get("/run", responses={**_HTML, **responses(422, html=True)})
def run_page(
    request: Request,
    db: Reader,
    by: By = "auto",
    bins: Bins = 100,
    refresh: Annotated[float, Query(ge=0.25, le=600, description="Seconds between polls.")] = 2.0,
    mismatch_c: MismatchC = 2.0,
) -> Any:
    """The run as it is ingested: reward, its distribution, zero-variance groups, tokens, the
    sampled share and the policy mismatch (where trainer_logprobs were written back) over the
    ingest sequence or a tag, the rejects; redrawn as traces arrive."""
    pages.resolve_axis(by, pages.axes(db, db.watermark()))  # a bad axis is a 422 here, not a blank page
    config = {"by": by, "bins": bins, "max_bins": pages.MAX_BINS, "refresh_s": refresh, "mismatch_c": mismatch_c}
    return templates.TemplateResponse(request, "run.html", {"config": _embed(config), **config})


@router.get("/api/run", response_class=JSONBody, responses=responses(422), tags=["runs"])
def run_json(
    db: Reader,
    by: By = "auto",
    bins: Bins = 100,
    after: Annotated[
        int | None,
        Query(
            ge=0,
            description="The watermark of your last answer: if nothing arrived since, only the "
            "watermark and the rejects come back (changed false).",
        ),
    ] = None,
    recent: Annotated[
        int, Query(ge=0, le=10_000_000, description="The reward histogram's window: the latest traces (0: all).")
    ] = 1000,
    hist_bins: Annotated[int, Query(ge=1, le=pages.MAX_HIST_BINS, description="Bins of the reward histogram.")] = 20,
    mismatch_c: MismatchC = 2.0,
) -> Any:
    """The run page's data, aggregated in the database as of one watermark: headline numbers,
    per-bin reward (mean, std, p10, p90), zero-variance groups, tokens, sampled share, the
    policy mismatch (k3, the ratios, the share outside [1/c, c]), the reward histogram, the
    rejects and the latest groups."""
    data = pages.run_data(db, by=by, bins=bins, after=after, recent=recent, hist_bins=hist_bins, mismatch_c=mismatch_c)
    return JSONBody(data)


@router.get("/view/group/{group_id}", responses={**_HTML, **responses(404, 422, html=True)})
def group_page(
    request: Request,
    db: Reader,
    group_id: Annotated[str, Path(max_length=500)],
    credit: CreditQuery = None,
    color: Annotated[Literal["advantage", "logprob"], Query(description="Colour the strips by this.")] = "advantage",
    compare: Annotated[
        str | None,
        Query(
            max_length=200,
            description="Another credit set (empty: none): the page adds the dose-matched comparison of "
            "credit and compare over the group's traces, and links each member's trace compare view.",
        ),
    ] = None,
) -> Any:
    """A group's members side by side: reward, credit status per credit set, a heat strip
    of each member's branches; with ``compare``, the two sets' dose per set and agreement
    over the group's traces (``tracedb.credit.dose.compare``)."""
    name, label = _credit_set(db, "credit", credit)
    other = _credit_set(db, "compare", compare)[1] if compare and compare.strip() else None
    group = pages.group_page(db, group_id, name)
    strips = group.pop("strips")
    tokenizer = request.app.state.backend.tokenizer
    if tokenizer is not None:
        for strip in strips:
            strip["pieces"] = _pieces(tokenizer, strip["token_ids"])
    figures = pages.group_compare(db, group_id, label, other) if other is not None else None
    payload = {"group_id": group_id, "credit": label, "color": color, "nodes": strips, "compare": figures}
    return templates.TemplateResponse(
        request,
        "group.html",
        {
            "group": group,
            "credit": label,
            "color": color,
            "compare": other,
            "figures": figures,
            "all_sets": [s["name"] for s in queries.credit_sets(db)],
            "tokenizer": tokenizer is not None,
            "payload": _embed(payload),
        },
    )


def _credit_set(db: Database, parameter: str, name: str | None) -> tuple[str | None, str]:
    """:func:`credit_of`, its 404 naming the query ``parameter``."""
    try:
        return credit_of(db, name)
    except ApiError as e:
        raise not_found(f"{parameter}: {e.detail}") from None
