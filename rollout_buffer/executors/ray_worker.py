"""The Ray actor of the `ray` executor: many trajectories at once on its event loop, records back in batches.

Plain Python class, made a Ray actor by the pool (`ray.remote(TrajectoryWorker)`), so this module does not
import Ray. Each run it is told about gets its own `RunResources` (engine client, tokenizer), built from the
run's payload exactly as the buffer builds them, with agent sessions opened in the buffer's proxy over HTTP
(`session_client`); each job is one trajectory, run by the same `attempt` as the local executor. Finished
outcomes wait in an outbox the pool drains with `poll` (one call carries many).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_buffer.executors.session_client import BufferSessionHost
from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.plugins import Generator, discover
from rollout_buffer.generation.resources import close_resources, run_resources
from rollout_buffer.generation.trajectory import Failure, attempt
from rollout_buffer.observability import metrics
from rollout_buffer.schemas import StartRolloutRequest, TrajectoryRecord

log = logging.getLogger(__name__)

Outcome = list[TrajectoryRecord] | Failure


@dataclass(frozen=True)
class Job:
    """One trajectory to generate: the input row and the identity the runner gave it."""

    uid: str
    item: dict[str, Any]
    instance_id: str
    epoch: int
    repeat: int


class TrajectoryWorker:
    """Runs the trajectories the pool submits; `poll` hands back the finished ones with the metric deltas."""

    def __init__(self, generator_paths: list[str], buffer_url: str, node_id: Callable[[], str] | None = None):
        self._generators = discover([Path(p) for p in generator_paths])
        self._buffer_url = buffer_url
        # The node it runs on (the pool passes Ray's own lookup): its sessions go to a session worker there.
        self._node = node_id() if node_id is not None else None
        self._sessions = BufferSessionHost(buffer_url, node=self._node)
        self._runs: dict[str, tuple[Generator, RunResources]] = {}
        self._opening: dict[str, asyncio.Task[None]] = {}
        self._tasks: dict[str, set[asyncio.Task[None]]] = {}
        self._done: list[tuple[str, Outcome]] = []
        self._finished = asyncio.Event()
        self._metrics = metrics.Deltas()

    async def authorize(self, auth_token: str | None) -> None:
        """Open agent sessions with the buffer's bearer token (the pool calls this before opening any run). A call
        rather than a constructor argument: Ray keeps those in its GCS and raylet for as long as the actor lives."""
        self._sessions = BufferSessionHost(self._buffer_url, auth_token, self._node)

    async def open_run(self, run_id: str, payload: dict[str, Any]) -> None:
        """Build the run's resources (once; concurrent calls wait for the same build)."""
        if run_id not in self._opening:
            self._opening[run_id] = asyncio.create_task(self._open(run_id, payload))
        await self._opening[run_id]

    async def _open(self, run_id: str, payload: dict[str, Any]) -> None:
        req = StartRolloutRequest.model_validate(payload)
        self._runs[run_id] = (self._generators[req.task_type], await run_resources(run_id, req, self._sessions))
        self._tasks[run_id] = set()

    async def submit(self, run_id: str, jobs: list[Job]) -> None:
        """Start the jobs (the run was opened first); their outcomes come back through `poll`."""
        generator, resources = self._runs[run_id]
        tasks = self._tasks[run_id]
        for job in jobs:
            task = asyncio.create_task(self._run(generator, resources, job))
            tasks.add(task)
            task.add_done_callback(tasks.discard)

    async def _run(self, generator: Generator, resources: RunResources, job: Job) -> None:
        ctx = RolloutContext(resources, job.instance_id, job.epoch, job.repeat, job.uid)
        try:
            out = await attempt(generator, job.item, ctx)
        finally:
            resources.engine.release(job.uid)
        self._done.append((job.uid, out))
        self._finished.set()

    async def poll(self, linger_s: float) -> tuple[list[tuple[str, Outcome]], list[metrics.Delta]]:
        """Wait for a finished trajectory, linger `linger_s` for more, then hand all over with what the
        process's counters and histograms gained since the last poll (the buffer adds them to its own)."""
        await self._finished.wait()
        if linger_s:
            await asyncio.sleep(linger_s)
        done, self._done = self._done, []
        self._finished.clear()
        return done, self._metrics.take()

    async def close_run(self, run_id: str) -> None:
        """Cancel the run's trajectories still running and close its resources."""
        opening = self._opening.pop(run_id, None)
        if opening is not None and not opening.done():
            opening.cancel()
        tasks = self._tasks.pop(run_id, set())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        entry = self._runs.pop(run_id, None)
        if entry is not None:
            await close_resources(entry[1])
