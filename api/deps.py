"""Checks shared by routes, as FastAPI dependencies: the database, auth, credit sets."""

from __future__ import annotations

import secrets
from typing import Annotated

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
    _check_bearer(request, credentials)
    backend: Backend = request.app.state.backend
    if backend.read_only:
        raise ApiError(403, "read_only", f"this server opened {backend.path} read-only: writes are refused")


def _check_bearer(request: Request, credentials: HTTPAuthorizationCredentials | None) -> None:
    """401 without a bearer token, 403 with a wrong one or when the server has none."""
    expected: str | None = request.app.state.token
    if expected is None:
        raise ApiError(403, "writes_disabled", "writes are disabled: start the server with --token or TRACEDB_TOKEN")
    if credentials is None or credentials.scheme.lower() != "bearer":
        raise ApiError(
            401, "unauthorized", "this write needs Authorization: Bearer <token>", {"WWW-Authenticate": "Bearer"}
        )
    if not secrets.compare_digest(credentials.credentials.encode(), expected.encode()):
        raise ApiError(403, "forbidden", "wrong bearer token")


def require_token_for_sql(
    request: Request, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> None:
    """The bearer token for ``/sql`` too, on a server started with ``--sql-needs-token``."""
    if request.app.state.sql_needs_token:
        _check_bearer(request, credentials)


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
