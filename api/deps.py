"""Checks shared by routes, as FastAPI dependencies: the database, auth, credit sets."""

from __future__ import annotations

import secrets
from typing import Annotated, Any

from fastapi import Depends, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from tracedb.credit_sets import DEFAULT_SET
from tracedb.database import Database

from . import queries
from .backend import Backend
from .errors import ApiError


def backend(request: Request) -> Backend:
    return request.app.state.backend


async def reader(request: Request) -> Database:
    """The read handle; the thread that runs the route reads on its own cursor."""
    return request.app.state.backend.db


_bearer = HTTPBearer(auto_error=False, description="Writes need `Authorization: Bearer <token>`.")


def require_token(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """For writes: 401 without a bearer token, 403 with a wrong one, when the server has
    none, or when it opened its file read-only (``read_only=True`` beside a token)."""
    problem = write_problem(request.app.state, request.headers.get("authorization"))
    if problem is not None:
        raise problem


def write_problem(state: Any, authorization: str | None) -> ApiError | None:
    """Why a write with this ``Authorization`` header is refused on the app whose
    ``state`` this is, or None. Also the body gate's check (:mod:`.security`), which asks
    it before a byte of the body is read."""
    problem = bearer_problem(state, authorization)
    if problem is not None:
        return problem
    backend: Backend = state.backend
    if backend.read_only:
        return ApiError(403, "read_only", f"this server opened {backend.path} read-only: writes are refused")
    return None


def bearer_problem(state: Any, authorization: str | None) -> ApiError | None:
    """401 without a bearer token, 403 with a wrong one or when the server has none
    (None: the token is right)."""
    expected: str | None = state.token
    if expected is None:
        return ApiError(403, "writes_disabled", "writes are disabled: start the server with --token or TRACEDB_TOKEN")
    scheme, _, given = (authorization or "").strip().partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        return ApiError(
            401, "unauthorized", "this write needs Authorization: Bearer <token>", {"WWW-Authenticate": "Bearer"}
        )
    if not secrets.compare_digest(given.strip().encode(), expected.encode()):
        return ApiError(403, "forbidden", "wrong bearer token")
    return None


def sql_problem(state: Any, authorization: str | None) -> ApiError | None:
    """The bearer token's check for ``/sql`` on a server started with ``--sql-needs-token``."""
    return bearer_problem(state, authorization) if state.sql_needs_token else None


def require_token_for_sql(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """The bearer token for ``/sql`` too, on a server started with ``--sql-needs-token``."""
    problem = sql_problem(request.app.state, request.headers.get("authorization"))
    if problem is not None:
        raise problem


Reader = Annotated[Database, Depends(reader)]
BackendDep = Annotated[Backend, Depends(backend)]
Authorized = Depends(require_token)
SqlAuthorized = Depends(require_token_for_sql)

CreditQuery = Annotated[
    str | None,
    Query(
        description="Credit set to read advantages from (default: the set ingested with the records).",
        max_length=200,
    ),
]


def credit_of(db: Database, credit: str | None) -> tuple[str | None, str]:
    """(library argument, display name) of a credit set; 404 if unknown."""
    name = queries.credit_name(db, credit)
    return name, name or DEFAULT_SET
