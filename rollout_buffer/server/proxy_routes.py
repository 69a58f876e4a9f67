"""HTTP routes of the agent proxy: sessions (`/sessions`, `/sessions/{id}`, `/sessions/{id}/finish`), the
sessions Ray actors open for their trajectories (`POST /sessions` with `kind: generator`, `/sessions/{id}/close`,
`/discard`, `/transcript`) and each session's OpenAI and Anthropic endpoints under `/sessions/{id}/v1/`.

The session endpoints answer in their protocol's shapes (errors included); the session-management endpoints
in slime's (`{"success", "message"}`). A streamed turn is an SSE response that waits for the turn while
sending the reply's parts as the engine generates them (keep-alives while none come), and takes the turn back
when the client hangs up before the stream's end.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging
import re
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response
from pydantic import TypeAdapter
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.generation.runner import RunManager
from rollout_buffer.observability import metrics
from rollout_buffer.proxy.adapter import StreamState, WireAdapter
from rollout_buffer.proxy.anthropic_messages import AnthropicMessagesAdapter
from rollout_buffer.proxy.manager import SessionError, SessionManager
from rollout_buffer.proxy.messages import WireError
from rollout_buffer.proxy.openai_chat import OpenAIChatAdapter
from rollout_buffer.proxy.replies import ReplyPart
from rollout_buffer.proxy.session import Session, TurnRequest, TurnResult
from rollout_buffer.schemas import (
    DiscardSessionRequest,
    FinishSessionRequest,
    OpenGeneratorSessionRequest,
    OpenSessionRequest,
)
from rollout_buffer.server.bodies import documented_body, error_response, json_response, parse_body, validated
from rollout_buffer.server.middleware import capped, declared_length, from_agent_socket

log = logging.getLogger(__name__)

OPEN_BODY: TypeAdapter[OpenSessionRequest] = TypeAdapter(OpenSessionRequest)
OPEN_GENERATOR_BODY: TypeAdapter[OpenGeneratorSessionRequest] = TypeAdapter(OpenGeneratorSessionRequest)
DISCARD_BODY: TypeAdapter[DiscardSessionRequest] = TypeAdapter(DiscardSessionRequest)
FINISH_BODY: TypeAdapter[FinishSessionRequest] = TypeAdapter(FinishSessionRequest)
OPENAI = OpenAIChatAdapter()
ANTHROPIC = AnthropicMessagesAdapter()
# A stream opens once the turn has taken this long (quick refusals still get a plain error response), then
# sends a keep-alive at this interval while the turn is generated.
STREAM_OPEN_AFTER_S = 0.25
KEEP_ALIVE_S = 10.0


def mount_proxy(app: FastAPI) -> None:
    """Add the agent-session routes to `app`; `app.state.sessions` (a SessionManager) serves them."""

    def manager(request: Request) -> SessionManager:
        return request.app.state.sessions

    @app.exception_handler(SessionError)
    async def _refused(_: Request, exc: SessionError) -> Response:
        return error_response(exc.status, str(exc))

    @app.post("/sessions", summary="Open an agent session in the running agent run (a harness's, or a Ray actor's)",
              openapi_extra=documented_body({"oneOf": [OpenSessionRequest.model_json_schema(),
                                                       OpenGeneratorSessionRequest.model_json_schema()]},
                                            required=True))
    async def open_session(request: Request) -> Response:
        raw = parse_body(await request.body())
        if isinstance(raw, dict) and raw.get("kind") == "generator":
            return await _open_for_actor(request, validated(OPEN_GENERATOR_BODY, raw))
        body = validated(OPEN_BODY, raw)
        run = _agent_run(request, body.run_id)
        session = await manager(request).open_harness(run, body.instance_id, body.metadata, str(request.base_url))
        return json_response({
            "success": True, "session_id": session.session_id, "base_url": session.base_url,
            "anthropic_base_url": session.anthropic_base_url, "api_key": session.api_key,
            "run_id": run.run_id, "instance_id": body.instance_id, "uid": session.ctx.uid,
        })

    async def _open_for_actor(request: Request, body: OpenGeneratorSessionRequest) -> Response:
        run = _agent_run(request, body.run_id)
        if run.input_path is None:
            raise HTTPException(409, f"run_id: run {run.run_id} hosts harness sessions; it runs no agents")
        session = await manager(request).open_for_actor(run, body.uid, body.instance_id, body.epoch, body.repeat,
                                                        body.metadata, str(request.base_url))
        return json_response({
            "success": True, "session_id": session.session_id, "base_url": session.base_url,
            "anthropic_base_url": session.anthropic_base_url, "api_key": session.api_key,
            "agent_socket": session.agent_socket, "run_id": run.run_id, "uid": body.uid,
        })

    @app.post("/sessions/{session_id}/close", summary="Close a Ray actor's session; answer its records (not stored)",
              openapi_extra=documented_body(FinishSessionRequest.model_json_schema(), required=True))
    async def close_session(session_id: str, request: Request) -> Response:
        body = validated(FINISH_BODY, parse_body(await request.body()))
        try:
            records = await manager(request).close_for_actor(session_id, body.reward, body.extra_info)
        except ValueError as e:  # closed all the same; the actor fails its trajectory
            return error_response(409, str(e), {"error_kind": "empty_session"})
        return json_response({"success": True, "session_id": session_id, "records": records})

    @app.post("/sessions/{session_id}/discard", summary="Close a Ray actor's session without records",
              openapi_extra=documented_body(DiscardSessionRequest.model_json_schema(), required=True))
    async def discard_session(session_id: str, request: Request) -> Response:
        body = validated(DISCARD_BODY, parse_body(await request.body()))
        await manager(request).discard_for_actor(session_id, body.reason)
        return json_response({"success": True, "session_id": session_id})

    @app.get("/sessions/{session_id}/transcript", summary="The messages of an open session's latest branch")
    async def session_transcript(session_id: str, request: Request) -> Response:
        session = manager(request).sessions.get(session_id)
        if session is None:
            raise HTTPException(404, f"session_id: no open session {session_id!r}")
        return json_response({"session_id": session_id, "messages": await session.transcript()})

    @app.post("/sessions/{session_id}/finish", summary="Close a harness session with its reward; store its records",
              openapi_extra=documented_body(FinishSessionRequest.model_json_schema(), required=True))
    async def finish_session(session_id: str, request: Request) -> Response:
        body = validated(FINISH_BODY, parse_body(await request.body()))
        stored = await manager(request).finish(session_id, body.reward, body.extra_info)
        return json_response({"success": True, **stored})

    @app.get("/sessions", summary="Open agent sessions (of one run)")
    async def list_sessions(request: Request, run_id: str | None = None) -> Response:
        return json_response({"sessions": manager(request).list(run_id)})

    @app.get("/sessions/{session_id}", summary="One session: state and branch tree (open or recently closed)")
    async def session_view(session_id: str, request: Request) -> Response:
        view = manager(request).view(session_id)
        if view is None:
            raise HTTPException(404, f"session_id: unknown session {session_id!r}")
        return json_response(view)


# ---- the session API: what agents call on every turn -----------------------------------------------------------

async def _count_tokens(request: Request, sessions: SessionManager, session_id: str) -> Response:
    try:
        session = _session(request, sessions, session_id)
        req = ANTHROPIC.parse(_json(await request.body()))
        return json_response({"input_tokens": await session.count_tokens(req)})
    except WireError as e:
        return _error(ANTHROPIC, e)


async def _models(request: Request, sessions: SessionManager, session_id: str) -> Response:
    adapter = _adapter_of("models", request.scope)
    try:
        session = _session(request, sessions, session_id)
    except WireError as e:
        return _error(adapter, e)
    return json_response(adapter.models(session.options.model_name))


def _adapter_of(endpoint: str, scope: Scope) -> WireAdapter:
    """The protocol a session endpoint answers in (`models` serves both: Anthropic's clients send
    `anthropic-version`)."""
    if endpoint.startswith("messages"):
        return ANTHROPIC
    if endpoint == "models" and any(name == b"anthropic-version" for name, _ in scope["headers"]):
        return ANTHROPIC
    return OPENAI


def _agent_run(request: Request, run_id: str | None) -> Any:
    """The running agent run (the one `run_id` names, when given); 409 naming run_id otherwise."""
    runs: RunManager = request.app.state.runs
    run = runs.current
    if run is None or run.task is None or run.task.done():
        raise HTTPException(409, "run_id: no run is running; start one with task_type agent")
    if run_id is not None and run_id != run.run_id:
        raise HTTPException(409, f"run_id: {run_id!r} is not the running run ({run.run_id})")
    if run.req.task_type != "agent":
        raise HTTPException(409, f"run_id: the running run is task_type {run.req.task_type!r}, not agent")
    return run


def _session(request: Request, sessions: SessionManager, session_id: str) -> Session:
    """The session, once the request proved it may drive it: with a server token, or through the agent socket,
    the session's own key (or the server token) is required, as `Authorization: Bearer` or `x-api-key`."""
    session = sessions.get(session_id)
    auth_token = sessions.config.auth_token
    socket = str(sessions.config.agent_socket) if sessions.config.agent_socket else None
    if auth_token or from_agent_socket(request.scope, socket):
        given = _credential(request).encode()
        allowed = [session.api_key, *([auth_token] if auth_token else [])]
        if not any(hmac.compare_digest(given, k.encode()) for k in allowed):
            raise WireError("authentication", "missing or wrong API key for this session")
    return session


