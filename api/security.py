"""What keeps a browser page from abusing the API: only the hosts the server was bound
to are served (a DNS-rebinding page arrives under its own host name), and every answer
carries headers that forbid content sniffing and framing; HTML pages also get a content
security policy (the viewer needs nothing but its own scripts and styles)."""

from __future__ import annotations

from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import SECURITY_HEADERS as _HEADERS
from .errors import dumps

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
