"""The rollout runner: one asyncio task per run keeps `num_process` trajectories in flight.

Trajectories run under the run's `num_process` slots (`generation.scheduler`, the scheduler evaluations share), so a
huge input file never sits in memory as tasks. Repeats of one instance are scheduled back to back so groups complete
early. Each group is admitted whole by the run's admission controller (`generation.admission`) before its first
trajectory starts. A trajectory still aborted after the engine client's resumes goes back to the queue (its group
waits for it); a group dropped as stale at delivery with `regenerate_stale` is generated again as a new part of its
(instance, epoch). Each trajectory runs on the run's executor (`generation.executor`: asyncio tasks here, or Ray
actors); everything above stays in this process, whichever executor runs them."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import random
import time
from collections import Counter, deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.encoded import EncodedRecord, RecordError
from rollout_buffer.delivery.runs import StoredRun, StoredWork
from rollout_buffer.delivery.store import StoreError
from rollout_buffer.delivery.streams import StaleGroup
from rollout_buffer.engine.weight_watch import WeightWatch
from rollout_buffer.generation.admission import AdmissionController, AdmissionPolicy
from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.executor import Executor, LocalExecutor
from rollout_buffer.generation.inputs import LineIndex
from rollout_buffer.generation.options import EngineOptions
from rollout_buffer.generation.plugins import Generator
from rollout_buffer.generation.progress import Progress
from rollout_buffer.generation.resources import close_resources, engine_options, run_resources
from rollout_buffer.generation.run_health import FailureWatch, RunCannotWork, RunHealthOptions
from rollout_buffer.generation.scheduler import InFlight, Slot, Slots
from rollout_buffer.generation.sessions import SessionHost
from rollout_buffer.generation.trajectory import Failure, failed_record
from rollout_buffer.observability import metrics
from rollout_buffer.schemas import StartRolloutRequest, TrajectoryRecord

log = logging.getLogger(__name__)


def uid_for(run_id: str, instance_id: str, epoch: int, repeat: int, part: int = 0) -> str:
    """Deterministic uid: a resumed run recognises what it already wrote. A group generated again (a later
    part of its instance and epoch) gets new uids."""
    uid = f"{run_id}:{instance_id}:{epoch}:{repeat}"
    return f"{uid}:{part}" if part else uid


class Run:
    """One rollout run: schedules trajectories, records every outcome, ends by itself.

    A run without an input file (an `agent` run that only hosts sessions) generates nothing by itself: it holds
    its engine, tokenizer and sampling settings for agent sessions until it is replaced or the server stops.
    """

    def __init__(self, run_id: str, req: StartRolloutRequest, input_path: Path | None, generator: Generator,
                 buffer: RolloutBuffer, config: ServerConfig, sessions: SessionHost | None = None,
                 executor: Executor | None = None):
        self.run_id = run_id
        self.req = req
        self.input_path = input_path
        self.generator = generator
        self.buffer = buffer
        self.config = config
        self.sessions = sessions
        self.executor: Executor = executor or LocalExecutor()
        # Known from the start (the input was counted when the run was started): `/status` shows it at once.
        items = int((req.model_extra or {}).get("num_items") or 0)
        self.progress = Progress(run_id, total=items * req.num_epoch * req.num_repeat_per_sample)
        self.task: asyncio.Task[None] | None = None
        self.admission: AdmissionController | None = None
        # What trajectories (and agent sessions) of the run share; set once the tokenizer has loaded.
        self.resources: RunResources | None = None
        # Watches the engines for weight swaps they do not report, once the run generates (`engine.weight_watch`).
        self.weights: WeightWatch | None = None
        self.ready = asyncio.Event()
        self._run_row: StoredRun | None = None
        # Stale groups to generate again: (instance_id, epoch, part), while the run accepts them.
        self._regenerate: deque[tuple[str, int, int]] = deque()
        self._regenerate_added = asyncio.Event()
        self.accepting = True
        self._in_flight = InFlight(Slots(req.num_process))
        # Set while new trajectories may start: cleared when the server is stopping.
        self.starting = asyncio.Event()
        self.starting.set()
        # Set (with `_hopeless_reason`) once its trajectories keep failing: the run fails.
        self._watch = FailureWatch(RunHealthOptions.from_run(req.model_dump()))
        self._hopeless = asyncio.Event()
        self._hopeless_reason = ""
        # Finished trajectories waiting for the store: bounded too, so a slow disk slows generation down.
        self._writing = asyncio.Semaphore(req.num_process)

    def start(self) -> None:
        """Launch the run in the background."""
        self.task = asyncio.create_task(self._main(), name=f"run-{self.run_id}")

    async def cancel(self) -> None:
        """Stop scheduling and cancel in-flight trajectories (their groups stay open)."""
        if self.task and not self.task.done():
            self.task.cancel()
            try:
                await self.task
            except (asyncio.CancelledError, Exception):
                pass

    async def _main(self) -> None:
        try:
            self._run_row = await self.buffer.runs.get(self.run_id)
            if self.generator.native or self.input_path is None:
                await self._run_native()
            else:
                await self._run_slime_style()
            self.progress.state = "finished"
            self.progress.ended_at = time.time()
            await self.buffer.runs.set_state(self.run_id, "finished")
            log.info("run %s finished: %s", self.run_id, self.progress.snapshot())
        except asyncio.CancelledError:
            self.progress.state = "stopped"
            raise
        except Exception as e:
            hopeless = isinstance(e, RunCannotWork)  # its reason says it all: no traceback
            self.progress.state = "failed"
            self.progress.error = str(e) if hopeless else f"{type(e).__name__}: {e}"
            log.error("run %s failed: %s", self.run_id, self.progress.error, exc_info=not hopeless)
            await self._record_failure(e)
        finally:
            self.accepting = False
            self.progress.ended_at = time.time()
            await self._save_progress()

    async def _record_failure(self, error: Exception) -> None:
        """Store that the run failed, unless its store is what failed (a full disk, `--max-db-mb`): the run then
        stays `running` in the store, so that the next start resumes it where it stopped, and `/status` shows the
        failure from the live view."""
        if isinstance(error, StoreError):
            self.progress.error = (f"{self.progress.error}: free space (or raise --max-db-mb) and restart the "
                                   "buffer: the run resumes where it stopped")
            log.error("run %s stopped: its store refused a write; %s", self.run_id, self.progress.error)
            return
        try:
            await self.buffer.runs.set_state(self.run_id, "failed", self.progress.error)
        except StoreError as e:
            log.error("run %s: its failure could not be stored (%s); the next start resumes it", self.run_id, e)

    async def _save_progress(self) -> None:
        try:
            await self.buffer.runs.set_progress(self.run_id, self.progress.snapshot())
        except Exception as e:  # progress is advisory; never let it end a run
            log.warning("could not save progress of %s: %s", self.run_id, e)

    def loaded_resources(self) -> RunResources:
        """What the run's trajectories share, once `ready` is set; RuntimeError before."""
        if self.resources is None:
            raise RuntimeError(f"run {self.run_id} has not loaded its tokenizer and engine yet")
        return self.resources

    async def wait_loaded(self, timeout_s: float) -> RunResources:
        """The run's resources once loaded (waiting up to `timeout_s` for a run that just started); RuntimeError
        naming `run_id` when the run is not running or did not get ready in time."""
        if self.task is None or self.task.done():
            raise RuntimeError(f"run_id: run {self.run_id} is not running")
        if not self.ready.is_set():
            ready = asyncio.create_task(self.ready.wait())
            await asyncio.wait({ready, self.task}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            ready.cancel()
        if not self.ready.is_set():
            raise RuntimeError(f"run_id: run {self.run_id} did not get ready (see GET /status)")
        return self.loaded_resources()

    # ---- what agent sessions of the run report ----------------------------------------------------------
    def session_opened(self, session_id: str) -> None:
        """A harness session of the run opened (or was restored): one trajectory in flight."""
        self.progress.in_flight += 1

    def session_closed(self, session_id: str) -> None:
        """A harness session of the run closed, whatever its outcome."""
        self.progress.in_flight -= 1

    def session_failed(self, kind: str) -> None:
        """A harness session of the run was closed as failed (`kind`: why) with its records."""
        self.progress.failures[kind] += 1

    def requeue_group(self, stale: StaleGroup) -> bool:
        """Generate a stale group again as its new part; False when this run no longer takes work."""
        if not self.accepting or stale.regenerate_part is None:
            return False
        _, instance_id, epoch, _ = stale.key
        self._regenerate.append((instance_id, epoch, stale.regenerate_part))
        self._regenerate_added.set()
        return True

    # ---- native generators -----------------------------------------------------------------------
    async def _run_native(self) -> None:
        resources = self.resources = await run_resources(self.run_id, self.req, self.sessions, self.config.image_dir,
                                                         self.config.max_image_bytes,
                                                         self.config.policy.image_url_hosts)
        self.ready.set()
        if self.sessions is not None:
            await self.sessions.start_run(self.run_id)
        options = EngineOptions.from_run(self.req.model_dump())
        if options.weight_probe_s > 0:
            self.weights = WeightWatch(resources.engine.urls, options.weight_probe_s, options.weight_probe_tolerance,
                                       resources.engine.engine_hosts)
        watching = asyncio.create_task(self.weights.run()) if self.weights is not None else None
        try:
            if self.input_path is None:
                log.info("run %s: no input file; holding the engine and tokenizer for agent sessions", self.run_id)
                await asyncio.Event().wait()  # until the run is replaced or the server stops
            else:
                await self.executor.start_run(self.generator, resources)
                log.info("run %s: generating %d trajectories (%s, %d in flight at most) with %s", self.run_id,
                         self.progress.total, self.req.task_type, self.req.num_process,
                         ", ".join(resources.engine.urls))
                try:
                    await self._run_items(self.input_path, resources)
                finally:
                    await self.executor.end_run(self.run_id)
        finally:
            if watching is not None:
                watching.cancel()
            if self.sessions is not None:
                await self.sessions.end_run(self.run_id)
            await close_resources(resources)

    async def _run_items(self, input_path: Path, resources: RunResources) -> None:
        """The run's items to their end, unless its trajectories keep failing (`RunCannotWork`)."""
        body = asyncio.create_task(self._run_schedule(input_path, resources))
        hopeless = asyncio.create_task(self._hopeless.wait())
        try:
            await asyncio.wait({body, hopeless}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            hopeless.cancel()
            if not body.done():
                body.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await body
        if self._hopeless.is_set():
            raise RunCannotWork(self._hopeless_reason)
        await body

    async def _run_schedule(self, input_path: Path, resources: RunResources) -> None:
        req = self.req
        index = await asyncio.to_thread(LineIndex, input_path)
        self.progress.total = len(index.offsets) * req.num_epoch * req.num_repeat_per_sample
        work = await self.buffer.runs.stored_work(self.run_id)
        self.admission = await self._admission_controller()
        skip = Counter(req.skip_instance_ids or [])
        reporter = asyncio.create_task(self._report_loop())
        try:
            for epoch, i in self._schedule(len(index.offsets)):
                item = index.read(i)
                iid = item["instance_id"]
                if skip[iid] > 0:
                    skip[iid] -= 1
                    self.progress.skipped += req.num_repeat_per_sample
                    continue
                await self._start_scheduled(item, epoch, work, index, resources)
            await self._finish_in_flight(index, resources)
        finally:
            self._in_flight.cancel()
            reporter.cancel()
            index.close()

    async def _admission_controller(self) -> AdmissionController:
        ledger = await self.buffer.ledger(self.run_id)
        # Every group part the run has in the store was started (the in-flight ones a crash lost were not:
        # they are started again as the schedule reaches them).
        started = sum((await self.buffer.reads.group_counts(self.run_id)).values())
        controller = AdmissionController(AdmissionPolicy.of_config(self.req.model_dump()), ledger, started,
                                         persist=lambda state: self.buffer.runs.set_admission(self.run_id, state))
        if controller.policy.limits:
            log.info("run %s: admission control %s", self.run_id, controller.snapshot())
        return controller

    async def _start_scheduled(self, item: dict[str, Any], epoch: int, work: StoredWork, index: LineIndex,
                               resources: RunResources) -> None:
        """Start what a scheduled group still lacks; a group the store has nothing of is admitted first."""
        key = (item["instance_id"], epoch)
        if key in work.done:
            self.progress.skipped += self.req.num_repeat_per_sample
            return
        part, have = work.open.get(key, (0, set()))
        if key not in work.open:
            await self._admit(index, resources)
        await self._start_group(item, epoch, part, have, resources)

    async def _admit(self, index: LineIndex, resources: RunResources) -> None:
        """Wait for an admission for the schedule's next group; stale groups queued for generation again take
        the admissions first (they are older data the trainer is missing)."""
        assert self.admission is not None
        while True:
            await self.admission.admit()
            queued = await self._next_regeneration(index)
            if queued is None:
                return
            await self._start_regeneration(*queued, resources)

    async def _next_regeneration(self, index: LineIndex) -> tuple[dict[str, Any], int, int] | None:
        """The next queued stale group as (item, epoch, part), or None."""
        while self._regenerate:
            iid, epoch, part = self._regenerate.popleft()
            item = await asyncio.to_thread(index.find, iid)
            if item is not None:
                return item, epoch, part
            log.error("run %s: cannot generate group %s epoch %d again: no such instance_id in %s",
                      self.run_id, iid, epoch, self.input_path)
        self._regenerate_added.clear()
        return None

    async def _start_regeneration(self, item: dict[str, Any], epoch: int, part: int,
                                  resources: RunResources) -> None:
        self.progress.regenerated += 1
        log.info("run %s: generating stale group %s epoch %d again (part %d)", self.run_id, item["instance_id"],
                 epoch, part)
        await self._start_group(item, epoch, part, set(), resources)

    async def _start_group(self, item: dict[str, Any], epoch: int, part: int, have: set[str],
                           resources: RunResources) -> None:
        """Start the group's trajectories not stored yet, back to back, each when a slot is free."""
        iid = item["instance_id"]
        for repeat in range(self.req.num_repeat_per_sample):
            uid = uid_for(self.run_id, iid, epoch, repeat, part)
            if uid in have:
                self.progress.skipped += 1
                continue
            await self.starting.wait()
            for outage in resources.outages():  # no new trajectory while an engine (a teacher's too) is down
                await outage.wait_clear()
            await self._in_flight.start(functools.partial(self._one, item,
                                                          RolloutContext(resources, iid, epoch, repeat, uid)))

    async def _finish_in_flight(self, index: LineIndex, resources: RunResources) -> None:
        """Wait for the trajectories in flight, starting regenerations as they come; a failed task fails the run."""
        assert self.admission is not None
        while True:
            while self._regenerate:
                await self.admission.admit()
                queued = await self._next_regeneration(index)
                if queued is None:  # admitted for nothing
                    self.admission.give_back()
                    break
                await self._start_regeneration(*queued, resources)
            if not self._in_flight and not self._regenerate:
                self.accepting = False  # decided with no await since the check: nothing slips in between
                return
            self._regenerate_added.clear()
            await self._in_flight.wait_next(self._regenerate_added)

    def _schedule(self, num_items: int) -> Iterator[tuple[int, int]]:
        for epoch in range(self.req.num_epoch):
            order = list(range(num_items))
            if self.req.shuffle:
                random.Random(self.req.seed + epoch).shuffle(order)
            for i in order:
                yield epoch, i

    async def _one(self, item: dict[str, Any], ctx: RolloutContext, slot: Slot) -> None:
        """Generate one trajectory (holding its generation `slot`) and store it.

        `num_process` bounds the trajectories talking to the engine: a finished one hands its slot to the
        next as soon as it holds a write slot, not after its SQLite commit. One still aborted after the
        engine client's resumes (a weight update that outlasted them) gives its slot back and queues again,
        up to `max_abort_requeues` times; its group waits for it.
        """
        requeues = 0
        while True:
            self.progress.in_flight += 1
            try:
                records = await self._generate(item, ctx)
                requeue = requeues < self.req.max_abort_requeues and any(r.status == "aborted" for r in records)
                if not requeue:
                    await self._writing.acquire()
            finally:
                self.progress.in_flight -= 1
                slot.release()
            if not requeue:
                break
            requeues += 1
            self.progress.requeued += 1
            metrics.TRAJECTORIES_REQUEUED.inc()
            log.info("trajectory %s still aborted after the engine's resumes; back to the queue (%d/%d)",
                     ctx.uid, requeues, self.req.max_abort_requeues)
            await asyncio.sleep(self._requeue_delay(requeues))
            await slot.acquire()
            ctx = RolloutContext(ctx.run, ctx.instance_id, ctx.epoch, ctx.repeat, ctx.uid)
        try:
            await self._write(records)
        except RecordError as e:
            await self._write([self.failed(item, ctx, "bad_record", str(e))])
        finally:
            self._writing.release()

    def _requeue_delay(self, requeues: int) -> float:
        base = float(engine_options(self.req).get("backoff_s", 0.5))
        return min(10.0, base * 2.0 ** (requeues - 1))

    async def _generate(self, item: dict[str, Any], ctx: RolloutContext) -> list[TrajectoryRecord]:
        out = await self.executor.generate(self.generator, item, ctx)
        return [self.failed(item, ctx, out.kind, out.text, out.info)] if isinstance(out, Failure) else out

    def failed(self, item: dict[str, Any], ctx: RolloutContext, kind: str, text: str,
               info: dict[str, Any] | None = None) -> TrajectoryRecord:
        """The record of a failed trajectory (`status: failed`, `extra_info.error` and `error_kind`), counted."""
        self.progress.failures[kind] += 1
        return failed_record(item, ctx, kind, text, info)

    async def accept(self, records: list[TrajectoryRecord]) -> None:
        """Store records produced outside the run's own scheduling (agent sessions a harness finished)."""
        await self._write(records)

    async def accept_encoded(self, records: list[EncodedRecord]) -> None:
        """`accept` for records a session worker encoded."""
        await self._write_encoded(records)

    async def _write(self, records: list[TrajectoryRecord]) -> None:
        await self._write_encoded([EncodedRecord.of(r) for r in records])

    async def _write_encoded(self, records: list[EncodedRecord]) -> None:
        if self._run_row is None:
            raise RuntimeError(f"run {self.run_id} vanished from the store")
        result = await self.buffer.write_encoded(records, self._run_row)
        stored_before = set(result.duplicate_at)  # counted when they were stored (a batch sent again)
        for i, r in enumerate(records):
            if i in stored_before:
                continue
            self.progress.statuses[r.row.status] += 1
            self.progress.note_metrics(r.metrics)
            failure = (r.failure or ("failed", "")) if r.row.status == "failed" else (None, "")
            if r.row.status == "failed":
                self.progress.failed += 1
            else:
                self.progress.done += 1
                if r.row.reward is not None:
                    self.progress.reward_sum += r.row.reward
                    self.progress.rewarded += 1
            reason = self._watch.ended(*failure)
            if reason is not None and not self._hopeless.is_set():
                self._hopeless_reason = reason
                self._hopeless.set()

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.progress_log_s)
            s = self.progress.snapshot()
            log.info("run %s: %d/%d done, %d in flight, %d failed, %.1f traj/s", self.run_id,
                     s["done"] + s["failed"], s["total"] - s["skipped"], s["in_flight"], s["failed"], s["rate"])
            await self._save_progress()

    # ---- slime-style generators ------------------------------------------------------------------
    async def _run_slime_style(self) -> None:
        # Records go to this server, whatever URL the client sent: a client must not make it post a dataset
        # elsewhere.
        payload = {**self.req.model_dump(mode="json"), "remote_buffer_url": self.config.local_url}
        # slime's generators block for the whole rollout and post records over HTTP.
        await asyncio.to_thread(self.generator.module.run_rollout, payload)
