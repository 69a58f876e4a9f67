"""The server's security checks, each written once: the bearer token, the agent socket's gate and the body cap.

Two layers apply them. FastAPI's middleware (`server.middleware`) guards every route but a session's API; the
session API's fast path (`server.proxy_routes.SessionApi`, which the app hands `/sessions/{id}/v1/...` before
FastAPI sees it) guards that API. Both hold the same `Guards`, built once from the server's config. A check only
decides; each layer answers a refusal in its own protocol's shape (slime's `{"success": false, "message"}` on
FastAPI's routes, OpenAI's or Anthropic's error on a session's API).

- Bearer token: with `--auth-token`, FastAPI's routes (but `/healthz` and the dashboard's page and assets) need
  `Authorization: Bearer <token>`; a session's API takes its session's key or the server token, as `Authorization:
  Bearer` or (Anthropic's clients) `x-api-key`. Compared in constant time.
- Agent socket: a request that came in on the agent socket may call nothing but a session's API, and there must
  present the session's key even when the server has no token.
- Body cap: a body over `--max-body-bytes` is refused with 413, before it is read when it declares its length,
  once it has grown past the cap when it is sent in chunks.
"""

from __future__ import annotations

import hmac
import re
from dataclasses import dataclass

from fastapi import HTTPException
from starlette.types import Message, Receive, Scope

from rollout_buffer.config import ServerConfig

# A session's own API, `/sessions/{id}/v1/<endpoint>`: what the fast path serves and what the other checks exempt.
SESSION_API_PATH = re.compile(r"^/sessions/(?P<session_id>[^/]+)/v1/(?P<endpoint>.+?)/?$")

# The dashboard's page and static assets hold no data: they load without a token (its API needs one).
UI_PREFIX = "/ui"


def is_session_api(path: str) -> bool:
    """True for the endpoints agents call (a session's OpenAI / Anthropic API)."""
    return SESSION_API_PATH.match(path) is not None


def is_public_ui_path(path: str) -> bool:
    """The dashboard page and its static assets (`/ui`, `/ui/static/...`)."""
    return path in (UI_PREFIX, UI_PREFIX + "/") or path.startswith(UI_PREFIX + "/static/")


def needs_server_token(path: str) -> bool:
    """Whether a request to `path` must present the server's token: every path but `/healthz`, the dashboard's page
    and assets, and a session's API (which takes its session's key instead)."""
    return not (path == "/healthz" or is_public_ui_path(path) or is_session_api(path))


def presented_token(scope: Scope, x_api_key: bool = False) -> bytes:
    """The secret a request presents: `Authorization: Bearer <secret>` (the scheme in any case), else, where
    `x_api_key` (a session's API: Anthropic's clients send the key so), the `x-api-key` header; b"" for none."""
    headers = scope["headers"]
    auth = next((value for name, value in headers if name == b"authorization"), b"")
    if auth[:7].lower() == b"bearer ":
        return auth[7:].strip()
    if x_api_key:
        return next((value for name, value in headers if name == b"x-api-key"), b"").strip()
    return b""


def token_ok(given: bytes, accepted: tuple[bytes, ...]) -> bool:
    """Whether `given` is one of the `accepted` secrets, compared in constant time (each of them, always)."""
    ok = False
    for secret in accepted:
        ok |= hmac.compare_digest(given, secret)
    return ok and bool(given)


class BodyTooLarge(HTTPException):
    """A request body over the cap: 413. FastAPI's exception handler answers it in slime's shape; the session API
    answers it as its protocol's `request_too_large` error."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body exceeds {max_bytes} bytes")


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, when it declares a valid one."""
    length = dict(scope["headers"]).get(b"content-length")
    return int(length) if length is not None and length.isdigit() else None


@dataclass(frozen=True)
class Guards:
    """The security checks with the server's settings; see the module's docstring."""

    auth_token: str | None
    agent_socket: str | None
    max_body_bytes: int

    @classmethod
    def of(cls, config: ServerConfig) -> Guards:
        return cls(config.auth_token or None, str(config.agent_socket) if config.agent_socket else None,
                   config.max_body_bytes)

    # ---- bearer token

    def server_token_ok(self, scope: Scope) -> bool:
        """A request to FastAPI's routes: true unless it needs the server's token and does not present it."""
        if self.auth_token is None or not needs_server_token(scope["path"]):
            return True
        return token_ok(presented_token(scope), (self.auth_token.encode(),))

    def session_key_ok(self, scope: Scope, api_key: str) -> bool:
        """A request to a session's API: with a server token, or on the agent socket, it must present the session's
        key or the server token (`Authorization: Bearer` or `x-api-key`)."""
        if self.auth_token is None and not self.on_agent_socket(scope):
            return True
        accepted = (api_key.encode(), *((self.auth_token.encode(),) if self.auth_token else ()))
        return token_ok(presented_token(scope, x_api_key=True), accepted)

    # ---- the agent socket

    def on_agent_socket(self, scope: Scope) -> bool:
        """True when the request came in on the agent socket (uvicorn reports a Unix socket as (path, None))."""
        server = scope.get("server")
        return (self.agent_socket is not None and server is not None and server[1] is None
                and server[0] == self.agent_socket)

    def socket_allows(self, scope: Scope) -> bool:
        """The agent socket's gate: a request on it may only call a session's API (which then needs its key,
        `session_key_ok`); any other request passes."""
        return not self.on_agent_socket(scope) or is_session_api(scope["path"])

    # ---- the body cap

    def check_declared_length(self, scope: Scope) -> None:
        """Raise BodyTooLarge when the request declares a body over the cap (before anything is read)."""
        length = declared_length(scope)
        if length is not None and length > self.max_body_bytes:
            raise BodyTooLarge(self.max_body_bytes)

    def capped(self, receive: Receive) -> Receive:
        """`receive` that raises BodyTooLarge once the body has grown past the cap (a body sent in chunks)."""
        max_bytes = self.max_body_bytes
        seen = 0

        async def limited() -> Message:
            nonlocal seen
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > max_bytes:
                    raise BodyTooLarge(max_bytes)
            return msg

        return limited
