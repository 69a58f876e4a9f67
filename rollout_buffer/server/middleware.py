"""ASGI middleware of FastAPI's routes: the bearer token, the agent socket's gate and the request body cap.

The checks themselves are `server.guards`' (the session API's fast path applies the same ones); these layers
answer their refusals in slime's shape.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.server.bodies import error_response
from rollout_buffer.server.guards import BodyTooLarge, Guards


class BearerAuthMiddleware:
    """Every endpoint but /healthz and the dashboard's page and assets needs `Authorization: Bearer <token>`
    (`Guards.server_token_ok`)."""

    def __init__(self, app: ASGIApp, guards: Guards):
        self.app = app
        self.guards = guards

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.guards.server_token_ok(scope):
            await error_response(401, "missing or wrong bearer token")(scope, receive, send)
            return
        await self.app(scope, receive, send)


class AgentSocketGate:
    """Requests arriving on the agent socket may only call a session's API (`Guards.socket_allows`)."""

    def __init__(self, app: ASGIApp, guards: Guards):
        self.app = app
        self.guards = guards

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.guards.socket_allows(scope):
            message = "the agent socket serves only /sessions/{session_id}/v1/... (with the session's key)"
            await error_response(403, message)(scope, receive, send)
            return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse request bodies larger than the cap with 413, before they are buffered (`Guards.check_declared_length`,
    `Guards.capped`: a body sent in chunks raises BodyTooLarge, which FastAPI's handler answers)."""

    def __init__(self, app: ASGIApp, guards: Guards):
        self.app = app
        self.guards = guards

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        try:
            self.guards.check_declared_length(scope)
        except BodyTooLarge as e:
            await error_response(e.status_code, e.detail)(scope, receive, send)
            return
        await self.app(scope, self.guards.capped(receive), send)