async def _turn(request: Request, sessions: SessionManager, session_id: str, adapter: WireAdapter) -> Response:
    try:
        session = _session(request, sessions, session_id)
        req = adapter.parse(_json(await request.body()))
        if req.stream:
            return TurnStream(session, adapter, req)
        task = session.start_turn(req)
        result = await _unless_client_leaves(session, task, request.receive)
        if result is None:
            return Response(status_code=499)  # nobody reads it; the turn was cancelled and taken back
        return json_response(adapter.response(req, result.reply))
    except WireError as e:
        return _error(adapter, e)
    except Exception as e:  # a bug must still answer in the client's protocol
        log.exception("session %s: %s request failed", session_id, adapter.protocol)
        return _error(adapter, WireError("server", f"internal error: {type(e).__name__}: {e}"))


async def _unless_client_leaves(session: Session, task: asyncio.Task[TurnResult], receive: Receive
                                ) -> TurnResult | None:
    """The turn's result, or None when the client disconnected first (the turn is then cancelled)."""
    gone = asyncio.create_task(_client_gone(receive))
    gone.add_done_callback(lambda g: g.cancelled() or task.cancel())
    try:
        return await session.outcome(task)
    except WireError:  # what `outcome` makes of the cancelled turn
        if gone.done() and not gone.cancelled():
            return None  # the turn was cancelled when the client left, and is taken back
        raise
    finally:
        gone.cancel()
        if not task.done():
            task.cancel()


