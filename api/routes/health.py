"""Liveness, what the server allows, and the follower of a live run."""

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
    """The server is up and reads its database; on a server that follows a run, how its
    follower is doing (a failing follower is reported here, the server goes on)."""
    state = request.app.state
    follower = state.backend.follower
    return JSONBody(
        {
            "status": "ok",
            "tracedb_version": tracedb.__version__,
            "schema_version": db.schema_version,
            "database": db.path,
            "traces": db.scalar("SELECT count(*) FROM traces"),
            "watermark": db.watermark(),
            "writes_enabled": state.token is not None and not state.backend.read_only,
            "sql_enabled": state.backend.allow_sql,
            "follower": None if follower is None else follower.status(),
        }
    )
