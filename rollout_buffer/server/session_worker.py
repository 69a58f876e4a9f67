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
import asyncio
import contextlib
import gc
import hmac
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import setproctitle
from fastapi import FastAPI, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response
from pydantic import BaseModel, Field
from starlette.types import ASGIApp, Receive, Scope, Send

from rollout_buffer.config import AUTH_TOKEN_ENV, DEFAULT_MAX_BODY_BYTES, ServerConfig
from rollout_buffer.delivery.encoded import EncodedRecord
from rollout_buffer.delivery.store import StoreError
from rollout_buffer.generation.resources import close_resources, run_resources
from rollout_buffer.observability.logs import ACCESS_LOG_MODES, setup_logging
from rollout_buffer.proxy.journal import load_sessions
from rollout_buffer.proxy.manager import SessionError, SessionManager
from rollout_buffer.proxy.outbox import Outbox
from rollout_buffer.proxy.placements import Arrivals, Placement
from rollout_buffer.proxy.recovery import StoredSummary
from rollout_buffer.proxy.worker_run import WORKER_SECRET_ENV, WORKER_SECRET_HEADER, BufferLink, WorkerRun
from rollout_buffer.schemas import DiscardSessionRequest, FinishSessionRequest, StartRolloutRequest
from rollout_buffer.server.app import BufferApp, answer_errors_as_slime
from rollout_buffer.server.bodies import error_response, json_response, parse_body, validated
from rollout_buffer.server.guards import Guards, is_session_api
from rollout_buffer.server.listeners import agent_socket, tcp_listener
from rollout_buffer.server.middleware import BodyLimitMiddleware, RequestGate
from rollout_buffer.server.proxy_routes import FINISH_BODY, restoring
from rollout_buffer.tokens.tokenizer import keep_torch_out

log = logging.getLogger(__name__)


class OpenGeneratorSession(BaseModel):
    """`POST /worker/generator-sessions`: a session for one trajectory a generator runs in the buffer."""

    run_id: str
    uid: str
    instance_id: str
    epoch: int
    repeat: int
    public_url: str
    metadata: dict[str, Any] = Field(default_factory=dict)


class CheckedOutbox(BaseModel):
    """`POST /worker/outbox`: of the parcels the worker's last process left, the episode uids the buffer stored."""

    stored: list[str]


class ReleaseSessions(BaseModel):
    """`POST /worker/sessions/released`: sessions whose records the buffer stored (their journals go)."""

    session_ids: list[str]


class ListSessions(BaseModel):
    """`POST /worker/sessions/list`: the open sessions (of one run)."""

    run_id: str | None = None