async def _client_gone(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def _json(raw: bytes) -> Any:
    try:
        return parse_body(raw)
    except Exception:
        raise WireError("invalid_request", "the body is not valid JSON") from None


def _credential(request: Request) -> str:
    auth = request.headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return request.headers.get("x-api-key", "").strip()


def _error(adapter: WireAdapter, err: WireError) -> Response:
    metrics.PROXY_ERRORS.labels(adapter.protocol, err.kind).inc()
    return json_response(adapter.error_body(err), err.status)


class TurnStream(Response):
    """A streamed turn: the reply's parts as the engine generates them, in the protocol's events.

    The stream opens with the first part, or with keep-alives when the turn takes longer than
    `STREAM_OPEN_AFTER_S` to start; a turn that fails before it opened answers a plain error response, after
    that an error event. A client gone before the end cancels the turn (the engine request is closed), or takes
    back a turn that was generated but not wholly delivered: a streamed turn is recorded whole or not at all.
    """

    media_type = "text/event-stream"

    def __init__(self, session: Session, adapter: WireAdapter, req: TurnRequest):
        # Not Response.__init__: it would declare a Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.session, self.adapter, self.req = session, adapter, req
        # Lists of reply parts from the turn, then None when the turn is over.
        self.parts: asyncio.Queue[list[ReplyPart] | None] = asyncio.Queue()
        self.task = session.start_turn(req, self.parts.put_nowait)
        self.task.add_done_callback(lambda _task: self.parts.put_nowait(None))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        gone = asyncio.create_task(_client_gone(receive))
        getter: asyncio.Task[list[ReplyPart] | None] | None = None
        opened = delivered = False
        result: TurnResult | None = None
        state = StreamState()
        try:
            wait = STREAM_OPEN_AFTER_S
            while True:
                getter = getter or asyncio.create_task(self.parts.get())
                done, _ = await asyncio.wait({getter, gone}, timeout=wait, return_when=asyncio.FIRST_COMPLETED)
                if gone in done:
                    return
                parts = getter.result() if getter in done else []
                if getter in done:
                    getter = None
                    if parts is None:
                        break
                if not opened:
                    await self._open(send)
                    opened = True
                    events = self.adapter.stream_head(self.req)
                else:
                    events = [] if parts else [self.adapter.stream_ping()]
                for event in [*events, *self.adapter.stream_parts(self.req, parts, state)]:
                    await self._body(send, event)
                wait = KEEP_ALIVE_S
            try:
                result = await self.session.outcome(self.task)
            except WireError as e:
                metrics.PROXY_ERRORS.labels(self.adapter.protocol, e.kind).inc()
                if not opened:
                    await json_response(self.adapter.error_body(e), e.status)(scope, receive, send)
                    return
                await self._body(send, self.adapter.stream_error(e))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if not opened:
                await self._open(send)
                for event in self.adapter.stream_head(self.req):
                    await self._body(send, event)
            for event in self.adapter.stream_end(self.req, result.reply, state):
                await self._body(send, event)
            if gone.done():
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            delivered = True
        finally:
            gone.cancel()
            if getter is not None:
                getter.cancel()
            if not self.task.done():
                self.task.cancel()
                await asyncio.gather(self.task, return_exceptions=True)
            if result is not None and not delivered:
                self.session.undo(result)

    async def _open(self, send: Send) -> None:
        await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})

    @staticmethod
    async def _body(send: Send, chunk: bytes) -> None:
        await send({"type": "http.response.body", "body": chunk, "more_body": True})


