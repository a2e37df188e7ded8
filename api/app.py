"""The FastAPI app: ``create_app(db_path, ...)`` wires the routers, checks and limits."""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

import tracedb

from . import errors, runsets, security
from .backend import Backend
from .routes import branches, groups, health, live, sql, traces, viewer, writes
from .routes import runs as runs_routes

MAX_BODY_BYTES = 256 * 1024 * 1024


def load_tokenizer(tokenizer: Any) -> Any:
    """A ``tokenizers.Tokenizer`` from a local tokenizer.json path (never a hub download)."""
    if tokenizer is None or not isinstance(tokenizer, str | Path):
        return tokenizer
    from tokenizers import Tokenizer

    path = Path(tokenizer)
    if not path.is_file():
        raise FileNotFoundError(f"tokenizer file not found: {path}")
    return Tokenizer.from_file(str(path))


def create_app(
    db_path: str | Path,
    *,
    token: str | None = None,
    allow_sql: bool = False,
    tokenizer: Any = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    sql_row_limit: int = 1000,
    sql_timeout_s: float = 5.0,
    sql_max_bytes: int = 4 * 1024 * 1024,
    sql_needs_token: bool = False,
    view_cache_tokens: int = 8_000_000,
    allowed_hosts: Iterable[str] | None = None,
    read_only: bool | None = None,
    branch_token_limit: int = 4_000_000,
    branch_row_limit: int = 10_000,
    max_wait_s: float = 60.0,
    follow: Sequence[str | Path] | None = None,
    follow_interval: float = 0.25,
    follow_settle: float = 2.0,
    follow_tags: Iterable[str] = (),
    follow_allow_ragged: bool = False,
    follow_rotated: Iterable[str] = (),
    name: str | None = None,
    runs: Mapping[str, str | Path] | None = None,
) -> FastAPI:
    """The REST service and web viewer over the tracedb database at ``db_path``.

    ``token`` enables writes (bearer auth; without one every write is refused, 403).
    ``allow_sql`` enables ``POST /sql`` (one read-only SELECT, at most ``sql_row_limit``
    rows and ``sql_max_bytes`` of rows, within ``sql_timeout_s`` seconds, answering
    included); ``sql_needs_token`` puts it behind the bearer token too. ``tokenizer`` is
    a local Hugging Face ``tokenizer.json`` path (or a loaded ``tokenizers.Tokenizer``)
    for the viewer's decoded tokens.
    Bodies over ``max_body_bytes`` are refused with 413, a body on a route that takes
    none with 400, and none is read before the route's token check
    (:class:`.security.BodyGate`). Branch views of recently asked traces are kept up to
    ``view_cache_tokens`` tokens (0: no cache) until the next write. Only requests whose
    Host is one of ``allowed_hosts`` are served (default: the loopback names; ``"*"``
    any). ``read_only`` opens the file read-only (default: when there is no ``token``
    and nothing to follow, so other processes can read the file beside the server).
    ``GET /branches`` answers at most ``branch_token_limit`` view tokens and
    ``branch_row_limit`` branches (whole traces, saying so when it stops there; the
    second bounds branches that hold few tokens or none), and a trace's branch list
    (``GET /traces/{id}/branches``) at most ``branch_row_limit`` branches a page;
    a long-poll waits at most ``max_wait_s`` seconds.

    ``follow`` (files and directories of a run being written) makes the server the
    file's owner: it opens it read-write (writes over REST still need the ``token``) and
    ingests the paths as ``tracedb ingest --follow`` does (``follow_interval``,
    ``follow_settle``, ``follow_tags``, ``follow_allow_ragged``, ``follow_rotated``: the
    glob patterns of rotated copies, ``--rotated``) in a background thread
    on a cursor of its own; ``/health`` shows how it is doing, and a failure there is
    reported, never fatal to the server.
    ``name`` is the run's name (default: the file's stem) and ``runs`` other runs (name ->
    database file) that ``/runs/compare`` shows beside it, each opened read-only for the
    request that reads it; requests name runs, never files.
    Each server thread reads on its own cursor. The database is opened now and
    stays open for the app's life (test clients may run the lifespan once per request);
    ``app.state.backend.close()`` closes it, as ``tracedb serve`` does when uvicorn
    returns.
    """
    if token is not None and not token:
        raise ValueError("an empty token would let anyone write; pass None to disable writes")
    if sql_needs_token and token is None:
        raise ValueError("sql_needs_token needs a token")
    run_set = runsets.Runs(name or runsets.default_name(db_path), Path(db_path), runs)
    backend = Backend(
        db_path,
        allow_sql=allow_sql,
        sql_row_limit=sql_row_limit,
        sql_timeout_s=sql_timeout_s,
        sql_max_bytes=sql_max_bytes,
        tokenizer=load_tokenizer(tokenizer),
        view_cache_tokens=view_cache_tokens,
        read_only=(token is None and not follow) if read_only is None else read_only,
        branch_token_limit=branch_token_limit,
        branch_row_limit=branch_row_limit,
        max_wait_s=max_wait_s,
        follow=follow,
        follow_interval=follow_interval,
        follow_settle=follow_settle,
        follow_tags=follow_tags,
        follow_allow_ragged=follow_allow_ragged,
        follow_rotated=follow_rotated,
    )

    app = FastAPI(
        title="tracedb",
        version=tracedb.__version__,
        description="Branch lookup (JSON or Arrow IPC), trace listing, authenticated writes and a trace viewer "
        "over a tracedb database of verifiers v1 rollouts.",
        docs_url=None,  # Swagger UI and ReDoc load from a CDN; the schema is at /openapi.json
        redoc_url=None,
    )
    app.state.backend = backend
    app.state.runs = run_set
    app.state.token = token
    app.state.sql_needs_token = sql_needs_token
    errors.install(app)
    modules = (health, traces, branches, live, groups, writes, sql, viewer, runs_routes)
    routes = [route for module in modules for route in module.router.routes]  # the gate's: each route's body rules
    app.add_middleware(security.BodyGate, routes=routes, state=app.state, max_bytes=max_body_bytes)
    app.add_middleware(security.HostCheck, allowed=list(allowed_hosts or security.LOOPBACK_HOSTS))
    app.add_middleware(security.SecurityHeaders)
    for module in modules:
        app.include_router(module.router)
    app.mount("/static", StaticFiles(directory=resources.files("tracedb.api").joinpath("static")), name="static")
    return app
