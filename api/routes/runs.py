"""Runs side by side: the runs the server was started with (``tracedb serve --db a --db
name=b``), named in the query, never by path."""

from __future__ import annotations

from contextlib import ExitStack
from importlib import resources
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import HTMLResponse
from fastapi.templating import Jinja2Templates

from .. import runcompare
from ..deps import Reader
from ..errors import JSONBody, responses

router = APIRouter(tags=["runs"])
templates = Jinja2Templates(directory=resources.files("tracedb.api").joinpath("templates"))

RunsQuery = Annotated[
    str | None,
    Query(
        max_length=1000,
        description="Run names, comma-separated (as the server lists them at GET /runs; default: all). "
        "Names only: the server was given the files when it started.",
    ),
]


@router.get("/runs", response_class=JSONBody)
def run_names(request: Request) -> Any:
    """The runs this server compares: their names, the server's own first."""
    runs = request.app.state.runs
    return JSONBody({"primary": runs.primary, "runs": runs.names})


RunQuery = Annotated[
    list[str] | None,
    Query(max_length=64, description="A run name; repeatable (what the page's form sends), beside `runs`."),
]


def _compared(request: Request, db: Any, runs: str | None, run: list[str] | None) -> dict[str, Any]:
    state = request.app.state.runs
    names = state.chosen(runs, run)
    with ExitStack() as stack:
        named = {name: stack.enter_context(state.open(name, db)) for name in names}
        return runcompare.compare(named)


@router.get("/api/runs/compare", response_class=JSONBody, responses=responses(404, 409, 422))
def compare_json(request: Request, db: Reader, runs: RunsQuery = None, run: RunQuery = None) -> Any:
    """Per run: traces, groups, reward mean, zero-variance share, dropped share, staleness,
    tokens per trace; per step (or part of the ingest sequence): each run's reward mean,
    zero-variance share and tokens per trace."""
    return JSONBody(_compared(request, db, runs, run))


@router.get(
    "/runs/compare",
    response_class=HTMLResponse,
    responses={
        200: {"content": {"text/html": {}}, "description": "An HTML page."},
        **responses(404, 409, 422, html=True),
    },
)
def compare_page(request: Request, db: Reader, runs: RunsQuery = None, run: RunQuery = None) -> Any:
    """The runs side by side: their headline figures, then per step each run's reward,
    zero-variance share and tokens per trace."""
    data = _compared(request, db, runs, run)
    return templates.TemplateResponse(
        request,
        "runs_compare.html",
        {"data": data, "names": [r["name"] for r in data["runs"]], "all_runs": request.app.state.runs.names},
    )
