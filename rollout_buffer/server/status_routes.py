"""The run as operators and scrapers see it: `/status` and `/metrics` (Prometheus)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.generation.run_manager import RunManager
from rollout_buffer.observability import metrics
from rollout_buffer.proxy.manager import SessionManager
from rollout_buffer.server.bodies import json_response
from rollout_buffer.server.views import evals_view, run_control, run_view, status_view

router = APIRouter()


@router.get("/status", summary="Run, progress, counts, trainer version and admission state")
async def status(request: Request) -> Response:
    return json_response(await status_view(request.app))


@router.get("/metrics", summary="Prometheus metrics (text exposition format)",
         responses={200: {"content": {"text/plain": {}, "application/openmetrics-text": {}}}})


async def prometheus_metrics(request: Request) -> Response:
    buffer: RolloutBuffer = request.app.state.buffer
    runs: RunManager = request.app.state.runs
    groups, run = await buffer.reads.group_counts(), await buffer.runs.latest()
    public = run_view(run.public() if run is not None else None, runs.progress())
    control = await run_control(request.app, public)
    roles = await buffer.role_counts(run.run_id) if run is not None else {}
    sessions: SessionManager = request.app.state.sessions
    body, content_type = metrics.render(groups, public, runs.progress(), request.headers.get("accept", ""), control,
                                        sessions.open_count(), await evals_view(request.app), roles)
    return Response(body, media_type=content_type)
