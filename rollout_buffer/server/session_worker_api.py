"""What a session worker serves besides its sessions' API: the buffer's calls (placements, runs opened and
ended, sessions for generators, journals, the outbox, restores, finishes and views) and a harness's finish.
Every route reads the worker from `app.state.worker` (`SessionWorker`)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

from fastapi import APIRouter, HTTPException, Request, WebSocket, WebSocketDisconnect
from fastapi.responses import Response
from pydantic import BaseModel, Field

from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.encoded import EncodedRecord
from rollout_buffer.delivery.store import StoreError
from rollout_buffer.generation.resources import close_resources, run_resources
from rollout_buffer.proxy.journal import load_sessions
from rollout_buffer.proxy.manager import SessionManager
from rollout_buffer.proxy.outbox import Outbox
from rollout_buffer.proxy.placements import Arrivals, Placement
from rollout_buffer.proxy.recovery import StoredSummary
from rollout_buffer.proxy.session_backend import SessionError
from rollout_buffer.proxy.worker_run import BufferLink, WorkerRun
from rollout_buffer.schemas import DiscardSessionRequest, FinishSessionRequest, StartRolloutRequest
from rollout_buffer.server.bodies import error_response, json_response, parse_body, validated
from rollout_buffer.server.proxy_routes import FINISH_BODY, restoring

log = logging.getLogger(__name__)


class SessionWorker:
    """What a session worker holds: its sessions, the runs open on it, the link that hands records to the buffer
    (through an outbox on disk) and the placements arriving from the buffer."""

    def __init__(self, config: ServerConfig, index: int, buffer_url: str, secret: str):
        self.config = config
        self.index = index
        self.outbox = Outbox(config.data_dir / "outbox")
        self.outbox.load()
        self.link = BufferLink(buffer_url, index, secret, config.auth_token, config.session_worker_batch_ms / 1000,
                               self.outbox, config.max_body_bytes)
        self.sessions = SessionManager(config)
        self.local = self.sessions.local  # a worker's sessions are all in its own process
        self.local.restoring = True  # until the buffer has said which stored sessions come back
        self.runs: dict[str, WorkerRun] = {}
        self.building: dict[str, asyncio.Task[WorkerRun]] = {}
        self.arrivals = Arrivals(self.open_placed,
                                 lambda sid: sid in self.local.sessions or sid in self.local.closed, index)

    async def start(self) -> None:
        """Start handing records to the buffer and expiring sessions."""
        self.link.start()
        self.sessions.start()
        log.info("session worker %d ready on %s (sessions in %s)", self.index, self.config.local_url,
                 self.config.data_dir)

    async def stop(self) -> None:
        """The buffer stops: sessions stay stored, restored by the next worker."""
        await self.sessions.stop()
        for run in self.runs.values():
            await close_resources(run.resources)
        await self.link.aclose()

    async def open_placed(self, placement: Placement) -> str | None:
        """Open the session the buffer placed here; why not, told to the buffer too, when it cannot be."""
        run = self.runs.get(placement.run_id)
        if run is None:
            why = f"run {placement.run_id} is not open on session worker {self.index}"
        else:
            try:
                await self.local.open_harness(run, placement.instance_id, placement.metadata,
                                                 placement.public_url, placement.repeat, placement.session_id,
                                                 placement.api_key)
                return None
            except (SessionError, StoreError) as e:
                why = str(e)
            except Exception as e:  # a bug must not end the stream (every placement after it would wait for it)
                log.exception("session %s: opening it failed", placement.session_id)
                why = f"internal error: {type(e).__name__}: {e}"
        self.link.event({"kind": "unplaced", "session_id": placement.session_id, "reason": why})
        return why

    async def run_of(self, run_id: str) -> WorkerRun:
        """The run open here (409 when it is not)."""
        run = self.runs.get(run_id)
        if run is None:
            raise HTTPException(409, f"run_id: run {run_id} is not open on session worker {self.index}")
        return run

    async def build(self, run_id: str, payload: dict[str, Any]) -> WorkerRun:
        """Open a run here from its start payload: its engine client and tokenizer."""
        req = StartRolloutRequest.model_validate(payload)
        run = WorkerRun(await run_resources(run_id, req, images_root=self.config.image_dir,
                                            max_image_bytes=self.config.max_image_bytes,
                                            image_url_hosts=self.config.policy.image_url_hosts), self.link)
        self.runs[run_id] = run
        return run


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


router = APIRouter()


@router.api_route("/healthz", methods=["GET", "POST"])
async def healthz(request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    return json_response({"ok": True, "worker": w.index, "sessions": len(w.local.sessions),
                          "waiting": w.arrivals.waiting()})


@router.post("/worker/runs/{run_id}/open")
async def open_run(run_id: str, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    if run_id not in w.building:
        w.building[run_id] = asyncio.create_task(w.build(run_id, await request.json()))
    try:
        await asyncio.shield(w.building[run_id])
    except Exception as e:
        w.building.pop(run_id, None)
        raise HTTPException(422, f"run {run_id} could not be opened on session worker {w.index}: {e}") from None
    return json_response({"success": True, "run_id": run_id})


@router.post("/worker/runs/{run_id}/end")
async def end_run(run_id: str, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    w.building.pop(run_id, None)
    run = w.runs.pop(run_id, None)
    await w.sessions.end_run(run_id)  # its open sessions closed as failed, their records handed over
    await w.link.flush()  # the buffer ends the run once it stored them
    if run is not None:
        await close_resources(run.resources)
    return json_response({"success": True, "run_id": run_id})


@router.websocket("/worker/placements")
async def placements(ws: WebSocket) -> None:
    """The buffer's placements of harness sessions, one per message, until it closes the stream."""
    w: SessionWorker = ws.app.state.worker
    await ws.accept()
    with contextlib.suppress(WebSocketDisconnect):
        while True:
            await w.arrivals.arrive(await ws.receive_text())