class RestoreSessions(BaseModel):
    """`POST /worker/restore`: what the buffer decided for this worker's stored sessions."""

    run_id: str | None = None
    restore: list[str] = Field(default_factory=list)
    remove: list[str] = Field(default_factory=list)


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
    outbox = Outbox(config.data_dir / "outbox")
    outbox.load()
    link = BufferLink(buffer_url, index, secret, config.auth_token, config.session_worker_batch_ms / 1000, outbox,
                      config.max_body_bytes)
    sessions = SessionManager(config)
    sessions.restoring = True  # until the buffer has said which stored sessions come back (`/worker/restore`)
    runs: dict[str, WorkerRun] = {}
    building: dict[str, asyncio.Task[WorkerRun]] = {}

    async def open_placed(placement: Placement) -> str | None:
        run = runs.get(placement.run_id)
        if run is None:
            why = f"run {placement.run_id} is not open on session worker {index}"
        else:
            try:
                await sessions.open_harness(run, placement.instance_id, placement.metadata, placement.public_url,
                                            placement.repeat, placement.session_id, placement.api_key)
                return None
            except (SessionError, StoreError) as e:
                why = str(e)
            except Exception as e:  # a bug must not end the stream (every placement after it would wait for it)
                log.exception("session %s: opening it failed", placement.session_id)
                why = f"internal error: {type(e).__name__}: {e}"
        link.event({"kind": "unplaced", "session_id": placement.session_id, "reason": why})
        return why

    arrivals = Arrivals(open_placed, lambda sid: sid in sessions.sessions or sid in sessions.closed, index)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        link.start()
        sessions.start()
        log.info("session worker %d ready on %s (sessions in %s)", index, config.local_url, config.data_dir)
        try:
            yield
        finally:
            await sessions.stop()  # the buffer stops: sessions stay stored, restored by the next worker
            for run in runs.values():
                await close_resources(run.resources)
            await link.aclose()

    guards = Guards.of(config)
    app = BufferApp(guards, title=f"rollout-buffer session worker {index}", lifespan=lifespan, openapi_url=None,
                    docs_url=None, redoc_url=None)
    app.state.sessions = sessions
    app.state.arrivals = arrivals
    app.add_middleware(BodyLimitMiddleware, guards=guards)
    app.add_middleware(WorkerSecret, secret=secret, guards=guards)

    answer_errors_as_slime(app)

    async def run_of(run_id: str) -> WorkerRun:
        run = runs.get(run_id)
        if run is None:
            raise HTTPException(409, f"run_id: run {run_id} is not open on session worker {index}")
        return run

    async def build(run_id: str, payload: dict[str, Any]) -> WorkerRun:
        req = StartRolloutRequest.model_validate(payload)
        run = WorkerRun(await run_resources(run_id, req), link)
        runs[run_id] = run
        return run

    @app.api_route("/healthz", methods=["GET", "POST"])
    async def healthz() -> Response:
        return json_response({"ok": True, "worker": index, "sessions": len(sessions.sessions)})

    @app.post("/worker/runs/{run_id}/open")
    async def open_run(run_id: str, request: Request) -> Response:
        if run_id not in building:
            building[run_id] = asyncio.create_task(build(run_id, await request.json()))
        try:
            await asyncio.shield(building[run_id])
        except Exception as e:
            building.pop(run_id, None)
            raise HTTPException(422, f"run {run_id} could not be opened on session worker {index}: {e}") from None
        return json_response({"success": True, "run_id": run_id})

    @app.post("/worker/runs/{run_id}/end")
    async def end_run(run_id: str) -> Response:
        building.pop(run_id, None)
        run = runs.pop(run_id, None)
        await sessions.end_run(run_id)  # its open sessions closed as failed, their records handed over
        await link.flush()  # the buffer ends the run once it stored them
        if run is not None:
            await close_resources(run.resources)
        return json_response({"success": True, "run_id": run_id})

    @app.websocket("/worker/placements")
    async def placements(ws: WebSocket) -> None:
        """The buffer's placements of harness sessions, one per message, until it closes the stream."""
        await ws.accept()
        with contextlib.suppress(WebSocketDisconnect):
            while True:
                await arrivals.arrive(await ws.receive_text())

    @app.post("/worker/generator-sessions")
    async def open_generator(body: OpenGeneratorSession) -> Response:
        run = await run_of(body.run_id)
        session = await sessions.open_for_actor(run, body.uid, body.instance_id, body.epoch, body.repeat,
                                                body.metadata, body.public_url)
        return json_response({"session_id": session.session_id, "base_url": session.base_url,
                              "anthropic_base_url": session.anthropic_base_url, "api_key": session.api_key,
                              "agent_socket": session.agent_socket})

    @app.post("/worker/sessions/{session_id}/transcript")
    async def transcript(session_id: str) -> Response:
        return json_response({"messages": await sessions.for_actor(session_id).transcript()})

    @app.post("/worker/sessions/{session_id}/close")
    async def close(session_id: str, body: FinishSessionRequest) -> Response:
        try:
            records = await sessions.close_for_actor(session_id, body.reward, body.extra_info)
        except ValueError as e:  # closed all the same; the generator fails its trajectory
            return error_response(409, str(e), {"error_kind": "empty_session"})
        return json_response({"success": True, "records": records})

    @app.post("/worker/sessions/{session_id}/discard")
    async def discard(session_id: str, body: DiscardSessionRequest) -> Response:
        await sessions.discard_for_actor(session_id, body.reason)
        return json_response({"success": True})

    @app.post("/worker/journal")
    async def journal() -> Response:
        """The sessions stored here, and the episodes of the records the last process left in the outbox."""
        stored = await asyncio.to_thread(load_sessions, sessions.files)
        held = [key for p in outbox.unstored.values() if p.held for key in p.episodes()]
        finished = {uid for _, _, uid in held}
        for s in stored:
            if s.uid in finished:  # killed between writing its records and letting its journal go: finished
                sessions.files.remove(s.session_id)
        return json_response({"sessions": [StoredSummary.of(s).__dict__ for s in stored if s.uid not in finished],
                              "outbox": held})

    @app.post("/worker/outbox")
    async def checked(body: CheckedOutbox) -> Response:
        link.resend(set(body.stored))
        return json_response({"success": True})

    @app.post("/worker/outbox/drain")
    async def drain() -> Response:
        """The buffer stops: the records waiting in the outbox, for it to store (they stay on disk, and the next
        process finds them stored)."""
        await link.pause()
        return json_response({"parcels": [p.wire() for p in outbox.take()]})

    @app.post("/worker/restore")
    async def restore(body: RestoreSessions) -> Response:
        failed: dict[str, str] = {}
        if body.restore:
            if body.run_id is None:
                raise HTTPException(422, "run_id: required to restore sessions")
            run = await run_of(body.run_id)
            wanted = set(body.restore)
            stored = [s for s in await asyncio.to_thread(load_sessions, sessions.files) if s.session_id in wanted]
            failed = sessions.restore(run, run.resources, stored)
            failed |= {sid: f"session {sid} is not stored on session worker {index}"
                       for sid in wanted - {s.session_id for s in stored}}
        for session_id in body.remove:
            sessions.files.remove(session_id)
        sessions.restoring = False
        return json_response({"success": True, "failed": failed})

    @app.post("/worker/sessions/{session_id}/finish")
    async def finish(session_id: str, body: FinishSessionRequest) -> Response:
        await arrivals.wait(session_id)
        summary, records = await sessions.hand_over(session_id, body.reward, body.extra_info)
        return json_response({"success": True, "summary": summary,
                              "records": [EncodedRecord.of(r).wire() for r in records]})

    @app.post("/sessions/{session_id}/finish")  # a harness finishes here, at its session's `finish_url`
    async def finish_here(session_id: str, request: Request) -> Response:
        body = validated(FINISH_BODY, parse_body(await request.body()))
        if sessions.restoring and session_id not in sessions.sessions:
            raise HTTPException(503, restoring(session_id))
        await arrivals.wait(session_id)
        if session_id in arrivals.refused:
            raise HTTPException(409, f"session {session_id} could not be opened: {arrivals.refused[session_id]}")
        stored = await sessions.finish(session_id, body.reward, body.extra_info)  # records in the outbox
        return json_response({"success": True, **stored})

    @app.post("/worker/sessions/released")
    async def released(body: ReleaseSessions) -> Response:
        sessions.released(body.session_ids)
        return json_response({"success": True})

    @app.post("/worker/sessions/list")
    async def list_sessions(body: ListSessions) -> Response:
        return json_response({"sessions": await sessions.list(body.run_id)})

    @app.post("/worker/sessions/{session_id}/view")
    async def view(session_id: str) -> Response:
        await arrivals.wait(session_id)
        found = await sessions.view(session_id)
        if found is None:
            raise HTTPException(404, f"session_id: unknown session {session_id!r}")
        return json_response(found)

    @app.head("/sessions/{session_id}")  # Claude Code probes its base URL (a session's `anthropic_base_url`)
    async def probe(session_id: str) -> Response:
        await arrivals.wait(session_id)
        if session_id not in sessions.sessions:
            raise HTTPException(404, f"session_id: unknown session {session_id!r}")
        return Response(status_code=200)

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
        config = ServerConfig(host=args.host, port=args.port, data_dir=args.data_dir, auth_token=token,
                              max_body_bytes=args.max_body_bytes, session_worker_batch_ms=args.batch_ms,
                              agent_socket=sandboxes[0] if sandboxes is not None else None)
        app = create_worker_app(config, args.index, args.buffer_url, secret)
        gc.freeze()
        serve(app, listeners, args.log_level.lower())
