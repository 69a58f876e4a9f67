"""HTTP routes of the agent proxy: sessions (`/sessions`, `/sessions/{id}`, `/sessions/{id}/finish`), the
sessions Ray actors open for their trajectories (`POST /sessions` with `kind: generator`, `/sessions/{id}/close`,
`/discard`, `/transcript`) and each session's OpenAI and Anthropic endpoints under `/sessions/{id}/v1/`.

The session endpoints answer in their protocol's shapes (errors included); the session-management endpoints
in slime's (`{"success", "message"}`). A streamed turn is an SSE response that waits for the turn while
sending the reply's parts as the engine generates them (keep-alives while none come), and takes the turn back
when the client hangs up before the stream's end.

Every request to a session's API gets one access line (logger `rollout_buffer.access`, at the level
`serve --access-log` sets); every 4xx/5xx it answers is logged at WARNING with its reason and counted in
`rollout_buffer_proxy_errors_total{protocol, reason}`, so that an agent's failing requests show on the buffer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response
from pydantic import TypeAdapter
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.generation.run_manager import RunManager
from rollout_buffer.observability import logs, metrics
from rollout_buffer.proxy.adapter import StreamState, WireAdapter
from rollout_buffer.proxy.anthropic_messages import AnthropicMessagesAdapter
from rollout_buffer.proxy.image_urls import fetch_image_urls
from rollout_buffer.proxy.local_backend import LocalBackend
from rollout_buffer.proxy.manager import SessionManager
from rollout_buffer.proxy.messages import WireError
from rollout_buffer.proxy.openai_chat import OpenAIChatAdapter
from rollout_buffer.proxy.openai_responses import OpenAIResponsesAdapter
from rollout_buffer.proxy.placements import Arrivals
from rollout_buffer.proxy.replies import ReplyPart
from rollout_buffer.proxy.request_bodies import BodyCache
from rollout_buffer.proxy.session import Session, SessionKind, TurnRequest, TurnResult
from rollout_buffer.schemas import (
    DiscardSessionRequest,
    FinishSessionRequest,
    OpenGeneratorSessionRequest,
    OpenSessionRequest,
)
from rollout_buffer.server.bodies import documented_body, error_response, json_response, parse_body, validated
from rollout_buffer.server.guards import SESSION_API_PATH, BodyTooLarge, Guards

log = logging.getLogger(__name__)

OPEN_BODY: TypeAdapter[OpenSessionRequest] = TypeAdapter(OpenSessionRequest)
OPEN_GENERATOR_BODY: TypeAdapter[OpenGeneratorSessionRequest] = TypeAdapter(OpenGeneratorSessionRequest)
DISCARD_BODY: TypeAdapter[DiscardSessionRequest] = TypeAdapter(DiscardSessionRequest)
FINISH_BODY: TypeAdapter[FinishSessionRequest] = TypeAdapter(FinishSessionRequest)
OPENAI = OpenAIChatAdapter()
ANTHROPIC = AnthropicMessagesAdapter()
RESPONSES = OpenAIResponsesAdapter()
# A stream opens once the turn has taken this long (quick refusals still get a plain error response), then
# sends a keep-alive at this interval while the turn is generated.
STREAM_OPEN_AFTER_S = 0.25
KEEP_ALIVE_S = 10.0
LANE_MAX_CHARS = 256  # an X-Session-ID longer than this is cut (it only names a conversation)


def mount_proxy(app: FastAPI) -> None:
    """Add the agent-session routes to `app`; `app.state.sessions` (a SessionManager) serves them."""

    def manager(request: Request) -> SessionManager:
        sessions: SessionManager = request.app.state.sessions  # Starlette's State holds Any
        return sessions

    @app.post("/sessions", summary="Open an agent session in the running agent run (a harness's, or a Ray actor's)",
              openapi_extra=documented_body({"oneOf": [OpenSessionRequest.model_json_schema(),
                                                       OpenGeneratorSessionRequest.model_json_schema()]},
                                            required=True))
    async def open_session(request: Request) -> Response:
        raw = parse_body(await request.body())
        if isinstance(raw, dict) and raw.get("kind") == SessionKind.GENERATOR:
            return await _open_for_actor(request, validated(OPEN_GENERATOR_BODY, raw))
        body = validated(OPEN_BODY, raw)
        run = _agent_run(request, body.run_id)
        opened = await manager(request).place(run, body.instance_id, body.metadata, lambda: str(request.base_url),
                                              near=body.node)
        # Where the harness finishes it: the session's own root (`anthropic_base_url`), on the process holding
        # it; on a session worker that spares the buffer a round trip per session (the records reach it batched).
        finish_url = f"{opened['anthropic_base_url']}/finish"
        return json_response({"success": True, **opened, "finish_url": finish_url, "run_id": run.run_id,
                              "instance_id": body.instance_id})

    async def _open_for_actor(request: Request, body: OpenGeneratorSessionRequest) -> Response:
        run = _agent_run(request, body.run_id, any_task=True)
        if run.input_path is None:
            raise HTTPException(409, f"run_id: run {run.run_id} hosts harness sessions; it runs no agents")
        session = await manager(request).open_for_actor(run, body.uid, body.instance_id, body.epoch, body.repeat,
                                                        body.metadata, str(request.base_url),
                                                        near=body.node)
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
        return json_response({"session_id": session_id, "messages": await manager(request).transcript(session_id)})

    @app.post("/sessions/{session_id}/finish", summary="Close a harness session with its reward; store its records",
              openapi_extra=documented_body(FinishSessionRequest.model_json_schema(), required=True))
    async def finish_session(session_id: str, request: Request) -> Response:
        body = validated(FINISH_BODY, parse_body(await request.body()))
        stored = await manager(request).finish(session_id, body.reward, body.extra_info)
        return json_response({"success": True, **stored})

    @app.get("/sessions", summary="Open agent sessions (of one run)")
    async def list_sessions(request: Request, run_id: str | None = None) -> Response:
        return json_response({"sessions": await manager(request).list(run_id)})

    # HEAD too: Claude Code probes its base URL (a session's `anthropic_base_url`) before its first request.
    @app.api_route("/sessions/{session_id}", methods=["GET", "HEAD"],
                   summary="One session: state and branch tree (open or recently closed)")
    async def session_view(session_id: str, request: Request) -> Response:
        view = await manager(request).view(session_id)
        if view is None:
            raise HTTPException(404, f"session_id: unknown session {session_id!r}")
        return json_response(view)


# ---- the session API: what agents call on every turn -----------------------------------------------------------

# The session API's endpoints raise WireError for what they refuse; `SessionApi` answers it in the protocol's
# shape, logs and counts it.

# The session API's kind of each status the request gate answers (`Guards.refusal`).
_REFUSAL_KINDS = {401: "authentication", 403: "permission", 415: "media_type"}


class Refusal(WireError):
    """A WireError whose reason (the `proxy_errors` label) is decided where it is raised: its kind alone cannot
    tell, e.g. an unknown session from one closed during the turn (both `not_found`)."""

    def __init__(self, reason: str, kind: str, message: str):
        super().__init__(kind, message)
        self.reason = reason


# The reason of a WireError raised without one, by kind (a session found closed once the turn started: `not_found`).
KIND_REASONS = {
    "invalid_request": "bad_request", "context_length": "context_length", "authentication": "unauthorized",
    "not_found": "session_closed", "too_large": "body_too_large", "server": "server_error", "engine": "engine_error",
    "restoring": "restoring",
}
CLIENT_GONE = "the client hung up before the reply; the turn was taken back"


def reason_of(err: WireError) -> str:
    """The bounded label naming why the proxy refused or failed a request."""
    return err.reason if isinstance(err, Refusal) else KIND_REASONS.get(err.kind, "server_error")


async def _count_tokens(request: Request, session: Session) -> Response:
    req = ANTHROPIC.parse(await _request_body(request, session))
    return json_response({"input_tokens": await session.count_tokens(req)})


async def _models(request: Request, session: Session) -> Response:
    return json_response(_adapter_of("models", request.scope).models(session.options.model_name))


def _adapter_of(endpoint: str, scope: Scope) -> WireAdapter:
    """The protocol a session endpoint answers in. `models`, and a route the proxy does not serve, answer in the
    client's: Anthropic's clients send `anthropic-version`."""
    if endpoint.startswith("messages"):
        return ANTHROPIC
    if endpoint == "responses":
        return RESPONSES
    if endpoint != "chat/completions" and any(name == b"anthropic-version" for name, _ in scope["headers"]):
        return ANTHROPIC
    return OPENAI


def _agent_run(request: Request, run_id: str | None, any_task: bool = False) -> Any:
    """The running agent run (the one `run_id` names, when given; with `any_task`, a run of any task type: an
    environment's episodes in Ray actors open sessions too); 409 naming run_id otherwise."""
    runs: RunManager = request.app.state.runs
    run = runs.current
    if run is None or run.task is None or run.task.done():
        raise HTTPException(409, "run_id: no run is running; start one with task_type agent")
    if run_id is not None and run_id != run.run_id:
        raise HTTPException(409, f"run_id: {run_id!r} is not the running run ({run.run_id})")
    if run.req.task_type != "agent" and not any_task:
        raise HTTPException(409, f"run_id: the running run is task_type {run.req.task_type!r}, not agent")
    return run


def restoring(session_id: str) -> str:
    """Why a session worker that started again answers "send it again" for a session it does not hold yet."""
    return (f"session {session_id} may be among the sessions this worker is restoring after a restart; "
            "send the request again")


async def arrival(state: Any, session_id: str) -> None:
    """On a session worker, wait for the placement of a session it does not hold (`proxy.placements`); Refusal
    naming why when the worker could not open it, or it was placed on another worker."""
    arrivals: Arrivals | None = getattr(state, "arrivals", None)
    if arrivals is None:
        return
    why = await arrivals.wait(session_id)
    if why is not None:
        raise Refusal("unknown_session", "not_found", f"session {session_id} {why}")


def _session(scope: Scope, sessions: LocalBackend, guards: Guards, session_id: str) -> Session:
    """The session, once the request proved it may drive it (`Guards.session_key_ok`: the session's own key or the
    server token)."""
    try:
        session = sessions.get(session_id)
    except WireError as e:
        if sessions.restoring:  # a session worker started again: its sessions come back from their journals
            raise WireError("restoring", restoring(session_id)) from None
        raise Refusal("session_closed" if session_id in sessions.closed else "unknown_session", e.kind,
                      e.message) from None
    if not guards.session_key_ok(scope, session.api_key):
        raise WireError("authentication", "missing or wrong API key for this session")
    return session


async def _turn(request: Request, session: Session, adapter: WireAdapter) -> Response:
    req = adapter.parse(await _request_body(request, session, adapter), session.history)
    adapter.bind(req, session)
    req.lane = _lane(request.scope)
    if req.stream:
        return TurnStream(session, adapter, req)
    task = session.start_turn(req)
    result = await _unless_client_leaves(session, task, request.receive)
    if result is None:
        return Response(status_code=499)  # nobody reads it; the turn was cancelled and taken back
    return TurnReply(adapter.response(req, result.reply), result.reply.completion_tokens)


async def _request_body(request: Request, session: Session, adapter: WireAdapter | None = None) -> Any:
    """The body parsed (a turn's with the session's body cache), its remote image URLs fetched where the operator
    allows their host (`proxy.image_urls`)."""
    raw = await request.body()
    body = _json(raw) if adapter is None else _json(raw, session.bodies, adapter.history_key)
    images = session.ctx.run.images
    if images is not None and images.url_hosts:
        await fetch_image_urls(body, images)
    return body


def _lane(scope: Scope) -> str | None:
    """The client's own id of the conversation, `X-Session-ID` (verifiers sends one per agent run), if sent."""
    for name, value in scope["headers"]:
        if name == b"x-session-id":
            return value.decode("latin-1")[:LANE_MAX_CHARS] or None
    return None


class TurnReply(Response):
    """A turn's JSON answer; it carries the tokens the turn generated, for the access line."""

    media_type = "application/json"

    def __init__(self, body: Any, new_tokens: int):
        super().__init__(orjson.dumps(body), 200)
        self.new_tokens = new_tokens


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


def _json(raw: bytes, bodies: BodyCache | None = None, history_key: str = "") -> Any:
    """The body parsed (with a session's `bodies`, reusing its previous body's parse); WireError if not JSON."""
    try:
        return parse_body(raw) if bodies is None else bodies.parse(raw, history_key)
    except Exception:
        raise WireError("invalid_request", "the body is not valid JSON") from None


class TurnStream(Response):
    """A streamed turn: the reply's parts as the engine generates them, in the protocol's events.

    The stream opens with the first part, or with keep-alives when the turn takes longer than
    `STREAM_OPEN_AFTER_S` to start; a turn that fails before it opened answers a plain error response, after
    that an error event. A client gone before the end cancels the turn (the engine request is closed), or takes
    back a turn that was generated but not wholly delivered: a streamed turn is recorded whole or not at all.
    Once sent, `status_code` is the outcome the access line reports (the error's status, also when the stream had
    opened; 499 when the client left), `error` the WireError and `new_tokens` what the delivered turn generated.
    """

    media_type = "text/event-stream"

    def __init__(self, session: Session, adapter: WireAdapter, req: TurnRequest):
        # Not Response.__init__: it would declare a Content-Length for an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers({"cache-control": "no-cache", "x-accel-buffering": "no"})
        self.session, self.adapter, self.req = session, adapter, req
        self.error: WireError | None = None
        self.new_tokens = 0
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
                    self.status_code = 499
                    return
                parts: list[ReplyPart] = []
                if getter in done:
                    got, getter = getter.result(), None
                    if got is None:
                        break
                    parts = got
                if not opened:
                    await self._open(send)
                    opened = True
                    events = self.adapter.stream_head(self.req, state)
                else:
                    events = [] if parts else [self.adapter.stream_ping()]
                for event in [*events, *self.adapter.stream_parts(self.req, parts, state)]:
                    await self._body(send, event)
                wait = KEEP_ALIVE_S
            try:
                result = await self.session.outcome(self.task)
            except WireError as e:
                self.error, self.status_code = e, e.status
                if not opened:
                    await json_response(self.adapter.error_body(e), e.status)(scope, receive, send)
                    return
                await self._body(send, self.adapter.stream_error(self.req, e, state))
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            if not opened:
                await self._open(send)
                for event in self.adapter.stream_head(self.req, state):
                    await self._body(send, event)
            for event in self.adapter.stream_end(self.req, result.reply, state):
                await self._body(send, event)
            if gone.done():
                self.status_code = 499
                return
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            delivered = True
            self.new_tokens = result.reply.completion_tokens
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


SessionEndpoint = Callable[[Request, Session], Awaitable[Response]]
# (what follows `/sessions/{session_id}/v1/`) -> (method, endpoint)
SESSION_API: dict[str, tuple[str, SessionEndpoint]] = {
    "chat/completions": ("POST", functools.partial(_turn, adapter=OPENAI)),
    "responses": ("POST", functools.partial(_turn, adapter=RESPONSES)),
    "messages": ("POST", functools.partial(_turn, adapter=ANTHROPIC)),
    "messages/count_tokens": ("POST", _count_tokens),
    "models": ("GET", _models),
}


class SessionApi:
    """Serves each session's OpenAI and Anthropic endpoints (`/sessions/{id}/v1/...`) ahead of FastAPI.

    The server's app (`server.app.BufferApp`) hands every HTTP request here first; other requests go on to
    FastAPI. These endpoints answer every outcome in their protocol's shape and check the session's key
    themselves, so FastAPI's stack is skipped: its error and telemetry layers, its request gate, its router (which
    tries every route's pattern in turn) and its request wrapper. They cost several percent of the buffer's CPU per
    proxied turn (bench/proxy.py). The security checks are the ones FastAPI's middleware applies (`server.guards`,
    the same `Guards`), refused here in the protocol's shape: the request gate (`Guards.refusal`: JSON bodies, no
    foreign Origin), the body cap (a declared length over it before anything is read, a body sent in chunks once it
    grows past it) and the session's key (`Guards.session_key_ok`, with or without a server token). A route no
    session serves is refused here too (404 in the client's protocol), so that it is logged and counted like every
    other refusal of the session API.
    """

    def __init__(self, app: ASGIApp, state: Any, guards: Guards):
        self.app = app
        self.state = state
        self.guards = guards

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        match = SESSION_API_PATH.match(scope["path"])
        if match is None:
            await self.app(scope, receive, send)
            return
        started = time.perf_counter()
        name, session_id = match["endpoint"], match["session_id"]
        adapter = _adapter_of(name, scope)
        route = SESSION_API.get(name)
        error: WireError | None = None
        receive = self.guards.capped(receive)
        try:  # inline, not a helper coroutine: the hot path allocates nothing the access line does not need
            if (refused := self.guards.refusal(scope)) is not None:
                raise Refusal("refused", _REFUSAL_KINDS.get(refused.status, "permission"), refused.message)
            if route is None:
                raise Refusal("unknown_route", "not_found", f"no route {name!r} under /sessions/{{session_id}}/v1/; "
                              f"a session serves {', '.join(SESSION_API)}")
            if scope["method"] != route[0]:
                response = error_response(405, f"{name} takes {route[0]}")
                response.headers["allow"] = route[0]
            else:
                self.guards.check_declared_length(scope)
                local = self.state.sessions.local
                if session_id not in local.sessions and not local.restoring:
                    await arrival(self.state, session_id)
                session = _session(scope, local, self.guards, session_id)
                response = await route[1](Request(scope, receive), session)
        except BodyTooLarge as e:
            error = WireError("too_large", e.detail)
            response = json_response(adapter.error_body(error), error.status)
        except WireError as e:
            error, response = e, json_response(adapter.error_body(e), e.status)
        except Exception as e:  # a bug must still answer in the client's protocol
            log.exception("session %s: %s request to %s failed", session_id, adapter.protocol, name)
            error = WireError("server", f"internal error: {type(e).__name__}: {e}")
            response = json_response(adapter.error_body(error), error.status)
        try:
            await response(scope, receive, send)
        except Exception as e:
            _account(session_id, adapter, name, 500, WireError("server", f"answering failed: {e!r}"), 0, started)
            raise
        new_tokens = 0
        if isinstance(response, TurnStream):
            error, new_tokens = response.error, response.new_tokens
        elif isinstance(response, TurnReply):
            new_tokens = response.new_tokens
        _account(session_id, adapter, name, response.status_code, error, new_tokens, started)


def _account(session_id: str, adapter: WireAdapter, name: str, status: int, error: WireError | None,
             new_tokens: int, started: float) -> None:
    """The access line of one session API request and, for a 4xx/5xx, its WARNING and `proxy_errors` count.

    The success path costs one `isEnabledFor` and, when enabled, one log call."""
    if status >= 400:
        if error is not None:
            reason, message = reason_of(error), error.message
        elif status == 499:
            reason, message = "client_gone", CLIENT_GONE
        else:  # the only other answer built without a WireError: 405
            reason, message = "method_not_allowed", f"{name} takes {SESSION_API[name][0]}"
        metrics.PROXY_ERRORS.labels(adapter.protocol, reason).inc()
        log.warning("session=%s protocol=%s route=%s status=%d reason=%s: %s", session_id, adapter.protocol, name,
                    status, reason, message)
    level = logs.access_level
    if logs.access.isEnabledFor(level):
        logs.access.log(level, "session=%s protocol=%s route=%s status=%d new_tokens=%d ms=%.1f", session_id,
                        adapter.protocol, name, status, new_tokens, (time.perf_counter() - started) * 1000)