@router.post("/worker/generator-sessions")
async def open_generator(body: OpenGeneratorSession, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    run = await w.run_of(body.run_id)
    session = await w.sessions.open_for_actor(run, body.uid, body.instance_id, body.epoch, body.repeat,
                                            body.metadata, body.public_url)
    return json_response({"session_id": session.session_id, "base_url": session.base_url,
                          "anthropic_base_url": session.anthropic_base_url, "api_key": session.api_key,
                          "agent_socket": session.agent_socket})


@router.post("/worker/sessions/{session_id}/transcript")
async def transcript(session_id: str, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    return json_response({"messages": await w.local.for_actor(session_id).transcript()})


@router.post("/worker/sessions/{session_id}/close")
async def close(session_id: str, body: FinishSessionRequest, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    try:
        records = await w.sessions.close_for_actor(session_id, body.reward, body.extra_info)
    except ValueError as e:  # closed all the same; the generator fails its trajectory
        return error_response(409, str(e), {"error_kind": "empty_session"})
    return json_response({"success": True, "records": records})


@router.post("/worker/sessions/{session_id}/discard")
async def discard(session_id: str, body: DiscardSessionRequest, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    await w.sessions.discard_for_actor(session_id, body.reason)
    return json_response({"success": True})


@router.post("/worker/journal")
async def journal(request: Request) -> Response:
    """The sessions stored here, and the episodes of the records the last process left in the outbox."""
    w: SessionWorker = request.app.state.worker
    stored = await asyncio.to_thread(load_sessions, w.local.files)
    held = [key for p in w.outbox.unstored.values() if p.held for key in p.episodes()]
    finished = {uid for _, _, uid in held}
    for s in stored:
        if s.uid in finished:  # killed between writing its records and letting its journal go: finished
            w.local.files.remove(s.session_id)
    return json_response({"sessions": [StoredSummary.of(s).__dict__ for s in stored if s.uid not in finished],
                          "outbox": held})


@router.post("/worker/outbox")
async def checked(body: CheckedOutbox, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    w.link.resend(set(body.stored))
    return json_response({"success": True})


@router.post("/worker/outbox/drain")
async def drain(request: Request) -> Response:
    """The buffer stops: the records waiting in the outbox, for it to store (they stay on disk, and the next
    process finds them stored)."""
    w: SessionWorker = request.app.state.worker
    await w.link.pause()
    return json_response({"parcels": [p.wire() for p in w.outbox.take()]})


@router.post("/worker/restore")
async def restore(body: RestoreSessions, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    failed: dict[str, str] = {}
    if body.restore:
        if body.run_id is None:
            raise HTTPException(422, "run_id: required to restore sessions")
        run = await w.run_of(body.run_id)
        wanted = set(body.restore)
        stored = [s for s in await asyncio.to_thread(load_sessions, w.local.files) if s.session_id in wanted]
        failed = w.local.restore(run, run.resources, stored)
        failed |= {sid: f"session {sid} is not stored on session worker {w.index}"
                   for sid in wanted - {s.session_id for s in stored}}
    for session_id in body.remove:
        w.local.files.remove(session_id)
    w.local.restoring = False
    return json_response({"success": True, "failed": failed})


@router.post("/worker/sessions/{session_id}/finish")
async def finish(session_id: str, body: FinishSessionRequest, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    await w.arrivals.wait(session_id)
    summary, records = await w.local.hand_over(session_id, body.reward, body.extra_info)
    return json_response({"success": True, "summary": summary,
                          "records": [EncodedRecord.of(r).wire() for r in records]})


@router.post("/sessions/{session_id}/finish")  # a harness finishes here, at its session's `finish_url`
async def finish_here(session_id: str, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    body = validated(FINISH_BODY, parse_body(await request.body()))
    if w.local.restoring and session_id not in w.local.sessions:
        raise HTTPException(503, restoring(session_id))
    await w.arrivals.wait(session_id)
    if session_id in w.arrivals.refused:
        raise HTTPException(409, f"session {session_id} could not be opened: {w.arrivals.refused[session_id]}")
    stored = await w.sessions.finish(session_id, body.reward, body.extra_info)  # records in the outbox
    return json_response({"success": True, **stored})


@router.post("/worker/sessions/released")
async def released(body: ReleaseSessions, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    w.local.released(body.session_ids)
    return json_response({"success": True})


@router.post("/worker/sessions/list")
async def list_sessions(body: ListSessions, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    return json_response({"sessions": await w.sessions.list(body.run_id)})


@router.post("/worker/sessions/{session_id}/view")
async def view(session_id: str, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    await w.arrivals.wait(session_id)
    found = await w.sessions.view(session_id)
    if found is None:
        raise HTTPException(404, f"session_id: unknown session {session_id!r}")
    return json_response(found)


@router.head("/sessions/{session_id}")  # Claude Code probes its base URL (a session's `anthropic_base_url`)
async def probe(session_id: str, request: Request) -> Response:
    w: SessionWorker = request.app.state.worker
    await w.arrivals.wait(session_id)
    if session_id not in w.local.sessions:
        raise HTTPException(404, f"session_id: unknown session {session_id!r}")
    return Response(status_code=200)
