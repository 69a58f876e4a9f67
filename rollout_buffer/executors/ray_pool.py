"""The `ray` executor: trajectories in a pool of async Ray actors, each running many at once.

The buffer process keeps the runs (schedule, in-flight limit, admission, requeues, failure records, the store,
the HTTP API); this pool only moves trajectories. Jobs to one actor are sent together when they arrive within
`ray_batch_ms`, and each actor hands its finished records back in batches through a long poll (with what its
engine metrics gained, added to the buffer's /metrics). A job goes to the actor holding the fewest.

A lost actor (killed, its node gone) is replaced by a new one; the trajectories it held run again on the others
(same uids: the store keeps one record per uid), up to `MAX_TRIES` times each, then fail as
`executor_worker_lost`.

Without `--ray-address` (or RAY_ADDRESS) the buffer runs a Ray head of its own (`ray_head`), stopped after the
actors. The buffer's bearer token reaches the actors in a method call (`authorize`), never as a constructor
argument: Ray keeps those in its GCS and raylet for as long as the actor lives.
"""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import RayActorError

from rollout_buffer.executors.ray_head import LocalHead
from rollout_buffer.executors.ray_options import RayRunOptions
from rollout_buffer.executors.ray_worker import Job, Outcome, TrajectoryWorker
from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.plugins import Generator
from rollout_buffer.generation.trajectory import Failure
from rollout_buffer.observability import metrics

log = logging.getLogger(__name__)

NAMESPACE = "rollout_buffer"
MAX_TRIES = 3  # runs of one trajectory on actors that were lost under it before it fails
MAX_BATCH = 256  # jobs sent at once without waiting for the batch window
_REPLACE_BACKOFF_S = (0.5, 1, 2, 5, 10, 30)


@dataclass(eq=False)
class _Pending:
    """A trajectory handed to the pool, waiting for its outcome."""

    run_id: str
    job: Job
    future: asyncio.Future[Outcome]
    tries: int = 0
    slot: _Slot | None = None


@dataclass(eq=False)
class _Slot:
    """One actor of the pool and the trajectories it holds."""

    name: str
    handle: Any
    authorized: Any  # the ObjectRef of its `authorize` call, awaited before it opens a run
    pending: dict[str, _Pending] = field(default_factory=dict)
    outbox: dict[str, list[Job]] = field(default_factory=dict)  # run id -> jobs not sent yet
    flush: asyncio.TimerHandle | None = None
    poller: asyncio.Task[None] | None = None
    alive: bool = True


