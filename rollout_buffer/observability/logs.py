"""Logging set-up: levelled text lines by default, JSON lines for log shippers; the access lines of agent
requests; and the refusals of the buffer's own routes, logged and counted in one place."""

from __future__ import annotations

import logging
import time
from typing import Any

import orjson
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_buffer.observability import metrics

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# One line per request to a session's API (`serve --access-log info|debug|off`), on its own logger so that it
# can be routed or silenced apart from the service's events.
ACCESS_LOG_MODES = ("info", "debug", "off")
access = logging.getLogger("rollout_buffer.access")
# The level access lines are logged at; `off` raises the access logger's level above every level instead.
access_level = logging.INFO
_access_mode = "info"
# Refusals of the buffer's own routes (slime's protocol, sessions, inspection), whichever layer answered them.
refusals = logging.getLogger("rollout_buffer.http")
# Enough of an error body for its message; error bodies are small JSON objects.
_MAX_ERROR_BODY = 4096


class JsonLinesFormatter(logging.Formatter):
    """One JSON object per record: time, level, logger, message (and the traceback when there is one)."""

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(entry).decode()


def setup_logging(level: str = "INFO", fmt: str = "text", access_log: str = "info") -> None:
    """Configure the root logger (uvicorn's loggers propagate to it) and the level of access lines."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonLinesFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    # httpx logs every request at INFO: the buffer's own calls (engines' info, session workers) are not events.
    logging.getLogger("httpx").setLevel(logging.WARNING)
    set_access_log(access_log)


def set_access_log(mode: str) -> None:
    """Log agent requests' access lines at INFO, at DEBUG (seen only with `--log-level DEBUG`), or not at all."""
    global access_level, _access_mode
    if mode not in ACCESS_LOG_MODES:
        raise ValueError(f"access log must be one of {', '.join(ACCESS_LOG_MODES)}, not {mode!r}")
    _access_mode = mode
    access_level = logging.DEBUG if mode == "debug" else logging.INFO
    access.setLevel(logging.CRITICAL + 1 if mode == "off" else logging.NOTSET)


def access_mode() -> str:
    """The access-log mode `set_access_log` was given (what a session worker is started with)."""
    return _access_mode


class RefusalLog:
    """ASGI middleware: every 4xx/5xx answer of the app it wraps is logged at WARNING with the message its body
    carries, and counted in `rollout_buffer_http_errors_total{route, status}` by route template.

    One place sees every refusal, whether a route, an exception handler or another middleware (bearer token,
    body cap, agent socket gate) built it; only error bodies are read, successes pass through untouched.
    An exception nobody handled is counted as the 500 the outer layer answers for it.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 0
        body = b""

        async def watched(message: Message) -> None:
            nonlocal status, body
            if message["type"] == "http.response.start":
                status = message["status"]
            elif status >= 400 and message["type"] == "http.response.body":
                if len(body) < _MAX_ERROR_BODY:
                    body += message.get("body", b"")[:_MAX_ERROR_BODY - len(body)]
                if not message.get("more_body", False):
                    _refused(scope, status, _message_of(body))
            await send(message)

        try:
            await self.app(scope, receive, watched)
        except Exception as e:
            if status == 0:
                _refused(scope, 500, f"unhandled {type(e).__name__}: {e}")
            raise


def _refused(scope: Scope, status: int, message: str) -> None:
    # The template as documented (`/trajectories/{uid}`, without a `:path` convertor).
    route = getattr(scope.get("route"), "path_format", None) or "unmatched"
    metrics.HTTP_ERRORS.labels(route, str(status)).inc()
    refusals.warning("route=%s status=%d method=%s path=%s: %s", route, status, scope["method"], scope["path"],
                     message)


def _message_of(body: bytes) -> str:
    """The reason an error body gives: slime's `message`, FastAPI's `detail`, else the body's text."""
    try:
        parsed: Any = orjson.loads(body)
    except orjson.JSONDecodeError:
        parsed = None
    if isinstance(parsed, dict):
        for key in ("message", "detail"):
            reason = parsed.get(key)
            if isinstance(reason, str):
                return reason
    return body.decode(errors="replace")[:500] or "(no body)"
