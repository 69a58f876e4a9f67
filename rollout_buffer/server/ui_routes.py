"""The dashboard: `GET /ui` (static HTML, JS and CSS shipped in `server/ui/`, no build step, nothing fetched
from elsewhere) and the read-only JSON it reads under `/ui/api/`, plus a server-sent event stream of the live
run (`/ui/api/events`).

The page and its assets carry no data and load without a token; every `/ui/api/` route is behind the server's
bearer token like the rest of the API (the page sends the token it keeps in session storage). The event
stream is read with `fetch` rather than `EventSource`, which cannot send an Authorization header.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from pathlib import Path

import orjson
from fastapi import FastAPI, HTTPException, Query, Request
from fastapi.responses import FileResponse, HTMLResponse, Response, StreamingResponse
from fastapi.staticfiles import StaticFiles

from rollout_buffer.delivery.queries import MAX_PAGE, Reader, TrajectoryFilter
from rollout_buffer.observability import metrics
from rollout_buffer.schemas import TrajectoryStatus
from rollout_buffer.server.bodies import json_response
from rollout_buffer.server.guards import UI_PREFIX
from rollout_buffer.server.token_view import token_view
from rollout_buffer.server.ui_history import RunHistory
from rollout_buffer.server.views import SharedStatus

ASSETS = Path(__file__).parent / "ui"
# One snapshot a second is what a person watching can read; a stream ends after a while and the page
# reconnects, so a proxy that buffers or drops idle streams cannot leave a page frozen for long.
SNAPSHOT_INTERVAL_S = 1.0
STREAM_MAX_S = 300.0


def mount_ui(app: FastAPI) -> None:
    """Add the dashboard's page, assets and read-only API to `app` (reads through `app.state.reader`)."""

    def reader(request: Request) -> Reader:
        app_reader: Reader = request.app.state.reader  # Starlette's State holds Any
        return app_reader

    # Slightly younger than the stream's interval, so each stream still gets a fresh body every tick.
    app.state.shared_status = SharedStatus(max_age_s=SNAPSHOT_INTERVAL_S * 0.8)

    @app.get(UI_PREFIX, summary="The dashboard (an HTML page; no token needed to load it)",
             response_class=HTMLResponse)
    @app.get(UI_PREFIX + "/", include_in_schema=False)
    async def page() -> Response:
        return FileResponse(ASSETS / "index.html", media_type="text/html")

    app.mount(UI_PREFIX + "/static", StaticFiles(directory=ASSETS), name="ui-static")

    @app.get(UI_PREFIX + "/api/runs", summary="Dashboard: the newest runs")
    async def runs(request: Request, limit: int = Query(default=20, ge=1, le=MAX_PAGE)) -> Response:
        return json_response({"runs": await reader(request).runs(limit)})

    @app.get(UI_PREFIX + "/api/trajectories", summary="Dashboard: trajectories by filter, newest first, paged")
    async def trajectories(
        request: Request,
        run_id: str | None = None,
        uid: str | None = Query(default=None, description="uid prefix"),
        instance_id: str | None = None,
        status: TrajectoryStatus | None = None,
        role: str | None = None,
        reward_min: float | None = None,
        reward_max: float | None = None,
        before: int | None = Query(default=None, ge=1, le=2**63 - 1, description="cursor: `next` of the last page"),
        limit: int = Query(default=50, ge=1, le=MAX_PAGE),
    ) -> Response:
        flt = TrajectoryFilter(run_id, uid, instance_id, status, role, reward_min, reward_max)
        try:
            return json_response(await reader(request).trajectories(flt, before, limit))
        except ValueError as e:
            raise HTTPException(422, str(e)) from None

    @app.get(UI_PREFIX + "/api/trajectories/{uid}", summary="Dashboard: one trajectory with its group")
    async def trajectory(uid: str, request: Request) -> Response:
        found = await reader(request).trajectory(uid)
        if found is None:
            raise HTTPException(404, f"uid: no trajectory {uid!r}")
        g = found["group"]
        members = await reader(request).group(g["run_id"], g["instance_id"], g["epoch"], g["part"])
        return json_response({"record": found["record"], "pruned_at": found["pruned_at"],
                              "group": {**g, "members": members}})

    @app.get(UI_PREFIX + "/api/trajectories/{uid}/tokens", summary="Dashboard: the token view of a trajectory")
    async def tokens(uid: str, request: Request) -> Response:
        found = await reader(request).trajectory(uid)
        if found is None:
            raise HTTPException(404, f"uid: no trajectory {uid!r}")
        if found["pruned_at"] is not None:
            return json_response({"tokens": None, "reason": "pruned to its facts (serve --prune-delivered-after-h): "
                                  "its tokens and all but its last message are gone"})
        return json_response(await asyncio.to_thread(token_view, found["record"], found["tokenizer_path"]))

    @app.get(UI_PREFIX + "/api/batches", summary="Dashboard: reward distribution of the newest delivered batches")
    async def batches(request: Request, run_id: str | None = None,
                      limit: int = Query(default=12, ge=1, le=50)) -> Response:
        return json_response({"batches": await reader(request).batches(run_id, limit)})

    @app.get(UI_PREFIX + "/api/failures", summary="Dashboard: failed trajectories of a run by error kind")
    async def failures(request: Request, run_id: str) -> Response:
        return json_response({"failures": await reader(request).failures(run_id)})

    # Not in the OpenAPI document: a stream that lasts minutes is no request/response operation (and API
    # fuzzers would wait on it); README's Dashboard section documents it.
    @app.get(UI_PREFIX + "/api/events", include_in_schema=False)
    async def events(request: Request) -> Response:
        return StreamingResponse(_snapshots(request), media_type="text/event-stream",
                                 headers={"cache-control": "no-store", "x-accel-buffering": "no"})


async def _snapshots(request: Request) -> AsyncIterator[bytes]:
    """The recent `history` event, then a `snapshot` event a second until the client leaves or the stream's
    time is up (the page then reconnects)."""
    reader: Reader = request.app.state.reader
    shared: SharedStatus = request.app.state.shared_status
    end = time.monotonic() + STREAM_MAX_S
    yield b"retry: 2000\n\n"
    history: RunHistory = request.app.state.history
    yield b"event: history\ndata: " + orjson.dumps({"points": history.points()}) + b"\n\n"
    while time.monotonic() < end and not await request.is_disconnected():
        body = await shared.get(request.app)
        body |= {"t": time.time(), "engine": metrics.engine_latency(), "latest_rowid": await reader.latest_rowid()}
        yield b"event: snapshot\ndata: " + orjson.dumps(body) + b"\n\n"
        await asyncio.sleep(SNAPSHOT_INTERVAL_S)