class RayExecutor:
    """A pool of `TrajectoryWorker` actors on a Ray cluster (started on the first run, rebuilt when a run asks for
    other actors)."""

    def __init__(self, address: str | None, actors: int | None, generator_paths: tuple[Path, ...],
                 buffer_url: str, auth_token: str | None = None):
        self.address = address
        self.actors = actors
        self.generator_paths = [str(p) for p in generator_paths]
        self.buffer_url = buffer_url  # where the actors open agent sessions, with the token when there is one
        self._auth_token = auth_token
        self._pool_id = uuid.uuid4().hex[:8]
        self._slots: list[_Slot] = []
        self._options: RayRunOptions | None = None
        self._runs: dict[str, dict[str, Any]] = {}  # open runs' payloads, for the actors that replace lost ones
        self._waiting: list[_Pending] = []  # trajectories while no actor is alive
        self._background: set[asyncio.Task[None]] = set()
        self._lost = 0
        self._retried = 0
        self._remote: Any = None
        self._head: LocalHead | None = None
        self._created = 0  # actors started, for unique names (a lost actor's name may still be taken)
        self._connecting = asyncio.Lock()

    async def check_options(self, payload: dict[str, Any]) -> None:
        """Raise ValueError naming the bad `ray_*` options of a run's payload, or those no node of the cluster can
        meet (checked once the buffer has joined the cluster; a run's start checks them again)."""
        options = RayRunOptions.from_run(payload)
        if self._remote is not None:
            await self._check_fits(options)

    @staticmethod
    async def _check_fits(options: RayRunOptions) -> None:
        # ray (2.60) annotates neither `nodes()` nor the dicts it answers.
        nodes: list[dict[str, Any]] = await asyncio.to_thread(ray.nodes)
        unmet = options.unmet(nodes)
        if unmet is not None:
            raise ValueError(unmet)

    async def start_run(self, generator: Generator, resources: RunResources) -> None:
        """Connect to Ray, (re)build the pool for the run's options and open the run on every actor."""
        options = resources.options(RayRunOptions)
        await self.connect()
        await self._check_fits(options)
        if self._options is not None and options.pool_key() != self._options.pool_key():
            await self._stop_pool()
        self._runs[resources.run_id] = resources.config
        if not self._slots:
            self._options = options
            size = self.actors if options.ray_actors is None else options.ray_actors
            if size is None:
                size = await asyncio.to_thread(_cluster_cpus, options.ray_num_cpus)
            log.info("ray executor: starting %d actors (%s) at %s", size, options.actor_options(),
                     self.address or "the local Ray")
            self._slots = [self._new_slot() for _ in range(size)]
            for slot in self._slots:
                self._watch(slot)
        await asyncio.gather(*(self._open(slot, resources.run_id) for slot in self._slots))

    async def connect(self) -> None:
        """Join the cluster at `address` (or RAY_ADDRESS), else a head of the buffer's own, started here (once:
        the session workers' launcher and the pool share it)."""
        async with self._connecting:
            if self._remote is None:
                await self._join()

    async def _join(self) -> None:
        if not ray.is_initialized():
            if self.address is None and not os.environ.get("RAY_ADDRESS"):
                self._head = await LocalHead.start(self._auth_token)
            try:
                if self._head is not None:
                    await self._head.wait_ready()
                await asyncio.to_thread(self._init)
            except BaseException:
                if self._head is not None:
                    await self._head.stop()
                    self._head = None
                raise
        self._remote = ray.remote(TrajectoryWorker)

    def _init(self) -> None:
        where: dict[str, Any] = {"address": self.address}
        if self._head is not None:
            # "auto" in the head's folder rather than its address: like a local `ray.init()`, that joins with Ray's
            # token authentication when the head uses it (an explicit address never turns it on).
            where = {"address": "auto", "_temp_dir": str(self._head.temp_dir)}
        ray.init(namespace=NAMESPACE, log_to_driver=False, **where)

    def _new_slot(self) -> _Slot:
        assert self._options is not None
        self._created += 1
        name = f"trajectory-worker-{self._pool_id}-{self._created}"
        handle = self._remote.options(name=name, namespace=NAMESPACE, **self._options.actor_options()).remote(
            self.generator_paths, self.buffer_url, node_id)
        return _Slot(name, handle, handle.authorize.remote(self._auth_token))

    async def _open(self, slot: _Slot, run_id: str) -> None:
        try:
            await slot.authorized
            await slot.handle.open_run.remote(run_id, self._runs[run_id])
        except RayActorError as e:
            self._on_lost(slot, e)

    def _watch(self, slot: _Slot) -> None:
        slot.poller = asyncio.create_task(self._poll(slot), name=f"poll-{slot.name}")

    async def generate(self, generator: Generator, item: dict[str, Any],
                       ctx: RolloutContext) -> Outcome:
        """Run the trajectory on the actor holding the fewest; its outcome once an actor finished it."""
        future: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        pending = _Pending(ctx.run.run_id, Job(ctx.uid, item, ctx.instance_id, ctx.epoch, ctx.repeat), future)
        self._assign(pending)
        try:
            return await future
        finally:
            if not future.done():  # cancelled: the run was replaced or stopped
                if pending.slot is not None:
                    pending.slot.pending.pop(pending.job.uid, None)
                elif pending in self._waiting:
                    self._waiting.remove(pending)

    def _assign(self, pending: _Pending) -> None:
        alive = [s for s in self._slots if s.alive]
        if not alive:
            pending.slot = None
            self._waiting.append(pending)
            return
        slot = min(alive, key=lambda s: len(s.pending))
        pending.slot = slot
        slot.pending[pending.job.uid] = pending
        jobs = slot.outbox.setdefault(pending.run_id, [])
        jobs.append(pending.job)
        if len(jobs) >= MAX_BATCH:
            self._flush(slot)
        elif slot.flush is None:
            assert self._options is not None
            slot.flush = asyncio.get_running_loop().call_later(self._options.ray_batch_ms / 1000, self._flush, slot)

    def _flush(self, slot: _Slot) -> None:
        if slot.flush is not None:
            slot.flush.cancel()
            slot.flush = None
        outbox, slot.outbox = slot.outbox, {}
        for run_id, jobs in outbox.items():
            self._spawn(self._send(slot, run_id, jobs))

    async def _send(self, slot: _Slot, run_id: str, jobs: list[Job]) -> None:
        try:
            await slot.handle.submit.remote(run_id, jobs)
        except RayActorError as e:
            self._on_lost(slot, e)
        except Exception as e:  # the actor refused the jobs: they fail with the reason rather than wait forever
            log.error("ray executor: actor %s refused %d trajectories of run %s: %s", slot.name, len(jobs), run_id, e)
            for job in jobs:
                pending = slot.pending.pop(job.uid, None)
                if pending is not None and not pending.future.done():
                    pending.future.set_result(Failure("executor_error", f"the Ray actor refused it: {e}"))

    async def _poll(self, slot: _Slot) -> None:
        linger = (self._options.ray_batch_ms if self._options else 0.0) / 1000
        while True:
            try:
                done, deltas = await slot.handle.poll.remote(linger)
            except RayActorError as e:
                self._on_lost(slot, e)
                return
            metrics.apply_deltas(deltas)
            for uid, outcome in done:
                pending = slot.pending.pop(uid, None)
                if pending is not None and not pending.future.done():
                    pending.future.set_result(outcome)

    def _on_lost(self, slot: _Slot, error: Exception) -> None:
        """The actor is gone: replace it, and run its trajectories again (on the others while it starts)."""
        if not slot.alive:
            return
        slot.alive = False
        if slot.flush is not None:
            slot.flush.cancel()
        if slot.poller is not None and slot.poller is not asyncio.current_task():
            slot.poller.cancel()
        self._lost += 1
        metrics.EXECUTOR_WORKERS_LOST.inc()
        held = [p for p in slot.pending.values() if not p.future.done()]
        slot.pending.clear()
        slot.outbox.clear()
        log.warning("ray executor: actor %s lost (%s); %d trajectories run again", slot.name,
                    type(error).__name__, len(held))
        for pending in held:
            pending.tries += 1
            if pending.tries >= MAX_TRIES:
                pending.future.set_result(Failure(
                    "executor_worker_lost", f"the Ray actor running it was lost {pending.tries} times: {error}"))
                continue
            self._retried += 1
            metrics.EXECUTOR_RETRIES.inc()
            self._assign(pending)
        self._spawn(self._replace(slot))

    async def _replace(self, lost: _Slot) -> None:
        for delay in (0.0, *_REPLACE_BACKOFF_S):
            await asyncio.sleep(delay)
            if lost not in self._slots:
                return  # the pool was rebuilt meanwhile
            slot = self._new_slot()
            try:
                await self._open_all(slot)
            except RayActorError as e:
                log.warning("ray executor: replacement actor %s did not start: %s", slot.name, e)
                continue
            if lost not in self._slots:
                ray.kill(slot.handle)
                return
            self._slots[self._slots.index(lost)] = slot
            self._watch(slot)
            log.info("ray executor: actor %s replaced by %s", lost.name, slot.name)
            waiting, self._waiting = self._waiting, []
            for pending in waiting:
                if not pending.future.done():
                    self._assign(pending)
            return
        log.error("ray executor: actor %s could not be replaced; the pool runs with one actor less", lost.name)
        if not any(s.alive for s in self._slots):  # nothing will ever run them: fail them rather than wait
            waiting, self._waiting = self._waiting, []
            for pending in waiting:
                if not pending.future.done():
                    pending.future.set_result(Failure("executor_worker_lost", "no Ray actor could be started"))

    async def _open_all(self, slot: _Slot) -> None:
        """Open every run on a new actor: those that start while it opens the others too (a run started then
        opened only the actors already in the pool), and close again those that end meanwhile. Returns when the
        actor holds exactly the running runs (the caller puts it in the pool without awaiting anything first)."""
        await slot.authorized
        opened: set[str] = set()
        while True:
            for run_id in [r for r in opened if r not in self._runs]:
                await slot.handle.close_run.remote(run_id)
                opened.discard(run_id)
            todo = [run_id for run_id in self._runs if run_id not in opened]
            if not todo:
                return
            for run_id in todo:
                payload = self._runs.get(run_id)
                if payload is not None:
                    await slot.handle.open_run.remote(run_id, payload)
                    opened.add(run_id)

    def _spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def end_run(self, run_id: str) -> None:
        """Close the run on every actor (its trajectories still running there are cancelled)."""
        self._runs.pop(run_id, None)
        for slot in self._slots:
            if slot.alive:
                try:
                    await slot.handle.close_run.remote(run_id)
                except RayActorError as e:
                    self._on_lost(slot, e)

    def snapshot(self) -> dict[str, Any]:
        """The pool in /status: its actors, those lost and the trajectories run again."""
        return {
            "kind": "ray",
            "address": self.address,
            "pool_id": self._pool_id,
            "actors": sum(s.alive for s in self._slots),
            "options": None if self._options is None else self._options.actor_options(),
            "in_flight": sum(len(s.pending) for s in self._slots),
            "actors_lost": self._lost,
            "retried": self._retried,
        }

    async def _stop_pool(self) -> None:
        slots, self._slots = self._slots, []
        for slot in slots:
            slot.alive = False
            if slot.poller is not None:
                slot.poller.cancel()
            if slot.flush is not None:
                slot.flush.cancel()
            ray.kill(slot.handle)

    async def aclose(self) -> None:
        """Kill the actors, leave the cluster, then stop the buffer's own head (only its process: nothing here
        signals the buffer's process group)."""
        for task in self._background:
            task.cancel()
        await self._stop_pool()
        if self._remote is not None:
            await asyncio.to_thread(ray.shutdown)
            log.info("ray executor: actors stopped, left the cluster")
        if self._head is not None:
            await self._head.stop()


def node_id() -> str:
    """The Ray id of the node this process runs on (what an actor tells the buffer its sessions should be near)."""
    found: str = ray.get_runtime_context().get_node_id()
    return found


def _cluster_cpus(per_actor: float) -> int:
    """Actors that fit the cluster's CPUs (one per CPU for actors that reserve none)."""
    # ray (2.60) annotates neither cluster_resources() nor its dict of resource name → amount.
    cpus = float(ray.cluster_resources().get("CPU", 1))  # type: ignore[no-untyped-call]
    return max(1, int(cpus // per_actor) if per_actor else int(cpus))
