"""Read-only SQL, only on servers started with --allow-sql."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..deps import BackendDep, SqlAuthorized
from ..errors import JSONBody, responses
from ..models import SqlQuery, SqlResult
from ..security import MAX_BODY

router = APIRouter(tags=["sql"], default_response_class=JSONBody)


SQL_BODY_BYTES = 1 << 20
"""The most body ``POST /sql`` takes: a query's text, not a file."""


@router.post(
    "/sql",
    response_model=SqlResult,
    dependencies=[SqlAuthorized],
    responses=responses(400, 401, 403, 413, 422),
    openapi_extra={MAX_BODY: SQL_BODY_BYTES},
)
def run_sql(backend: BackendDep, query: SqlQuery) -> Any:
    """One SELECT (tracedb's macros available), rows and bytes capped, time-limited; anything else is refused."""
    return JSONBody(backend.read_sql(query.sql, query.limit))
