"""The dashboard's recent history: a point every few seconds (the latest run's done and in-flight counts, the sum
of its trajectories' raw rewards, its trainer-version lag, engine requests so far), kept in memory for the last
half hour, so a page opened in the middle of a run draws its charts from before it connected.

Only what the process already holds in memory is read (the runner's progress, the run's ledger, the metrics):
sampling costs the store nothing once the run's ledger is loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any

from starlette.applications import Starlette

from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.generation.run_manager import RunManager
from rollout_buffer.observability import metrics

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 2.0
KEEP = 900  # points: 30 minutes at one every 2 s


class RunHistory:
    """Samples of the live run, oldest first; `start` begins sampling, `stop` ends it."""

    def __init__(self, app: Starlette, interval_s: float = SAMPLE_INTERVAL_S, keep: int = KEEP):
        self.app = app
        self.interval_s = interval_s
        self.samples: deque[dict[str, Any]] = deque(maxlen=keep)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start sampling in the background."""
        self._task = asyncio.create_task(self._loop(), name="ui-history")

    async def stop(self) -> None:
        """Stop sampling."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def points(self) -> list[dict[str, Any]]:
        """The samples kept, oldest first."""
        return list(self.samples)

    async def sample(self) -> dict[str, Any] | None:
        """One point of the live run (None while no run runs in this process)."""
        runs: RunManager = self.app.state.runs
        buffer: RolloutBuffer = self.app.state.buffer
        progress = runs.progress()
        if progress is None:
            return None
        ledger = await buffer.ledger(progress["run_id"])  # in memory once loaded
        return {"t": time.time(), "run_id": progress["run_id"], "done": progress["done"],
                "in_flight": progress["in_flight"], "lag": ledger.trainer_lead,
                "reward_sum": progress.get("reward_sum", 0.0), "rewarded": progress.get("rewarded", 0),
                "engine": metrics.engine_latency()}

    async def _loop(self) -> None:
        while True:
            try:
                point = await self.sample()
            except Exception:  # a store hiccup must not end the history; the next tick tries again
                log.exception("dashboard history: sampling failed")
                point = None
            if point is not None:
                self.samples.append(point)
            await asyncio.sleep(self.interval_s)
