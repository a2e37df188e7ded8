"""Liveness and what the server allows."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

import tracedb

from ..deps import Reader
from ..errors import JSONBody
from ..models import Health

router = APIRouter(tags=["health"], default_response_class=JSONBody)


@router.get("/health", response_model=Health)
def health(request: Request, db: Reader) -> Any:
    """The server is up and reads its database."""
    state = request.app.state
    return JSONBody(
        {
            "status": "ok",
            "tracedb_version": tracedb.__version__,
            "schema_version": db.schema_version,
            "database": db.path,
            "traces": db.handle.scalar("SELECT count(*) FROM traces"),
            "writes_enabled": state.token is not None and not state.backend.read_only,
            "sql_enabled": state.backend.allow_sql,
        }
    )
