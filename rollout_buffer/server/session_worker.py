"""A session worker (`serve --session-workers N`): a process of its own serving the OpenAI chat, Responses and
Anthropic endpoints of the harness sessions the buffer places on it.

Each worker holds its sessions' state and journal (its own folder, `<data dir>/session-workers/<n>`), builds the
run's engine client and tokenizer from the run's start payload, talks to the engines itself and hands finished
records to the buffer in batches (`proxy.worker_run`); the buffer keeps the store, grouping, delivery and the run's
accounting (`proxy.worker_pool`). Agents reach their session here directly (the session's base URL names this
worker's port), or, sandboxed without a network on this node, through its own agent socket; a harness finishes
its session here (`finish_url`, with the server's token when it has one); the buffer alone calls the rest —
placing a session, opening or ending a run, finishing or showing a session for its own routes, restoring sessions
after a restart — with the worker's secret (an environment variable, never an argument, like the server's token).

Started by the buffer as `rollout-buffer session-worker ...`; it dies with the buffer (parent-death signal).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import hmac
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import setproctitle
from fastapi import FastAPI
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.config import AUTH_TOKEN_ENV, DEFAULT_MAX_BODY_BYTES, ServerConfig
from rollout_buffer.media.images import DEFAULT_MAX_IMAGE_BYTES
from rollout_buffer.observability.logs import ACCESS_LOG_MODES, setup_logging
from rollout_buffer.policy import Policy
from rollout_buffer.proxy.worker_run import WORKER_SECRET_ENV, WORKER_SECRET_HEADER
from rollout_buffer.server.app import BufferApp, answer_errors_as_slime
from rollout_buffer.server.bodies import error_response
from rollout_buffer.server.guards import Guards, is_session_api
from rollout_buffer.server.listeners import agent_socket, tcp_listener
from rollout_buffer.server.middleware import BodyLimitMiddleware, RequestGate
from rollout_buffer.server.session_worker_api import SessionWorker, router
from rollout_buffer.tokens.tokenizer import keep_torch_out

log = logging.getLogger(__name__)


class WorkerSecret:
    """Every route but a session's API, `/healthz`, `HEAD /sessions/{id}` (Claude Code probes its base URL) and a
    harness's `POST /sessions/{id}/finish` is the buffer's: it must present the worker's secret. Those others pass
    the request gate as on the buffer (`Guards.refusal`): finishing takes what the buffer's own `/finish` takes,
    the server's token when it has one (never a session's key, which its agent holds), else its own user."""

    def __init__(self, app: ASGIApp, secret: str, guards: Guards):
        self.app = app
        self.secret = secret.encode()
        self.gated = RequestGate(app, guards)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        given = next((v for k, v in scope["headers"] if k == WORKER_SECRET_HEADER.encode()), b"")
        if hmac.compare_digest(given, self.secret):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "http" and (_finish(scope) or _public(scope)):
            await self.gated(scope, receive, send)
            return
        if scope["type"] == "websocket":  # refused before the handshake: 403
            await send({"type": "websocket.close", "code": 1008})
            return
        await error_response(403, "this route of a session worker is the buffer's")(scope, receive, send)


def _finish(scope: Scope) -> bool:
    parts = scope["path"].split("/")
    return scope["method"] == "POST" and len(parts) == 4 and parts[1] == "sessions" and parts[3] == "finish"


def _public(scope: Scope) -> bool:
    path = scope["path"]
    return (path == "/healthz" or is_session_api(path)
            or (scope["method"] == "HEAD" and path.startswith("/sessions/") and path.count("/") == 2))


def create_worker_app(config: ServerConfig, index: int, buffer_url: str, secret: str) -> FastAPI:
    """The app of session worker `index`; `config.data_dir` is its own folder (its sessions' journals)."""
    worker = SessionWorker(config, index, buffer_url, secret)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await worker.start()
        try:
            yield
        finally:
            await worker.stop()

    guards = Guards.of(config)
    app = BufferApp(guards, title=f"rollout-buffer session worker {index}", lifespan=lifespan, openapi_url=None,
                    docs_url=None, redoc_url=None)
    app.state.worker = worker
    app.state.sessions = worker.sessions
    app.state.arrivals = worker.arrivals
    app.add_middleware(BodyLimitMiddleware, guards=guards)
    app.add_middleware(WorkerSecret, secret=secret, guards=guards)
    answer_errors_as_slime(app)
    app.include_router(router)
    return app


def main(argv: list[str] | None = None) -> None:
    """`rollout-buffer session-worker`: started by `serve --session-workers`, not by hand."""
    from rollout_buffer.shortcuts import switch as shortcuts
    from rollout_buffer.shortcuts.quiet_server import serve

    p = argparse.ArgumentParser(prog="rollout-buffer session-worker", description=main.__doc__)
    p.add_argument("--index", type=int, required=True)
    p.add_argument("--host", required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--data-dir", type=Path, required=True, help="this worker's folder (its sessions' journals)")
    p.add_argument("--buffer-url", required=True, help="where the buffer takes this worker's records")
    p.add_argument("--images-dir", type=Path, default=None, help="the buffer's image store (on this machine)")
    p.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES)
    p.add_argument("--image-url-host", action="append", default=[], help="the buffer's --image-url-host")
    p.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES)
    p.add_argument("--batch-ms", type=float, default=ServerConfig.session_worker_batch_ms,
                   help="how long finished records wait for others before they go to the buffer")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", choices=["text", "json"], default="text")
    p.add_argument("--access-log", choices=ACCESS_LOG_MODES, default="info")
    args = p.parse_args(argv)
    secret = os.environ.pop(WORKER_SECRET_ENV, "")
    if not secret:
        p.error(f"{WORKER_SECRET_ENV} must hold the secret the buffer gave this worker")
    setup_logging(args.log_level, args.log_format, args.access_log)
    shortcuts.announce(log)
    keep_torch_out()
    setproctitle.setproctitle(f"rollout-buffer session-worker {args.index} :{args.port}")
    gc.set_threshold(50_000, 20, 10)  # as `serve`: thousands of sessions' objects in flight
    with contextlib.ExitStack() as stack:
        listeners = [tcp_listener(args.host, args.port)]
        # Its own agent socket: sandboxed agents on this node without a network reach their sessions here.
        sandboxes = agent_socket(stack)
        if sandboxes is not None:
            listeners.append(sandboxes[1])
        token = os.environ.pop(AUTH_TOKEN_ENV, None) or None
        config = ServerConfig(host=args.host, port=args.port, data_dir=args.data_dir, images_dir=args.images_dir,
                              max_image_bytes=args.max_image_bytes,
                              policy=Policy(image_url_hosts=tuple(args.image_url_host)),
                              auth_token=token,
                              max_body_bytes=args.max_body_bytes, session_worker_batch_ms=args.batch_ms,
                              agent_socket=sandboxes[0] if sandboxes is not None else None)
        app = create_worker_app(config, args.index, args.buffer_url, secret)
        gc.freeze()
        serve(app, listeners, args.log_level.lower())
