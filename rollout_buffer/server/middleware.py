"""ASGI middleware of FastAPI's routes: the request gate (`Guards.refusal`) and the request body cap.

The checks themselves are `server.guards`' (the session API's fast path applies the same ones); these layers
answer their refusals in slime's shape.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.server.bodies import error_response
from rollout_buffer.server.guards import BodyTooLarge, Guards


class RequestGate:
    """Refuses what `Guards.refusal` refuses: the agent socket's other routes, browsers' cross-site and rebinding
    requests, non-JSON bodies, and callers without the server's token (or, without one, not its own user)."""

    def __init__(self, app: ASGIApp, guards: Guards):
        self.app = app
        self.guards = guards

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and (refused := self.guards.refusal(scope)) is not None:
            await error_response(refused.status, refused.message)(scope, receive, send)
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
