"""What `/status`, `/metrics` and the dashboard's live stream show of the latest run: the store's counts joined
with the runner's live view (progress, admission), so all three say the same."""

from __future__ import annotations

from typing import Any

from starlette.applications import Starlette

from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.generation.runner import RunManager


async def run_control(app: Starlette, run: dict[str, Any] | None) -> dict[str, Any] | None:
    """The run's versions and admission: the runner's live view, else what the store kept."""
    if run is None:
        return None
    buffer: RolloutBuffer = app.state.buffer
    runs: RunManager = app.state.runs
    control = await buffer.control(run["run_id"])
    live = runs.admission()
    if live is not None and live["run_id"] == run["run_id"]:
        control["admission"] = {k: v for k, v in live.items() if k != "run_id"}
    return control


async def status_view(app: Starlette) -> dict[str, Any]:
    """The body of `/status`: the latest run with its live progress, counts, versions and admission."""
    buffer: RolloutBuffer = app.state.buffer
    runs: RunManager = app.state.runs
    body = await buffer.status()
    live = runs.progress()
    if body["run"] is not None and live is not None and live.get("run_id") == body["run"]["run_id"]:
        body["run"]["progress"] = live
    body["control"] = await run_control(app, body["run"])
    return body