SessionEndpoint = Callable[[Request, SessionManager, str], Awaitable[Response]]
# (what follows `/sessions/{session_id}/v1/`) -> (method, endpoint)
SESSION_API: dict[str, tuple[str, SessionEndpoint]] = {
    "chat/completions": ("POST", functools.partial(_turn, adapter=OPENAI)),
    "messages": ("POST", functools.partial(_turn, adapter=ANTHROPIC)),
    "messages/count_tokens": ("POST", _count_tokens),
    "models": ("GET", _models),
}
_SESSION_PATH = re.compile(r"^/sessions/(?P<session_id>[^/]+)/v1/(?P<endpoint>.+?)/?$")


class SessionApi:
    """Serves each session's OpenAI and Anthropic endpoints (`/sessions/{id}/v1/...`) ahead of FastAPI.

    The server's app (`server.app.BufferApp`) hands every HTTP request here first; other requests go on to
    FastAPI. These endpoints answer every outcome in their protocol's shape and check the session's key
    themselves, so FastAPI's stack is skipped: its error and telemetry layers, the bearer check and the agent
    socket's gate (both of which let the session API through), its router (which tries every route's pattern in
    turn) and its request wrapper. They cost several percent of the buffer's CPU per proxied turn
    (bench/proxy.py). The body cap (`BodyLimitMiddleware` in FastAPI's stack) is applied here too, refused in the
    protocol's shape: a declared length over it before anything is read, a body sent in chunks once it grows
    past it.
    """

    def __init__(self, app: ASGIApp, state: Any, max_body_bytes: int):
        self.app = app
        self.state = state
        self.max_body_bytes = max_body_bytes
        self._too_large = f"request body exceeds {max_body_bytes} bytes"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = _SESSION_PATH.match(scope["path"])
        route = SESSION_API.get(match["endpoint"]) if match is not None else None
        if match is None or route is None:
            await self.app(scope, receive, send)
            return
        method, endpoint = route
        if scope["method"] != method:
            response = error_response(405, f"{match['endpoint']} takes {method}")
            response.headers["allow"] = method
        elif (declared_length(scope) or 0) > self.max_body_bytes:
            response = _error(_adapter_of(match["endpoint"], scope), WireError("too_large", self._too_large))
        else:
            receive = capped(receive, self.max_body_bytes, lambda: WireError("too_large", self._too_large))
            response = await endpoint(Request(scope, receive), self.state.sessions, match["session_id"])
        await response(scope, receive, send)
