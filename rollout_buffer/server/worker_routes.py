"""The buffer's route for its session workers (`serve --session-workers`): `POST /workers/records`, where each
worker hands over its sessions' records, what became of its sessions and the metrics it gained
(`proxy.worker_pool.SessionWorkers.take`). Only the buffer's own workers may call it: they present the secret it
gave them (and the server's token, when it has one, like every caller)."""

from __future__ import annotations

import hmac

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response

from rollout_buffer.proxy.manager import SessionManager
from rollout_buffer.proxy.worker_run import WORKER_SECRET_HEADER
from rollout_buffer.server.bodies import json_response, parse_body


def mount_workers(app: FastAPI) -> None:
    """Add the session workers' route to `app`."""

    @app.post("/workers/records", include_in_schema=False)
    async def take(request: Request) -> Response:
        sessions: SessionManager = request.app.state.sessions
        workers = sessions.pool
        if workers is None:
            raise HTTPException(404, "this buffer has no session workers")
        if not hmac.compare_digest(request.headers.get(WORKER_SECRET_HEADER, "").encode(), workers.secret.encode()):
            raise HTTPException(403, "only the buffer's own session workers hand it records")
        body = parse_body(await request.body())
        if not isinstance(body, dict):
            raise HTTPException(422, "body: a JSON object")
        try:
            refused = await workers.take(body)
        except ValueError as e:
            raise HTTPException(422, str(e)) from None
        return json_response({"success": True, "refused": refused})
