"""What `/status`, `/metrics` and the dashboard's live stream show of the latest run: the store's counts joined
with the runner's live view (progress, admission), so all three say the same."""

from __future__ import annotations

import asyncio
import math
import time
from typing import Any

from starlette.applications import Starlette

from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.generation.evaluation import EvalManager
from rollout_buffer.generation.run_manager import RunManager


async def run_control(app: Starlette, run: dict[str, Any] | None) -> dict[str, Any] | None:
    """The versions and admission of `run` (as `run_view` shows it): the runner's live view, else what the store
    kept; a run that ended admits nothing (its admission state `ended`, whatever its gate was left at)."""
    if run is None:
        return None
    buffer: RolloutBuffer = app.state.buffer
    runs: RunManager = app.state.runs
    control = await buffer.control(run["run_id"])
    live = runs.admission()
    if live is not None and live["run_id"] == run["run_id"]:
        control["admission"] = {k: v for k, v in live.items() if k != "run_id"}
    weights = runs.weights()
    if weights is not None and weights["run_id"] == run["run_id"]:
        control["weights"] = {k: v for k, v in weights.items() if k != "run_id"}
    if run.get("state") != "running" and control.get("admission"):
        control["admission"] = {**control["admission"], "state": "ended"}
    return control


async def status_view(app: Starlette) -> dict[str, Any]:
    """The body of `/status`: the latest run with its live progress, counts, versions and admission, and the evals."""
    buffer: RolloutBuffer = app.state.buffer
    runs: RunManager = app.state.runs
    body = await buffer.status()
    catch_up = getattr(app.state, "catch_up", None)
    if catch_up is not None and catch_up.degraded is not None:
        body["store"]["degraded"] = catch_up.degraded  # serving reads only: the store refuses writes
    body["run"] = run_view(body["run"], runs.progress())
    body["control"] = await run_control(app, body["run"])
    body["evals"] = await evals_view(app)
    body["executor"] = runs.executor.snapshot()
    workers = app.state.sessions.pool
    if workers is not None:
        body["session_workers"] = workers.snapshot()
    return body


def run_view(run: dict[str, Any] | None, live: dict[str, Any] | None) -> dict[str, Any] | None:
    """The latest run as `/status` and `/metrics` show it: as stored, with the runner's live progress while this
    process runs it, and its end as the runner saw it when the store does not say it (yet): a run whose store
    refused a write stays `running` there, to resume at the next start."""
    if run is None or live is None or live.get("run_id") != run["run_id"]:
        return run
    run = {**run, "progress": live}
    if run["state"] == "running" and live["state"] == "failed":  # a finish is stored at once, after its groups
        run["state"], run["error"] = live["state"], live.get("error")
    return run


async def evals_view(app: Starlette) -> dict[str, Any]:
    """The live eval view (budget, running evals) and each dataset's newest results."""
    evals: EvalManager = app.state.evals
    return {**evals.snapshot(), "latest": [s.as_dict() for s in await evals.evals.summaries()]}


class SharedStatus:
    """`status_view` computed at most once per `max_age_s` however many dashboards stream it: each open page
    would otherwise cost the store thread one `/status` a second."""

    def __init__(self, max_age_s: float):
        self.max_age_s = max_age_s
        self._lock = asyncio.Lock()
        self._at = -math.inf
        self._body: dict[str, Any] = {}

    async def get(self, app: Starlette) -> dict[str, Any]:
        """A `/status` body no older than `max_age_s` (a copy: callers add their own fields)."""
        async with self._lock:
            if time.monotonic() - self._at >= self.max_age_s:
                self._body = await status_view(app)
                self._at = time.monotonic()
            return dict(self._body)
