"""Read-only SQL, only on servers started with --allow-sql."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from ..deps import BackendDep, SqlAuthorized
from ..errors import JSONBody, responses
from ..models import SqlQuery, SqlResult

router = APIRouter(tags=["sql"], default_response_class=JSONBody)


@router.post(
    "/sql", response_model=SqlResult, dependencies=[SqlAuthorized], responses=responses(400, 401, 403, 413, 422)
)
def run_sql(backend: BackendDep, query: SqlQuery) -> Any:
    """One SELECT (tracedb's macros available), rows and bytes capped, time-limited; anything else is refused."""
    return JSONBody(backend.read_sql(query.sql, query.limit))
