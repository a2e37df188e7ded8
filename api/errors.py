"""Errors as JSON, the same shape everywhere, and the checks that run before any route.

Policy (tracedb's, carried to HTTP): bad input is answered with a 4xx whose body says
what was wrong - ``{"error": code, "detail": message}`` - and never with a 500; a
rejected write changes nothing. Library errors map onto statuses here, in one place:
an unknown trace, branch, node, group or credit set is 404, input the library refuses
(misaligned or non-finite values, a bad record under ``strict``) is 422.
"""

from __future__ import annotations

import json
import logging
import math
from typing import Any

import numpy as np
import orjson
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from tracedb.errors import IngestAborted, NotFound, RecordError, TraceDBError

log = logging.getLogger("tracedb.api")

SECURITY_HEADERS = [
    (b"x-content-type-options", b"nosniff"),
    (b"x-frame-options", b"DENY"),
    (b"referrer-policy", b"no-referrer"),
]
"""On every response (see :mod:`.security`); here because errors sent outside the
middleware stack (500s) need them too."""


class JSONBody(JSONResponse):
    """JSON via orjson: numpy arrays natively, float32 at its shortest round-trip
    decimal, NaN and infinity as null (JSON has neither)."""

    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return dumps(content)


def dumps(content: Any) -> bytes:
    """JSON bytes; integers past 64 bits (which orjson refuses) go through the stdlib."""
    try:
        return orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY | orjson.OPT_NON_STR_KEYS, default=str)
    except TypeError:
        return json.dumps(_plain(content), default=str, separators=(",", ":")).encode()


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    if isinstance(value, np.ndarray):
        return _plain(value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class ErrorBody(BaseModel):
    """Every error response."""

    error: str = Field(description="Short machine-readable code, e.g. not_found, invalid_request.")
    detail: str = Field(description="What was wrong, for a person.")
    errors: list[dict[str, Any]] | None = Field(
        default=None, description="For invalid_request: each offending parameter (loc, msg, type)."
    )


class ApiError(Exception):
    """Raised by routes and dependencies; becomes ``status`` with an :class:`ErrorBody`."""

    def __init__(self, status: int, error: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status, self.error, self.detail, self.headers = status, error, detail, headers


def not_found(detail: str) -> ApiError:
    return ApiError(404, "not_found", detail)


def invalid(detail: str) -> ApiError:
    return ApiError(422, "invalid_request", detail)


def responses(*statuses: int, html: bool = False) -> dict[int | str, dict[str, Any]]:
    """OpenAPI entries for the error statuses a route can answer with (always JSON, even
    on HTML pages: ``html=True`` keeps FastAPI from filing them under text/html)."""
    text = {
        400: "Bad SQL, a query that ran past the time limit, or a body that is not JSON",
        401: "No bearer token",
        403: "Wrong token, writes not enabled, or SQL not enabled / not a read",
        404: "Unknown trace, branch, node, group, credit set or run",
        409: "A run named at server start cannot be read now (its file is gone, held or not a database)",
        413: "Request body larger than the server's limit",
        422: "Malformed parameters or body, or values the library refuses",
    }
    if html:
        ref = {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
        return {s: {"description": text[s], "content": {"application/json": ref}} for s in statuses}
    return {s: {"model": ErrorBody, "description": text[s]} for s in statuses}


def _body(status: int, error: str, detail: str, errors: list[dict[str, Any]] | None = None, **kw: Any) -> JSONBody:
    content: dict[str, Any] = {"error": error, "detail": detail}
    if errors is not None:
        content["errors"] = errors
    return JSONBody(content, status_code=status, **kw)


_HTTP_CODES = {401: "unauthorized", 403: "forbidden", 404: "not_found", 405: "method_not_allowed", 413: "too_large"}


def install(app: FastAPI) -> None:
    """Register the exception handlers that turn every failure into an ErrorBody."""

    @app.exception_handler(ApiError)
    async def _api(_: Request, exc: ApiError) -> Response:
        return _body(exc.status, exc.error, exc.detail, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> Response:
        errors = [
            {"loc": [str(x) for x in e.get("loc", ())], "msg": str(e.get("msg", "")), "type": str(e.get("type", ""))}
            for e in exc.errors()
        ]
        detail = "; ".join(f"{'.'.join(e['loc'])}: {e['msg']}" for e in errors) or "invalid request"
        return _body(422, "invalid_request", detail, errors)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> Response:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return _body(exc.status_code, code, str(exc.detail), headers=getattr(exc, "headers", None))

    @app.exception_handler(NotFound)
    async def _not_found(_: Request, exc: NotFound) -> Response:
        return _body(404, "not_found", str(exc))

    @app.exception_handler(IngestAborted)
    @app.exception_handler(RecordError)
    async def _record(_: Request, exc: TraceDBError) -> Response:
        return _body(422, "rejected", str(exc))

    @app.exception_handler(TraceDBError)
    async def _refused(_: Request, exc: TraceDBError) -> Response:
        return _body(422, "refused", str(exc))

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> Response:  # a bug: still JSON, and logged
        log.exception("unhandled error", exc_info=exc)
        # Sent by Starlette's outermost middleware, outside SecurityHeaders: they go on here.
        headers = {k.decode(): v.decode() for k, v in SECURITY_HEADERS}
        return _body(500, "internal_error", f"{type(exc).__name__}: {exc}", headers=headers)
