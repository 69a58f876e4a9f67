"""Where a run's trajectories execute: the interface the runner schedules through, and the local executor.

The runner keeps everything about a run — schedule, in-flight limit, admission, requeues, retries of aborted
trajectories, failure records, the store — and hands each trajectory to an executor, which answers its records
or its `Failure`. The local executor runs it as an asyncio task of the buffer process (the default); the `ray`
executor (`rollout_buffer.executors.ray_pool`) runs it in a pool of Ray actors.
"""

from __future__ import annotations

from typing import Any, Protocol

from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.plugins import Generator
from rollout_buffer.generation.trajectory import Failure, attempt
from rollout_buffer.schemas import TrajectoryRecord


class Executor(Protocol):
    """Runs trajectories of the runs it was told about."""

    async def check_options(self, payload: dict[str, Any]) -> None:
        """Raise ValueError naming the executor's run options in a `/start_rollout` payload that are bad."""

    async def start_run(self, generator: Generator, resources: RunResources) -> None:
        """Get ready for the run's trajectories (before its first one)."""

    async def generate(self, generator: Generator, item: dict[str, Any],
                       ctx: RolloutContext) -> list[TrajectoryRecord] | Failure:
        """One trajectory: its records, or why it failed."""
        ...

    async def end_run(self, run_id: str) -> None:
        """The run will send no more trajectories; free what it holds."""

    def snapshot(self) -> dict[str, Any]:
        """What `/status` shows of the executor."""
        ...

    async def aclose(self) -> None:
        """The server stops."""


class LocalExecutor:
    """Trajectories as asyncio tasks of the buffer process, sharing the run's engine client and tokenizer."""

    async def check_options(self, payload: dict[str, Any]) -> None:
        """The local executor has no run options."""

    async def start_run(self, generator: Generator, resources: RunResources) -> None:
        """Nothing to prepare: the runner's resources are used as they are."""

    async def generate(self, generator: Generator, item: dict[str, Any],
                       ctx: RolloutContext) -> list[TrajectoryRecord] | Failure:
        """Run the generator here."""
        try:
            return await attempt(generator, item, ctx)
        finally:
            ctx.engine.release(ctx.uid)

    async def end_run(self, run_id: str) -> None:
        """Nothing to free."""

    def snapshot(self) -> dict[str, Any]:
        """`{"kind": "local"}`."""
        return {"kind": "local"}

    async def aclose(self) -> None:
        """Nothing to close."""
