"""ASGI middleware of the server: bearer-token auth, the agent socket's gate, and the request body cap."""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable

from fastapi import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_buffer.server.bodies import error_response

# A session's own API (`/sessions/{id}/v1/...`): its routes check the session's key themselves.
_SESSION_API = re.compile(r"^/sessions/[^/]+/v1/")


# The dashboard's page and static assets hold no data: they load without a token (its API needs one).
UI_PREFIX = "/ui"


def is_public_ui_path(path: str) -> bool:
    """The dashboard page and its static assets (`/ui`, `/ui/static/...`)."""
    return path in (UI_PREFIX, UI_PREFIX + "/") or path.startswith(UI_PREFIX + "/static/")


def is_session_api(path: str) -> bool:
    """True for the endpoints agents call (a session's OpenAI / Anthropic API)."""
    return _SESSION_API.match(path) is not None


def from_agent_socket(scope: Scope, socket_path: str | None) -> bool:
    """True when the request came in on the agent socket (uvicorn reports a Unix socket as (path, None))."""
    server = scope.get("server")
    return socket_path is not None and server is not None and server[1] is None and server[0] == socket_path


class BearerAuthMiddleware:
    """Every endpoint but /healthz and the dashboard's page and assets needs `Authorization: Bearer <token>`;
    compared in constant time."""

    def __init__(self, app: ASGIApp, token: str):
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or path == "/healthz" or is_session_api(path) or is_public_ui_path(path):
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            await error_response(401, "missing or wrong bearer token")(scope, receive, send)
            return
        await self.app(scope, receive, send)


class AgentSocketGate:
    """Requests arriving on the agent socket may only call a session's API (which then needs its key)."""

    def __init__(self, app: ASGIApp, socket_path: str):
        self.app = app
        self.socket_path = socket_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and from_agent_socket(scope, self.socket_path) and not is_session_api(scope["path"]):
            message = "the agent socket serves only /sessions/{session_id}/v1/... (with the session's key)"
            await error_response(403, message)(scope, receive, send)
            return
        await self.app(scope, receive, send)


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, when it declares a valid one."""
    length = dict(scope["headers"]).get(b"content-length")
    return int(length) if length is not None and length.isdigit() else None


def capped(receive: Receive, max_bytes: int, exceeded: Callable[[], Exception]) -> Receive:
    """`receive` that raises `exceeded()` once the body has grown past `max_bytes` (a body sent in chunks)."""
    seen = 0

    async def limited() -> Message:
        nonlocal seen
        msg = await receive()
        if msg["type"] == "http.request":
            seen += len(msg.get("body", b""))
            if seen > max_bytes:
                raise exceeded()
        return msg

    return limited


class BodyLimitMiddleware:
    """Refuse request bodies larger than the configured cap with 413, before they are buffered."""

    def __init__(self, app: ASGIApp, max_bytes: int):
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        message = f"request body exceeds {self.max_bytes} bytes"
        length = declared_length(scope)
        if length is not None and length > self.max_bytes:
            await error_response(413, message)(scope, receive, send)
            return
        await self.app(scope, capped(receive, self.max_bytes, lambda: HTTPException(413, message)), send)
