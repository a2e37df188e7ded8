"""What keeps the API from being abused: only the hosts the server was bound to are
served (a DNS-rebinding page arrives under its own host name); every answer carries
headers that forbid content sniffing and framing, and HTML pages a content security
policy (the viewer needs nothing but its own scripts and styles); and no request body is
read before it is known to be wanted (:class:`BodyGate`)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from . import deps
from .errors import SECURITY_HEADERS as _HEADERS
from .errors import ApiError, dumps

MAX_BODY = "x-tracedb-max-body-bytes"
"""A route's ``openapi_extra`` key: the most body bytes it takes (below the server's limit)."""

LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")
"""The names a server bound to loopback answers to."""

_CSP = (
    b"default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
    b"object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)


def _host(header: bytes) -> str:
    """A Host header's name, without its port, lower-cased; IPv6 without brackets."""
    text = header.decode("latin-1").strip().lower()
    if text.startswith("["):
        return text[1 : text.find("]")] if "]" in text else text
    return text.rsplit(":", 1)[0] if text.count(":") == 1 else text


class HostCheck:
    """ASGI middleware: 400 unless the request's Host is one of ``allowed`` (``*`` allows any)."""

    def __init__(self, app: ASGIApp, allowed: Iterable[str]) -> None:
        self.app = app
        self.allowed = {a.lower().strip("[]") for a in allowed}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or "*" in self.allowed:
            await self.app(scope, receive, send)
            return
        host = dict(scope.get("headers") or []).get(b"host", b"")
        if _host(host) not in self.allowed:
            body = dumps(
                {
                    "error": "bad_host",
                    "detail": f"this server answers to {sorted(self.allowed)}, not {host.decode('latin-1')!r} "
                    "(start it with --allowed-host to add a name)",
                }
            )
            headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({"type": "http.response.start", "status": 400, "headers": headers + _HEADERS})
            await send({"type": "http.response.body", "body": body})
            return
        await self.app(scope, receive, send)


class SecurityHeaders:
    """ASGI middleware: the headers above on every response, the CSP on HTML."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = list(message.get("headers") or [])
                present = {k.lower() for k, _ in headers}
                headers += [(k, v) for k, v in _HEADERS if k not in present]
                content_type = dict(headers).get(b"content-type", b"")
                if content_type.startswith(b"text/html"):
                    headers.append((b"content-security-policy", _CSP))
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, with_headers)


Check = Callable[[Any, "str | None"], "ApiError | None"]
_CHECKS: dict[Any, Check] = {deps.require_token: deps.write_problem, deps.require_token_for_sql: deps.sql_problem}
"""A route's auth dependency -> the same check on the app's state and the Authorization header."""


class BodyGate:
    """ASGI middleware: a request body is read only when a route wants it, from a client
    allowed to send it, and never past its limit; a refusal is sent before any of it is read.

    - A route that takes no body (its OpenAPI declares none: ``GET /health``, the viewer,
      an unknown path, a static file) refuses one (400 ``unexpected_body``): a declared
      ``Content-Length`` at once, a chunked body by its first chunk.
    - A declared ``Content-Length`` over the route's limit (``max_bytes``, or less where the
      route says so: :data:`MAX_BODY`) is 413 at once.
    - A route behind the bearer token (writes; ``/sql`` with ``--sql-needs-token``) checks
      it first: 401 / 403 before a byte is read (FastAPI parses a route's body before its
      dependencies run: a 200 MiB JSON body without a token was parsed, then refused).
    - Otherwise the body is passed on as the route reads it, counted: past the limit the
      request is answered 413 and the route sees the client gone (nothing is buffered
      here; a chunked body used to be read whole, up to the limit, before any route ran).
    """

    def __init__(self, app: ASGIApp, routes: Sequence[BaseRoute], state: Any, max_bytes: int) -> None:
        self.app, self.routes, self.state, self.max_bytes = app, routes, state, max_bytes

    def _route(self, scope: Scope) -> BaseRoute | None:
        for route in self.routes:
            match, _ = route.matches(scope)
            if match == Match.FULL:
                return route
        return None

    def _policy(self, route: BaseRoute | None) -> tuple[bool, int, list[Check]]:
        """(takes a body, its limit, the checks before reading it)."""
        body_field = getattr(route, "body_field", None)
        extra = getattr(route, "openapi_extra", None) or {}
        if body_field is None and "requestBody" not in extra:
            return False, 0, []
        dependant = getattr(route, "dependant", None)
        calls = [d.call for d in (dependant.dependencies if dependant is not None else [])]
        limit = min(self.max_bytes, int(extra.get(MAX_BODY, self.max_bytes)))
        return True, limit, [_CHECKS[c] for c in calls if c in _CHECKS]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        size = None
        if declared is not None:
            try:
                size = int(declared)
            except ValueError:
                await _refuse(send, ApiError(400, "bad_request", "Content-Length is not a number"))
                return
        streamed = b"transfer-encoding" in headers
        takes, limit, checks = self._policy(self._route(scope))
        if not takes:
            if size:
                await _refuse(send, _unexpected(scope))
                return
            if streamed:
                first = await receive()
                if first.get("body") or first.get("more_body"):
                    await _refuse(send, _unexpected(scope))
                    return
                receive = _replay(first, receive)
            await self.app(scope, receive, send)
            return
        if size is not None and size > limit:
            await _refuse(send, _too_large(limit, f"{size} bytes"))
            return
        authorization = headers.get(b"authorization")
        for check in checks:
            problem = check(self.state, None if authorization is None else authorization.decode("latin-1"))
            if problem is not None:
                await _refuse(send, problem)
                return
        await self._counted(scope, receive, send, limit)

    async def _counted(self, scope: Scope, receive: Receive, send: Send, limit: int) -> None:
        total = 0
        refused = False

        async def counted_receive() -> Message:
            nonlocal total, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                total += len(message.get("body", b""))
                if total > limit:
                    refused = True
                    await _refuse(send, _too_large(limit, "more than that"))
                    return {"type": "http.disconnect"}
            return message

        async def gated_send(message: Message) -> None:
            if not refused:
                await send(message)

        try:
            await self.app(scope, counted_receive, gated_send)
        except Exception:
            if not refused:
                raise  # a route's own failure: the app's error handling answers it
            # the route saw the client go (the 413 is sent): nothing more to do


def _replay(first: Message, receive: Receive) -> Receive:
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return first
        return await receive()

    return replay


def _unexpected(scope: Scope) -> ApiError:
    return ApiError(400, "unexpected_body", f"{scope['method']} {scope['path']} takes no request body")


def _too_large(limit: int, got: str) -> ApiError:
    return ApiError(413, "too_large", f"request body too large: the limit is {limit} bytes, got {got}")


async def _refuse(send: Send, error: ApiError) -> None:
    body = dumps({"error": error.error, "detail": error.detail})
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    headers += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (error.headers or {}).items()]
    headers.append((b"connection", b"close"))  # the rest of the body is not read: the connection ends
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})
