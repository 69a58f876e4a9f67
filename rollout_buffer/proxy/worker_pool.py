"""The buffer's session workers (`serve --session-workers N`): processes that serve harness sessions' endpoints,
so that parsing, rendering, tokenizing and journaling a turn cost the buffer nothing (`server.session_worker`).

The buffer keeps the store, grouping, delivery and each run's accounting. `POST /sessions` places a session on
the worker holding the fewest, one way (`proxy.placements`: no call per session), and answers a base URL that
names that worker's own port: agents talk to their worker directly, with nothing forwarded (a forwarding front
would spend on every turn the buffer CPU the workers exist to save). A harness finishes a session at the worker
(its `finish_url`), which hands the records back in batches (`POST /workers/records`, `take`); finishing at the
buffer, showing and listing sessions go through the buffer, which asks the worker holding them.

A worker that dies (SIGKILL, an OOM kill) is started again on the same port with the same folder: it restores
its sessions from their journals (`proxy.recovery` decides which), so a client's retry of the turn in flight, at
the same URL, succeeds once it is back; sessions that cannot come back are closed as failed with the reason.
Workers die with the buffer (parent-death signal); the next buffer starts them again on the same ports, and they
restore their sessions the same way.
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import functools
import logging
import secrets
import time
from typing import Any

import orjson
from pydantic import ValidationError

from rollout_buffer.config import AUTH_TOKEN_ENV, ServerConfig
from rollout_buffer.delivery.encoded import decode_wire
from rollout_buffer.engine.http_pool import HttpPool, TransportError
from rollout_buffer.generation.run_manager import RunManager
from rollout_buffer.generation.runner import Run
from rollout_buffer.generation.sessions import is_socket
from rollout_buffer.observability import logs, metrics
from rollout_buffer.proxy.placements import Placement, PlacementStream
from rollout_buffer.proxy.recovery import StoredSummary, record_failure, recovery_plan
from rollout_buffer.proxy.session import ProxyOptions
from rollout_buffer.proxy.session_names import RepeatNumbers, harness_uid, new_session_id, session_root
from rollout_buffer.proxy.worker_launch import WorkerLauncher
from rollout_buffer.proxy.worker_ledger import PlacedSessions, WorkerSlot, WorkerSlots
from rollout_buffer.proxy.worker_records import store, store_parts
from rollout_buffer.proxy.worker_run import WORKER_SECRET_ENV, WORKER_SECRET_HEADER
from rollout_buffer.proxy.worker_sessions import WorkerCallError, WorkerSession, WorkerUnavailable
from rollout_buffer.shortcuts import switch as shortcuts

log = logging.getLogger(__name__)

START_TIMEOUT_S = 60.0  # a worker that does not answer /healthz by then is started again
_RESTART_BACKOFF_S = (0.0, 0.5, 1.0, 2.0, 5.0, 10.0)
_CALL_TIMEOUT_S = 150.0  # finishing waits for turns in flight (up to 30 s there)
_STREAM_GRACE_S = 10.0  # a placement stream that closed: how long its worker has to be seen exiting



class SessionWorkers:
    """The pool of session workers, the sessions placed on them, and the records they hand back."""

    def __init__(self, config: ServerConfig, launcher: WorkerLauncher):
        self.config = config
        self.launcher = launcher
        self.secret = secrets.token_urlsafe(32)
        self.slots = WorkerSlots(config.session_workers)
        self.held = PlacedSessions(self._current)
        self._repeats = RepeatNumbers()
        self._runs: RunManager | None = None
        # The engines' keep-alive client: placing and finishing sessions cost the buffer little more than its own
        # routes. Every call to a worker is a POST of JSON.
        self._client: HttpPool | None = None
        self._background: set[asyncio.Task[None]] = set()
        self._sockets_here: dict[str, bool] = {}  # workers' agent sockets: on this machine or not

    # ---- lifecycle -----------------------------------------------------------------------------------
    async def start(self, runs: RunManager) -> None:
        """Start every worker (each restores the stored sessions of its folder for the run `runs` resumed) and
        wait until each answered or failed to start (those are tried again; meanwhile the others serve)."""
        self._runs = runs
        self._client = HttpPool(timeout_s=_CALL_TIMEOUT_S, headers={WORKER_SECRET_HEADER: self.secret})
        for slot in self.slots:
            slot.supervisor = asyncio.create_task(self._supervise(slot), name=f"session-worker-{slot.index}")
        waits = [asyncio.create_task(s.tried.wait()) for s in self.slots]
        _, pending = await asyncio.wait(waits, timeout=2 * START_TIMEOUT_S)
        for w in pending:
            w.cancel()
        up = [s for s in self.slots if s.up.is_set()]
        if not up:
            log.error("no session worker is up (see the lines above): agent sessions are refused (503) until one is")
        log.info("session workers: %d of %d up at %s", len(up), len(self.slots), ", ".join(s.public_url for s in up))

    async def stop(self) -> None:
        """Stop the workers (SIGTERM; their sessions stay stored for the next start) once the records in their
        outboxes are stored."""
        self.slots.stop()
        await asyncio.gather(*(self._drain(s) for s in self.slots if s.up.is_set()))
        for task in self._background:  # journals not yet let go stay: the next start finds their records stored
            task.cancel()
        for slot in self.slots:
            if slot.supervisor is not None:
                slot.supervisor.cancel()
        await asyncio.gather(*(s.supervisor for s in self.slots if s.supervisor), return_exceptions=True)
        await asyncio.gather(*(s.stream.close() for s in self.slots if s.stream is not None))
        await asyncio.gather(*(self.launcher.stop(s.index) for s in self.slots))
        await self.launcher.aclose()
        if self._client is not None:
            await self._client.aclose()

    async def _drain(self, slot: WorkerSlot) -> None:
        """Store the records waiting in a worker's outbox (its next process finds them stored, and lets them go)."""
        try:
            assert self._runs is not None
            refused = await store_parts(self._runs, (await self._call(slot, "/worker/outbox/drain"))["parcels"])
            if refused:
                log.warning("session worker %d: records in its outbox refused: %s", slot.index, refused)
        except Exception as e:  # they stay in its outbox: its next process sends them
            log.warning("session worker %d: the records in its outbox were not stored before stopping: %s",
                        slot.index, e)

    async def _supervise(self, slot: WorkerSlot) -> None:
        for attempt in range(10**9):
            await asyncio.sleep(_RESTART_BACKOFF_S[min(attempt, len(_RESTART_BACKOFF_S) - 1)] if attempt else 0)
            try:
                exited = await self._start_process(slot)
                await self._connect(slot, await self._recover(slot))
                self.slots.start_ended(slot)
                while not exited.done():
                    assert slot.stream is not None
                    await asyncio.wait((exited, slot.stream.closed), return_when=asyncio.FIRST_COMPLETED)
                    if not exited.done():  # the process is dying, or the stream alone broke
                        await asyncio.wait((exited,), timeout=_STREAM_GRACE_S)
                    if not exited.done():  # the worker ignores placements of sessions it holds or held
                        log.warning("session worker %d: its placement stream closed; connecting again", slot.index)
                        await self._connect(slot, [p for sid, p in self.held.placements.items()
                                                   if sid in slot.sessions])
                code = await exited
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.error("session worker %d did not start: %s", slot.index, e)
                self.slots.start_ended(slot, str(e) or type(e).__name__)
                await self.launcher.stop(slot.index)
                code = None
            self.slots.exited(slot)
            if self.slots.stopping:
                return
            slot.restarts += 1
            metrics.SESSION_WORKER_RESTARTS.inc()
            log.warning("session worker %d exited (code %s) holding %d sessions; starting it again on %s",
                        slot.index, code, len(slot.sessions), slot.url)

    async def _connect(self, slot: WorkerSlot, placements: list[Placement]) -> None:
        """Open the worker's placement stream and send `placements` on it."""
        slot.stream = await PlacementStream.open(slot.url, {WORKER_SECRET_HEADER: self.secret})
        for placement in placements:
            await slot.stream.send(placement)

    async def _start_process(self, slot: WorkerSlot) -> asyncio.Task[int | None]:
        """Start the worker and wait until it answers; the task that ends when it exits."""
        folder = self.config.data_dir / "session-workers" / str(slot.index)
        await asyncio.to_thread(folder.mkdir, parents=True, exist_ok=True)
        args = ["--index", str(slot.index), "--data-dir", str(folder), "--buffer-url", self.launcher.buffer_url,
                "--images-dir", str(self.config.image_dir.resolve()),
                "--max-image-bytes", str(self.config.max_image_bytes),
                *(a for h in self.config.policy.image_url_hosts for a in ("--image-url-host", h)),
                "--max-body-bytes", str(self.config.max_body_bytes),
                "--batch-ms", str(self.config.session_worker_batch_ms),
                "--log-level", logging.getLevelName(logging.getLogger().level), "--access-log", logs.access_mode()]
        hidden = {WORKER_SECRET_ENV: self.secret, **shortcuts.inherited(),
                  **({AUTH_TOKEN_ENV: self.config.auth_token} if self.config.auth_token else {})}
        before = slot.public_url
        try:
            async with asyncio.timeout(START_TIMEOUT_S):
                slot.url, slot.public_url, slot.where = await self.launcher.start(slot.index, args, hidden)
        except TimeoutError:
            raise RuntimeError(f"it was not started within {START_TIMEOUT_S:g} s") from None
        slot.moved = bool(before) and before != slot.public_url
        exited = asyncio.create_task(self.launcher.wait(slot.index))
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            if exited.done():
                raise RuntimeError(f"it exited with code {exited.result()} before answering")
            with contextlib.suppress(WorkerUnavailable):
                if (await self.ask(slot, "/healthz", {}, timeout_s=1.0))[0] == 200:
                    return exited
            if time.monotonic() > deadline:
                exited.cancel()
                raise RuntimeError(f"it did not answer {slot.url}/healthz within {START_TIMEOUT_S:g} s")
            await asyncio.sleep(0.05)

    # ---- recovery ------------------------------------------------------------------------------------
    async def _recover(self, slot: WorkerSlot) -> list[Placement]:
        """A worker (re)started: its stored sessions of the running run come back, the rest are closed; sessions
        the buffer had placed on it that did not come back are closed as failed, but those it never opened (a
        journaling run's session not in its journal): their placements, to send again."""
        assert self._runs is not None
        async with slot.taking:  # a batch its last process sent is stored (or not) before the store is asked
            answer = await self._call(slot, "/worker/journal")
            outbox = [(str(r), str(i), str(u)) for r, i, u in answer["outbox"]]
            delivered = await self._runs.buffer.episodes_stored(outbox)
        await self._call(slot, "/worker/outbox", {"stored": sorted(delivered)})  # it sends the others again
        finished = {uid for _, _, uid in outbox}  # sessions whose records it holds
        stored = [StoredSummary(**s) for s in answer["sessions"]]
        plan = await recovery_plan(self._runs, stored) if stored else None
        restored: set[str] = set()
        fail: dict[str, str] = {}
        if plan is not None and slot.moved:  # agents hold the old address: nothing would reach these sessions
            plan.fail |= {sid: f"session worker {slot.index} was started again at another address ({slot.public_url})"
                          " after its Ray actor was lost" for sid in plan.restore}
            plan.restore = []
        if plan is None:
            await self._call(slot, "/worker/restore", {})  # nothing to restore: it serves from now on
        else:
            run = plan.run
            if plan.restore and run is not None:
                await self._open_run(slot, run)
            answer = await self._call(slot, "/worker/restore", {
                "run_id": run.run_id if run is not None else None, "restore": plan.restore, "remove": plan.done})
            fail = plan.fail | answer["failed"]
            restored = set(plan.restore) - set(answer["failed"])
            by_id = {s.session_id: s for s in stored}
            for session_id, reason in fail.items():
                await record_failure(self._runs, by_id[session_id], reason)
            if fail:
                await self._call(slot, "/worker/restore", {"remove": list(fail)})
            for s in stored:
                self._repeats.taken(s.run_id, s.instance_id, s.repeat)
            for session_id in restored:
                self.held.hold(slot, by_id[session_id])
            for session_id in set(plan.done) | set(fail):
                self.held.let_go(session_id)
        for session_id in [sid for sid in slot.sessions if sid not in self.held.summaries]:
            self.forget_generator(session_id)  # a generator's: gone with the process (its trajectory fails)
        # Placed here, not in the journal: finished just before the worker died (records stored, its closing not
        # told), never opened (its placement unread: placed again), or not journaled (`session_journal: false`)
        # and gone with the process.
        lost = [self.held.summaries[sid] for sid in slot.sessions if sid not in restored and sid in self.held.summaries]
        ended = finished | await self._runs.buffer.episodes_stored([(s.run_id, s.instance_id, s.uid) for s in lost])
        journaled = {s.session_id for s in stored}
        placements = self.held.placements
        again = [placements[s.session_id] for s in lost if s.session_id in placements and not slot.moved
                 and s.session_id not in journaled and s.uid not in ended and self._journals(s.run_id)]
        run = self._current(again[0].run_id) if again else None
        if run is not None:  # `again` holds sessions of the running run alone (`_journals`)
            await self._open_run(slot, run)
        placed = {p.session_id for p in again}
        unjournaled = [s for s in lost if s.session_id not in placed and self.held.let_go(s.session_id)
                       and s.uid not in ended]
        why = (f"started again at another address ({slot.public_url})" if slot.moved
               else "the session was not journaled (session_journal: false)")
        for summary in unjournaled:
            await record_failure(self._runs, summary, f"session worker {slot.index} was lost and {why}")
        if restored or fail or outbox or unjournaled or again:
            log.info("session worker %d: %d sessions restored, %d placed again (never opened), %d closed as failed, "
                     "%d finished with their records in its outbox (%d stored already)", slot.index, len(restored),
                     len(again), len(fail) + len(unjournaled), len(finished),
                     len({u for u in finished if u in delivered}))
        return again

    def _journals(self, run_id: str) -> bool:
        """Whether the running run `run_id` journals its sessions (a session's opening is then written before its
        first turn is answered)."""
        run = self._current(run_id)
        return run is not None and run.resources is not None and \
            run.resources.options(ProxyOptions).session_journal

    # ---- placing and asking ----------------------------------------------------------------------------
    async def place(self, run: Run, instance_id: str, metadata: dict[str, Any], near: str | None = None
                    ) -> dict[str, Any]:
        """Place a harness session of `run` on a worker (`WorkerSlots.pick_when_up`), one way
        (`proxy.placements`); what `POST /sessions` answers."""
        slot = await self.slots.pick_when_up(near)
        if not slot.has_run(run.run_id):
            slot.opening += 1
            try:
                await self._open_run(slot, run)
            finally:
                slot.opening -= 1
            if not slot.up.is_set() or slot.stream is None:
                raise WorkerUnavailable(f"session worker {slot.index} was lost while the run opened on it")
        repeat = self._repeats.take(run.run_id, instance_id)
        session_id = new_session_id(slot.index)
        placement = Placement(run_id=run.run_id, session_id=session_id, instance_id=instance_id, repeat=repeat,
                              api_key=secrets.token_urlsafe(24), public_url=slot.public_url, metadata=metadata)
        uid = harness_uid(run.run_id, instance_id, session_id)
        self.held.hold(slot, StoredSummary(session_id, run.run_id, instance_id, uid, repeat, 0, metadata), placement)
        assert slot.stream is not None
        await slot.stream.send(placement)  # not sent: the worker is lost, and its recovery places it again
        root = session_root(slot.public_url, session_id)
        return {"session_id": session_id, "base_url": f"{root}/v1", "anthropic_base_url": root,
                "api_key": placement.api_key, "uid": uid, "worker": slot.index, "node": slot.where.get("node")}

    def _current(self, run_id: str) -> Run | None:
        return self._runs.running(run_id) if self._runs is not None else None

    def prepare(self, run_id: str) -> None:
        """Open the agent run `run_id`, just ready, on every worker up, in the background: each loads its tokenizer
        and engine client now, not at its first session (seconds a harness would wait). One that fails is tried
        again at its first session; runs of other task types open on a worker at their first session there."""
        run = self._current(run_id)
        if run is None or run.req.task_type != "agent":
            return
        for slot in self.slots:
            if slot.up.is_set() and not slot.has_run(run.run_id):
                task = asyncio.create_task(self._prepare(slot, run), name=f"session-worker-{slot.index}-open-run")
                self._background.add(task)
                task.add_done_callback(self._background.discard)

    async def _prepare(self, slot: WorkerSlot, run: Run) -> None:
        try:
            await self._open_run(slot, run)
        except Exception as e:  # `place` opens it again
            log.warning("session worker %d did not open run %s ahead of its sessions (tried again at its first "
                        "session): %s", slot.index, run.run_id, e)

    async def _open_run(self, slot: WorkerSlot, run: Run) -> None:
        opening = slot.runs.get(run.run_id)
        if opening is None or (opening.done() and not slot.has_run(run.run_id)):  # none yet, or it failed
            payload = run.req.model_dump(mode="json")
            opening = slot.runs[run.run_id] = asyncio.create_task(
                self._call(slot, f"/worker/runs/{run.run_id}/open", payload))
        await asyncio.shield(opening)

    def serves(self, run_id: str) -> bool:
        """Whether the workers serve the generator sessions of `run_id`: those of the training run (an eval's
        stay in the buffer)."""
        return self._current(run_id) is not None

    async def open_generator(self, ctx: Any, metadata: dict[str, Any], near: str | None = None) -> WorkerSession:
        """A session for trajectory `ctx` (a `RolloutContext` of the current run) on a worker
        (`WorkerSlots.pick_when_up`); the runner (or the Ray actor running the trajectory, on node `near`) stores
        its records."""
        run = self._current(ctx.run.run_id)
        if run is None:
            raise WorkerUnavailable(f"run {ctx.run.run_id} is not the training run the session workers serve")
        slot = await self.slots.pick_when_up(near)
        slot.opening += 1
        try:
            await self._open_run(slot, run)
            opened = await self._call(slot, "/worker/generator-sessions", {
                "run_id": run.run_id, "uid": ctx.uid, "instance_id": ctx.instance_id, "epoch": ctx.epoch,
                "repeat": ctx.repeat, "metadata": metadata, "public_url": slot.public_url})
        finally:
            slot.opening -= 1
        self.held.placed[opened["session_id"]] = slot
        slot.sessions.add(opened["session_id"])
        slot.served += 1
        return WorkerSession(functools.partial(self.ask, slot), functools.partial(self.forget_generator,
                             opened["session_id"]), slot.index, run.run_id, opened)

    async def socket_here(self, path: str | None) -> str | None:
        """A worker's agent socket `path` when it is on this machine (a worker on another node: None, and the
        sandboxed agents this process runs use the network)."""
        if path is not None and path not in self._sockets_here:
            self._sockets_here[path] = await asyncio.to_thread(is_socket, path)
        return path if path is not None and self._sockets_here[path] else None

    def forget_generator(self, session_id: str) -> None:
        """A generator's session closed."""
        self.held.forget(session_id)

    def _up(self, session_id: str) -> WorkerSlot:
        slot = self.held.placed.get(session_id) or self.held.recent[session_id]
        if not slot.up.is_set():
            raise WorkerUnavailable(f"session worker {slot.index} is starting again; ask again in a few seconds")
        return slot

    def holds(self, session_id: str) -> bool:
        """Whether a worker holds the session, or held it until it closed recently (the worker answers for it as
        the buffer does for its own: its view, and 409 for a finish again)."""
        return self.held.holds(session_id)

    async def finish(self, session_id: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        """Finish a session on its worker and store the records it hands over (then the worker lets its journal
        go): the worker's status and what finishing answers. StoreError when the records were not stored (the
        worker keeps the session's journal, and hands the same records over when asked again)."""
        slot = self._up(session_id)
        status, answer = await self.ask(slot, f"/worker/sessions/{session_id}/finish", body)
        if status != 200:
            return status, answer
        try:
            run_id, records = str(answer["summary"]["run_id"]), decode_wire(answer["records"])
        except (KeyError, ValidationError) as e:
            return 502, {"message": f"session worker {slot.index} answered records that are not valid: {e}"}
        assert self._runs is not None
        await store(self._runs, run_id, records)
        self.held.let_go(session_id)
        self._release(slot, session_id)
        summary_answer: dict[str, Any] = answer["summary"]
        return status, summary_answer

    def _release(self, slot: WorkerSlot, session_id: str) -> None:
        """Tell the worker its session's records are stored (sent with the others released meanwhile)."""
        slot.released.append(session_id)
        if len(slot.released) == 1:
            task = asyncio.create_task(self._send_released(slot))
            self._background.add(task)
            task.add_done_callback(self._background.discard)

    async def _send_released(self, slot: WorkerSlot) -> None:
        await asyncio.sleep(0.005)  # with those released meanwhile
        released, slot.released = slot.released, []
        try:
            await self._call(slot, "/worker/sessions/released", {"session_ids": released})
        except WorkerUnavailable as e:  # its journals stay: recovery finds their records stored and lets them go
            log.warning("session worker %d was not told %d sessions were stored: %s", slot.index, len(released), e)

    async def view(self, session_id: str) -> dict[str, Any] | None:
        """A session's view from its worker (None when it has none)."""
        slot = self._up(session_id)
        status, answer = await self.ask(slot, f"/worker/sessions/{session_id}/view", {})
        return {**answer, "worker": slot.index} if status == 200 else None

    async def list(self, run_id: str | None) -> builtins.list[dict[str, Any]]:
        """The open sessions of every worker that answers."""
        async def of(slot: WorkerSlot) -> builtins.list[dict[str, Any]]:
            try:
                status, answer = await self.ask(slot, "/worker/sessions/list", {"run_id": run_id})
            except WorkerUnavailable:
                return []
            return [{**s, "worker": slot.index} for s in answer.get("sessions", [])] if status == 200 else []

        found = await asyncio.gather(*(of(s) for s in self.slots if s.up.is_set()))
        return [s for part in found for s in part]

    async def end_run(self, run_id: str) -> None:
        """The run ends: each worker closes its open sessions of it as failed (records handed back first)."""

        async def end(slot: WorkerSlot) -> None:
            if run_id in slot.runs:
                slot.runs.pop(run_id)
                try:
                    await self._call(slot, f"/worker/runs/{run_id}/end")
                except WorkerUnavailable as e:
                    log.warning("session worker %d did not end run %s: %s", slot.index, run_id, e)

        await asyncio.gather(*(end(s) for s in self.slots))
        for session_id in [sid for sid, s in self.held.summaries.items() if s.run_id == run_id]:
            self.held.let_go(session_id)
        self._repeats.end_run(run_id)

    def snapshot(self) -> builtins.list[dict[str, Any]]:
        """The workers in /status."""
        return [{"worker": s.index, "url": s.public_url, "up": s.up.is_set(), "sessions": len(s.sessions),
                 "served": s.served, "restarts": s.restarts,
                 "runs": sorted(run_id for run_id in s.runs if s.has_run(run_id)), **s.where}
                for s in self.slots]

    async def ask(self, slot: WorkerSlot, path: str, body: Any, timeout_s: float | None = None
                   ) -> tuple[int, dict[str, Any]]:
        """POST `body` to the worker: its status and answer. WorkerUnavailable when it cannot be asked."""
        if self._client is None:
            raise WorkerUnavailable("the session workers are not started")
        try:
            if timeout_s is None:  # the client's own deadline (`_CALL_TIMEOUT_S`) bounds it
                status, data = await self._client.post(slot.url, path, orjson.dumps(body))
            else:
                async with asyncio.timeout(timeout_s):
                    status, data = await self._client.post(slot.url, path, orjson.dumps(body))
        except (TransportError, TimeoutError) as e:
            raise WorkerUnavailable(f"session worker {slot.index} did not answer: {type(e).__name__}: {e}") from None
        try:
            answer: dict[str, Any] = orjson.loads(data)
        except orjson.JSONDecodeError:
            answer = {"success": False, "message": data[:500].decode(errors="replace")}
        return status, answer

    async def _call(self, slot: WorkerSlot, path: str, body: Any = None) -> dict[str, Any]:
        """`_ask`, for calls that must succeed: WorkerCallError with the worker's answer when refused."""
        status, answer = await self.ask(slot, path, {} if body is None else body)
        if status >= 400:
            raise WorkerCallError(status, str(answer.get("message", answer)))
        return answer

    # ---- what workers hand back --------------------------------------------------------------------
    async def take(self, batch: dict[str, Any]) -> dict[str, str]:
        """Store a worker's batch of records (each part in its run), then apply its session events and metric gains.
        The parts refused for good (malformed, or their run is gone), by index, with why. ValueError for a malformed
        batch; StoreError when the store refused (the worker sends it again)."""
        assert self._runs is not None
        worker, parts = batch.get("worker"), batch.get("records", [])
        if not isinstance(worker, int) or not 0 <= worker < len(self.slots) or not isinstance(parts, builtins.list):
            raise ValueError("worker, records: a worker's index and a list of parts")
        async with self.slots[worker].taking:  # what its recovery asks the store waits for what it sent before
            refused = await store_parts(self._runs, parts)
        for event in batch.get("events", []):
            if event.get("kind") == "closed":
                self.held.let_go(str(event.get("session_id")))
            elif event.get("kind") == "unplaced":  # the worker could not open a session placed on it
                session_id = str(event.get("session_id"))
                summary = self.held.summaries.get(session_id)
                if summary is not None and self.held.let_go(session_id):
                    await record_failure(self._runs, summary, f"session worker {worker} could not open the session: "
                                         f"{event.get('reason')}")
            elif event.get("kind") == "failed":
                kind = str(event.get("error_kind"))
                metrics.TRAJECTORIES_FAILED.labels(kind).inc()
                run = self._current(str(event.get("run_id")))
                if run is not None:
                    run.session_failed(kind)
        metrics.apply_deltas([(str(n), tuple(labels), tuple(gain)) for n, labels, gain in batch.get("metrics", [])])
        return refused
