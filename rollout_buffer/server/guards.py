"""The server's security checks, each written once: who may call what, from where, with which body.

Two layers apply them. FastAPI's middleware (`server.middleware.RequestGate`, and the body cap) guards every
route but a session's API; the session API's fast path (`server.proxy_routes.SessionApi`, which the app hands
`/sessions/{id}/v1/...` before FastAPI sees it) guards that API. Both hold the same `Guards`, built once from the
server's config, and ask `Guards.refusal` first. A check only decides; each layer answers a refusal in its own
protocol's shape (slime's `{"success": false, "message"}` on FastAPI's routes, OpenAI's or Anthropic's error on a
session's API).

- Agent socket: a request that came in on the agent socket may call nothing but a session's API.
- Browsers: a state-changing request must carry JSON (`application/json`), or no body at all (a cross-site form
  cannot send either); an `Origin` other than the server's own is refused, as is a `Host` the server does not
  serve (DNS rebinding) unless the request presents the server's token, which a page cannot attach by itself.
- Credentials: with `--auth-token`, every route but `/healthz`, the dashboard's page and assets and a session's
  API needs `Authorization: Bearer <token>`. Without one, those routes are taken from the server's own user (and
  root) alone: a loopback caller's uid comes from the kernel (`server.peer`). A session's API always needs its
  session's key (or the server token), as `Authorization: Bearer` or (Anthropic's clients) `x-api-key`.
  Compared in constant time.
- Body cap: a body over `--max-body-bytes` is refused with 413, before it is read when it declares its length,
  once it has grown past the cap when it is sent in chunks.
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from dataclasses import dataclass
from urllib.parse import urlsplit

from fastapi import HTTPException
from starlette.types import Message, Receive, Scope

from rollout_buffer.config import ServerConfig
from rollout_buffer.server.peer import is_loopback, peer_uid, trusted_uids

# A session's own API, `/sessions/{id}/v1/<endpoint>`: what the fast path serves and what the other checks exempt.
SESSION_API_PATH = re.compile(r"^/sessions/(?P<session_id>[^/]+)/v1/(?P<endpoint>.+?)/?$")
# `HEAD /sessions/{id}`: Claude Code probes its base URL; the answer has no body.
SESSION_PROBE_PATH = re.compile(r"^/sessions/[^/]+/?$")

# The dashboard's page and static assets hold no data: they load without a token (its API needs one).
UI_PREFIX = "/ui"
# Names every server serves besides its own: loopback (127.0.0.0/8 is checked as addresses).
LOOPBACK_NAMES = frozenset({"localhost", "::1"})
STATE_CHANGING = frozenset({"POST", "PUT", "PATCH", "DELETE"})


@dataclass(frozen=True)
class Refusal:
    """Why a request is refused: its HTTP status and a message saying what would be accepted."""

    status: int
    message: str


def is_session_api(path: str) -> bool:
    """True for the endpoints agents call (a session's OpenAI / Anthropic API)."""
    return SESSION_API_PATH.match(path) is not None


def is_public_ui_path(path: str) -> bool:
    """The dashboard page and its static assets (`/ui`, `/ui/static/...`)."""
    return path in (UI_PREFIX, UI_PREFIX + "/") or path.startswith(UI_PREFIX + "/static/")


def is_public(scope: Scope) -> bool:
    """Routes that answer no data and need no credential: `/healthz`, the dashboard's page and assets, and the
    bodiless `HEAD /sessions/{id}` probe."""
    path = scope["path"]
    return (path == "/healthz" or is_public_ui_path(path)
            or (scope.get("method") == "HEAD" and SESSION_PROBE_PATH.match(path) is not None))


def needs_server_token(path: str) -> bool:
    """Whether a request to `path` must present the server's token (when it has one): every path but `/healthz`,
    the dashboard's page and assets, and a session's API (which takes its session's key instead)."""
    return not (path == "/healthz" or is_public_ui_path(path) or is_session_api(path))


def _header(scope: Scope, name: bytes) -> bytes | None:
    return next((value for key, value in scope["headers"] if key == name), None)


def presented_token(scope: Scope, x_api_key: bool = False) -> bytes:
    """The secret a request presents: `Authorization: Bearer <secret>` (the scheme in any case), else, where
    `x_api_key` (a session's API: Anthropic's clients send the key so), the `x-api-key` header; b"" for none."""
    auth = _header(scope, b"authorization") or b""
    if auth[:7].lower() == b"bearer ":
        return auth[7:].strip()
    if x_api_key:
        return (_header(scope, b"x-api-key") or b"").strip()
    return b""


def token_ok(given: bytes, accepted: tuple[bytes, ...]) -> bool:
    """Whether `given` is one of the `accepted` secrets, compared in constant time (each of them, always)."""
    ok = False
    for secret in accepted:
        ok |= hmac.compare_digest(given, secret)
    return ok and bool(given)


def host_name(netloc: str) -> str:
    """The host of a `Host` header or URL netloc, lowercased, without port or brackets."""
    netloc = netloc.strip().lower()
    if netloc.startswith("["):
        return netloc[1:].split("]", 1)[0]
    return netloc.rsplit(":", 1)[0] if netloc.count(":") == 1 else netloc


def _is_loopback_name(host: str) -> bool:
    if host in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class BodyTooLarge(HTTPException):
    """A request body over the cap: 413. FastAPI's exception handler answers it in slime's shape; the session API
    answers it as its protocol's `request_too_large` error."""

    def __init__(self, max_bytes: int):
        super().__init__(413, f"request body exceeds {max_bytes} bytes")


def declared_length(scope: Scope) -> int | None:
    """The request's Content-Length, when it declares a valid one."""
    length = _header(scope, b"content-length")
    return int(length) if length is not None and length.isdigit() else None


def _has_body(scope: Scope) -> bool:
    length = declared_length(scope)
    return (length is not None and length > 0) or _header(scope, b"transfer-encoding") is not None


@dataclass(frozen=True)
class Guards:
    """The security checks with the server's settings; see the module's docstring."""

    auth_token: str | None
    agent_socket: str | None
    max_body_bytes: int
    # Host names requests may name besides loopback's (the bind address, --public-url's, --allowed-host).
    hosts: frozenset[str] = frozenset()

    @classmethod
    def of(cls, config: ServerConfig) -> Guards:
        hosts = {host_name(h) for h in config.allowed_hosts}
        if config.host not in ("0.0.0.0", "::", ""):
            hosts.add(host_name(f"[{config.host}]" if ":" in config.host else config.host))
        if config.public_url:
            hosts.add((urlsplit(config.public_url).hostname or "").lower())
        return cls(config.auth_token or None, str(config.agent_socket) if config.agent_socket else None,
                   config.max_body_bytes, frozenset(hosts - {""}))

    # ---- every request

    def refusal(self, scope: Scope) -> Refusal | None:
        """Why this request must be refused before anything else is done with it, or None: the agent socket's
        gate, the browser checks (body type, Origin, Host) and the caller's credential (the session API's key is
        checked once its session is known, `session_key_ok`)."""
        path = scope["path"]
        if self.on_agent_socket(scope):
            return None if is_session_api(path) else Refusal(
                403, "the agent socket serves only /sessions/{session_id}/v1/... (with the session's key)")
        if is_public(scope):
            return None
        if scope.get("method") in STATE_CHANGING and _has_body(scope) and not self._json_body(scope):
            return Refusal(415, "content-type: this route takes JSON; send the body with "
                                "'Content-Type: application/json'")
        origin = _header(scope, b"origin")
        if origin is not None and not self._same_origin(scope, origin.decode("latin-1")):
            return Refusal(403, f"origin: requests from the page at {origin.decode('latin-1')!r} are refused (only "
                                "the server's own pages, or clients that are not browsers, may call it)")
        if is_session_api(path):
            return None
        if self.auth_token is not None:
            if token_ok(presented_token(scope), (self.auth_token.encode(),)):
                return None
            return Refusal(401, "missing or wrong bearer token (send 'Authorization: Bearer <token>', the "
                                "server's --auth-token)")
        if not self.host_ok(scope):
            host = (_header(scope, b"host") or b"").decode("latin-1")
            return Refusal(403, f"host: {host!r} is not a name this server serves (loopback, its --host, "
                                "--public-url); add it with --allowed-host, or give the server --auth-token")
        return self._local_caller(scope)

    def _json_body(self, scope: Scope) -> bool:
        kind = (_header(scope, b"content-type") or b"").split(b";", 1)[0].strip().lower()
        return kind == b"application/json"

    def _same_origin(self, scope: Scope, origin: str) -> bool:
        parts = urlsplit(origin)
        host = (_header(scope, b"host") or b"").decode("latin-1").strip().lower()
        return parts.scheme in ("http", "https") and bool(host) and parts.netloc.lower() == host

    def host_ok(self, scope: Scope) -> bool:
        """Whether the request's `Host` names this server: loopback, the bind address, `--public-url`'s host or
        an `--allowed-host` (a request without one is not a browser's)."""
        host = _header(scope, b"host")
        if host is None:
            return True
        name = host_name(host.decode("latin-1"))
        return _is_loopback_name(name) or name in self.hosts

    def _local_caller(self, scope: Scope) -> Refusal | None:
        """Without a server token: a loopback caller must be the server's own user or root. A caller from another
        address reaches a server without a token only where the operator bound it to the network on purpose
        (`--insecure-no-auth`)."""
        client, server = scope.get("client"), scope.get("server")
        if client is None or server is None or server[1] is None or not is_loopback(client[0]):
            return None
        uid = peer_uid((client[0], client[1]), (server[0], server[1]))
        if uid is not None and uid in trusted_uids():
            return None
        who = "an unknown user" if uid is None else f"uid {uid}"
        return Refusal(403, f"this server has no --auth-token, so it takes requests only from its own user and "
                            f"root on this machine; this one came from {who}: give the server --auth-token T "
                            "(or ROLLOUT_BUFFER_AUTH_TOKEN) and the client 'Authorization: Bearer T'")

    # ---- a session's API

    def session_key_ok(self, scope: Scope, api_key: str) -> bool:
        """A request to a session's API must present the session's key or the server token (`Authorization:
        Bearer` or `x-api-key`), with or without a server token."""
        accepted = (api_key.encode(), *((self.auth_token.encode(),) if self.auth_token else ()))
        return token_ok(presented_token(scope, x_api_key=True), accepted)

    # ---- the agent socket

    def on_agent_socket(self, scope: Scope) -> bool:
        """True when the request came in on the agent socket (uvicorn reports a Unix socket as (path, None))."""
        server = scope.get("server")
        return (self.agent_socket is not None and server is not None and server[1] is None
                and server[0] == self.agent_socket)

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
