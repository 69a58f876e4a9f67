"""The runs of the server: start one (replacing the running one), resume it after a restart, run an ended one
again for its stale groups; at most one runs at a time.

Apart from the run itself (`runner.Run`: one run's scheduling): this is the server's view of runs over time,
what the HTTP routes and the agent proxy hold on to.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.streams import StaleGroup
from rollout_buffer.generation.executor import Executor, LocalExecutor
from rollout_buffer.generation.inputs import InputFileError
from rollout_buffer.generation.plugins import Generator
from rollout_buffer.generation.run_policy import check_run
from rollout_buffer.generation.runner import Run
from rollout_buffer.generation.sessions import SessionHost
from rollout_buffer.policy import PolicyRefused
from rollout_buffer.schemas import StartRolloutRequest

log = logging.getLogger(__name__)


class RunManager:
    """Starts, replaces and resumes runs; at most one runs at a time."""

    def __init__(self, config: ServerConfig, buffer: RolloutBuffer, generators: dict[str, Generator],
                 sessions: SessionHost | None = None, executor: Executor | None = None):
        self.config = config
        self.buffer = buffer
        self.generators = generators
        self.sessions = sessions
        self.executor: Executor = executor or LocalExecutor()
        self.current: Run | None = None
        self._reopening: asyncio.Task[None] | None = None
        self._regenerations: asyncio.Task[None] | None = None

    async def start(self, req: StartRolloutRequest, input_path: Path | None, num_items: int,
                    group_size: int | None = None) -> str:
        """Create a run in the store and launch it; a running run is replaced (its data stays).

        `input_path` None: the run hosts agent sessions only. `group_size` defaults to `num_repeat_per_sample`.
        """
        await self._stop_current()
        cfg = req.model_dump(mode="json")
        if input_path is not None:
            cfg["input_file"] = str(input_path)
        cfg["num_items"] = num_items
        cfg["num_repeat_per_sample"] = group_size or req.num_repeat_per_sample
        run_id = await self.buffer.create_run(cfg, cfg["num_repeat_per_sample"])
        if req.current_version is not None:  # the trainer's version when the run begins: its base
            await self.buffer.report_version(req.current_version)
        self._launch(run_id, StartRolloutRequest.model_validate(cfg), input_path)
        return run_id

    def running(self, run_id: str) -> Run | None:
        """The current run when it is `run_id`."""
        run = self.current
        return run if run is not None and run.run_id == run_id else None

    def runs_here(self, gen: Generator, payload: dict[str, Any]) -> bool:
        """Whether a run of `gen` started with `payload` runs its trajectories in this process."""
        return isinstance(self.executor, LocalExecutor) or gen.needs_buffer_process(payload)

    def _launch(self, run_id: str, req: StartRolloutRequest, input_path: Path | None) -> None:
        gen = self.generators[req.task_type]
        # A generator may need this process for some runs (see Generator.needs_buffer_process).
        executor = LocalExecutor() if gen.needs_buffer_process(req.model_dump(mode="json")) else self.executor
        self.current = Run(run_id, req, input_path, gen, self.buffer, self.config, self.sessions, executor)
        self.current.start()

    async def _take_regenerations(self) -> None:
        while True:
            self.regenerate(await self.buffer.regenerations.get())

    def regenerate(self, stale: StaleGroup) -> None:
        """A stale group was queued to be generated again: the current run takes it, or its ended run runs
        again (generating only what is open)."""
        run = self.current
        if run is not None and run.run_id == stale.key[0] and run.requeue_group(stale):
            return
        if self._reopening is None or self._reopening.done():
            self._reopening = asyncio.create_task(self._reopen(stale.key[0]))

    async def _reopen(self, run_id: str) -> None:
        if self.current is not None and self.current.run_id == run_id and self.current.task is not None:
            await asyncio.wait({self.current.task})
        if self.current is not None and self.current.run_id == run_id and self.current.accepting:
            return  # relaunched meanwhile: it found the open parts itself
        if await self.buffer.runs.reopen(run_id):
            log.info("run %s runs again to generate its stale groups", run_id)
            await self.resume()
        else:
            log.warning("run %s cannot generate its stale groups again: it is no longer the latest run, or it "
                        "failed", run_id)

    async def resume(self) -> None:
        """After a restart, continue the run that was running (complete groups are not regenerated), or the
        finished one that has stale groups queued for generation again. From then on, stale groups the buffer
        queues for generation again are generated."""
        if self._regenerations is None:
            self._regenerations = asyncio.create_task(self._take_regenerations(), name="regenerations")
        if self.current is not None and self.current.task is not None and not self.current.task.done():
            return  # running already (a catch-up tried again after a step that followed this one)
        run = await self.buffer.runs.latest()
        if run is None or not run.config.get("task_type"):
            return
        gen = self.generators.get(run.config["task_type"])
        if (run.state == "finished" and gen is not None and gen.native
                and (await self.buffer.reads.group_counts(run.run_id)).get("open")):
            await self.buffer.runs.reopen(run.run_id)  # stale groups queued to be generated again
        elif run.state != "running":
            return
        cfg = run.config
        try:
            req = StartRolloutRequest.model_validate(cfg)
            gen = self.generators[req.task_type]
            check_run(cfg, self.config.policy, gen.module)  # the operator may have tightened the policy since
            path = Path(cfg["input_file"]) if reads_input(gen, cfg) else None
            if path is not None and not await asyncio.to_thread(path.is_file):
                raise InputFileError(f"input_file: {path} is gone")
        except (ValidationError, KeyError, InputFileError, PolicyRefused) as e:
            log.error("cannot resume run %s: %s", run.run_id, e)
            await self.buffer.runs.set_state(run.run_id, "failed", f"resume failed: {e}")
            return
        log.info("resuming run %s (%s)", run.run_id, gen.task_type)
        self._launch(run.run_id, req, path)

    def stop_admission(self) -> None:
        """The server is stopping: the current run starts no new trajectory (those in flight go on until the
        shutdown stops them; they resume at the next start)."""
        if self.current is not None:
            self.current.starting.clear()

    def progress(self) -> dict[str, Any] | None:
        """Live progress of the current run, with its engines' outage when one is going on."""
        run = self.current
        if run is None:
            return None
        snapshot = run.progress.snapshot()
        outages = run.resources.outages() if run.resources is not None else []
        outage = next((o for o in (o.snapshot() for o in outages) if o), None)
        return {**snapshot, "engine_outage": outage} if outage else snapshot

    def admission(self) -> dict[str, Any] | None:
        """Live admission view of the current run (None before its runner has started)."""
        run = self.current
        return None if run is None or run.admission is None else {"run_id": run.run_id, **run.admission.snapshot()}

    def weights(self) -> dict[str, Any] | None:
        """What the current run's weight watch saw (None when it has none: `engine.weight_watch`)."""
        run = self.current
        return None if run is None or run.weights is None else {"run_id": run.run_id, **run.weights.snapshot()}

    async def _stop_current(self) -> None:
        if self.current is not None:
            log.info("replacing run %s", self.current.run_id)
            await self.current.cancel()
            self.current = None

    async def shutdown(self) -> None:
        """Stop the current run; it stays `running` in the store and resumes at the next start."""
        for task in (self._reopening, self._regenerations):
            if task is not None:
                task.cancel()
        await self._stop_current()


def reads_input(generator: Generator, payload: dict[str, Any]) -> bool:
    """Whether a run of `generator` with this start payload reads an input file: always, unless the generator's
    optional `input_required(payload)` hook says otherwise (an `agent` run that only hosts sessions)."""
    hook = generator.hook("input_required")
    return True if hook is None else bool(hook(payload))
