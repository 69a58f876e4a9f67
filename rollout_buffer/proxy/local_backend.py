"""Agent sessions held in this process (a `proxy.session_backend.SessionBackend`): the buffer's own when it has
no session workers, and each session worker's.

A generator's session is opened in-process (`open_generator`) or, for a trajectory running in a Ray actor, over
HTTP (`open_for_actor`): the actor closes it into records it takes back, or discards it. Such a session has no
owner here if its actor is lost, so it is discarded when its trajectory opens a new one (the retry, same uid)
and when its run ends.

A harness session belongs to the run it was opened in; finishing it stores its records in that run (grouped by
instance id like any trajectory), and a session idle for longer than the run's `session_ttl_s` is closed as
failed (its branches stored with `status: failed`, so its group is dropped rather than waiting forever).

Harness sessions are durable: each committed turn is appended to the session's file (`proxy.journal`), and a
restarted server restores the open sessions of the run it resumes before it serves (`recover`): same ids, keys
and URLs, the same branches and exact tokens, idle time counted from the last turn before the restart. Sessions
of a run that did not resume (replaced, ended) are closed as failed. Generator sessions are not stored: the
runner generates their unfinished trajectories again. A server shutting down keeps its harness sessions stored
instead of closing them.

Each session is counted in its run once: opened when registered, closed when forgotten (`_register`, `_forget`).
"""

from __future__ import annotations

import builtins
import logging
import secrets
from collections import OrderedDict
from typing import Any

from rollout_buffer.clock import SYSTEM, Clock
from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.store import StoreError
from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.run_manager import RunManager
from rollout_buffer.generation.runner import Run
from rollout_buffer.observability import metrics
from rollout_buffer.proxy.expiry import Reaper
from rollout_buffer.proxy.journal import Journal, StoredSession, idle_since, load_sessions, load_state, replay
from rollout_buffer.proxy.messages import WireError
from rollout_buffer.proxy.recovery import StoredSummary, record_failure, recovery_plan
from rollout_buffer.proxy.session import HarnessRun, ProxyOptions, Session, SessionKind
from rollout_buffer.proxy.session_backend import SessionError, wait_ready
from rollout_buffer.proxy.session_files import SessionFiles
from rollout_buffer.proxy.session_names import RepeatNumbers, harness_uid, new_session_id, session_root
from rollout_buffer.proxy.session_records import InvalidRecords, failed_records, finished_records
from rollout_buffer.proxy.tree import ResponseRef, SessionTree
from rollout_buffer.schemas import Trajectory, TrajectoryRecord

log = logging.getLogger(__name__)


class ClosedSessions(OrderedDict[str, dict[str, Any]]):
    """Sessions closed here lately, remembered for `GET /sessions/{id}` and a clear answer to late requests."""

    KEPT = 4096

    def add(self, session: Session, outcome: str) -> None:
        """Remember `session`, closed with `outcome`."""
        self[session.session_id] = {**session.view(), "state": session.state, "outcome": outcome}
        while len(self) > self.KEPT:
            self.popitem(last=False)

    def refusal(self, session_id: str, prefix: str = "") -> SessionError:
        """Why no open session `session_id` is here: 409 once closed, 404 unknown."""
        if session_id in self:
            return SessionError(409, f"{prefix}session {session_id} is already {self[session_id]['state']}")
        return SessionError(404, f"{prefix}unknown session {session_id!r}")


class LocalBackend:
    """Every agent session open in this process."""

    def __init__(self, config: ServerConfig, clock: Clock = SYSTEM):
        self.config = config
        self.clock = clock  # what idle sessions' expiry reads
        self.sessions: dict[str, Session] = {}
        self.closed = ClosedSessions()
        self._repeats = RepeatNumbers()
        self._for_actors: dict[str, Session] = {}  # uid -> the open session an actor's trajectory holds
        # Sessions a session worker handed to the buffer (`hand_over`), until it stored their records.
        self._handed: dict[str, tuple[Session, builtins.list[TrajectoryRecord], str]] = {}
        self.files = SessionFiles(config.data_dir / "sessions")  # harness sessions' journals
        self.reaper = Reaper(self.sessions, self.expire, clock)
        self._stopping = False  # the server shuts down: harness sessions stay stored, not closed
        # A session worker that started again, until the buffer has had its stored sessions restored: a request
        # for a session it does not hold yet is answered "send it again" rather than "unknown".
        self.restoring = False

    def serves(self, run_id: str) -> bool:
        """Any run's sessions can open here."""
        return True

    def holds(self, session_id: str) -> bool:
        """Whether `session_id` is open here or closed here lately."""
        return session_id in self.sessions or session_id in self.closed

    # ---- generators' sessions ------------------------------------------------------------------------
    async def open_generator(self, ctx: RolloutContext, metadata: dict[str, Any], public_url: str,
                             near: str | None = None) -> Session:
        """A session for one trajectory a generator in this process runs."""
        return self._register(ctx, SessionKind.GENERATOR, public_url, metadata, run=None)

    async def open_for_actor(self, ctx: RolloutContext, metadata: dict[str, Any], public_url: str,
                             near: str | None = None) -> Session:
        """A session for trajectory `ctx.uid`, which a Ray actor runs."""
        session = self._for_actors[ctx.uid] = self._register(ctx, SessionKind.GENERATOR, public_url, metadata,
                                                             run=None)
        return session

    async def drop_actor(self, uid: str, reason: str) -> None:
        """Discard the open session the actor's trajectory `uid` holds here, if any."""
        earlier = self._for_actors.pop(uid, None)
        if earlier is not None and earlier.state == "open":
            await self._discard(earlier, reason, 0.0)

    def for_actor(self, session_id: str) -> Session:
        """The open session `session_id` that an actor opened; SessionError (404, 409) naming why not."""
        session = self.sessions.get(session_id)
        if session is None:
            raise self.closed.refusal(session_id, "session_id: ")
        if self._for_actors.get(session.ctx.uid) is not session:
            raise SessionError(409, f"session_id: session {session_id} is a {session.kind} session not opened by a "
                               "Ray actor (a harness finishes it with /finish)")
        return session

    async def close_for_actor(self, session_id: str, reward: float, extra_info: dict[str, Any]
                              ) -> builtins.list[Trajectory]:
        """Close an actor's session: its records (the actor's runner stamps and stores them)."""
        session = self.for_actor(session_id)
        try:
            return await session.close(reward, **extra_info)
        finally:
            session.ctx.engine.release(session.ctx.uid)

    async def discard_for_actor(self, session_id: str, reason: str) -> None:
        """Close an actor's session without records."""
        await self._discard(self.for_actor(session_id), reason)

    async def transcript(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """The messages of an open session's latest branch."""
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionError(404, f"session_id: no open session {session_id!r}")
        return await session.transcript()

    @staticmethod
    async def _discard(session: Session, reason: str, wait_s: float | None = None) -> None:
        """Discard `session`; with `wait_s`, turns still generating are cancelled after that long (nobody waits
        for the turns of a lost actor's agent) rather than after the proxy's usual wait."""
        if wait_s is not None:
            await session.stop("failed", wait_s)
        await session.discard(reason)
        session.ctx.engine.release(session.ctx.uid)

    # ---- harness sessions ----------------------------------------------------------------------------
    async def place(self, run: Run, instance_id: str, metadata: dict[str, Any], public_url: str,
                    near: str | None = None) -> dict[str, Any]:
        """Open a harness session here (`POST /sessions`): its ids, base URLs, key and uid."""
        session = await self.open_harness(run, instance_id, metadata, public_url)
        return {"session_id": session.session_id, "base_url": session.base_url,
                "anthropic_base_url": session.anthropic_base_url, "api_key": session.api_key, "uid": session.ctx.uid}

    async def open_harness(self, run: HarnessRun, instance_id: str, metadata: dict[str, Any], public_url: str,
                           repeat: int | None = None, session_id: str | None = None, api_key: str | None = None
                           ) -> Session:
        """A session a harness opened with `POST /sessions` in `run` (the generation `Run`, or a session worker's
        `WorkerRun`, which the buffer gives the repeat number, id and key: `proxy.placements`)."""
        resources = await wait_ready(run)
        if repeat is None:
            repeat = self._repeats.take(run.run_id, instance_id)
        session_id = session_id or new_session_id()
        ctx = RolloutContext(resources, instance_id, 0, repeat, harness_uid(run.run_id, instance_id, session_id))
        session = self._register(ctx, SessionKind.HARNESS, public_url, metadata, run, session_id, api_key)
        if not session.options.session_journal:
            return session
        session.journal = Journal(self.files, session_id)
        try:  # answered only once written: the session survives a restart from its first request on
            session.journal.opened(run.run_id, instance_id, ctx.uid, {
                "api_key": session.api_key, "repeat": repeat, "public_url": public_url, "metadata": metadata,
                "created_at": session.created_at})
        except StoreError:  # not answered: nobody holds it, so it goes
            self.sessions.pop(session_id, None)
            run.session_closed(session_id)
            session.journal.closed()
            raise
        return session

    def _register(self, ctx: RolloutContext, kind: SessionKind, public_url: str, metadata: dict[str, Any],
                  run: HarnessRun | None, session_id: str | None = None, api_key: str | None = None) -> Session:
        if ctx.tokenizer is None:
            raise SessionError(409, "agent sessions need token mode: the run has no tokenizer")
        session_id = session_id or new_session_id()
        root = session_root(public_url, session_id)
        session = Session(
            session_id=session_id, api_key=api_key or secrets.token_urlsafe(24), ctx=ctx, kind=kind,
            options=self.options(ctx), base_url=f"{root}/v1", anthropic_base_url=root,
            agent_socket=str(self.config.agent_socket) if self.config.agent_socket else None,
            metadata=metadata, run=run, on_closed=self._forget, clock=self.clock, last_active=self.clock.monotonic())
        self.sessions[session_id] = session
        if kind is SessionKind.HARNESS:
            assert run is not None
            run.session_opened(session_id)
            self.reaper.opened(session)
        log.debug("session %s opened (%s) for %s", session_id, kind, ctx.uid)
        return session

    @staticmethod
    def options(ctx: RolloutContext) -> ProxyOptions:
        """The session options of the run (parsed once for the run)."""
        try:
            return ctx.options(ProxyOptions)
        except ValueError as e:
            raise SessionError(422, str(e)) from None

    def get(self, session_id: str) -> Session:
        """The open session `session_id`; WireError (not found) naming what became of it otherwise."""
        session = self.sessions.get(session_id)
        if session is not None:
            return session
        closed = self.closed.get(session_id)
        if closed is not None:
            raise WireError("not_found", f"session {session_id} is {closed['state']}")
        raise WireError("not_found", f"unknown session {session_id!r}")

    async def view(self, session_id: str) -> dict[str, Any] | None:
        """The state of an open or recently closed session."""
        session = self.sessions.get(session_id)
        return session.view() if session is not None else self.closed.get(session_id)

    async def list(self, run_id: str | None = None) -> builtins.list[dict[str, Any]]:
        """Summaries of the open sessions (of one run)."""
        return [{k: v for k, v in s.view().items() if k != "branches"} | {"branches": len(s.tree.branches)}
                for s in self.sessions.values() if run_id is None or s.ctx.run.run_id == run_id]

    def open_count(self) -> int:
        """Sessions open here."""
        return len(self.sessions)

    # ---- finishing -----------------------------------------------------------------------------------
    async def finish(self, session_id: str, reward: float, extra_info: dict[str, Any]) -> dict[str, Any]:
        """Close a harness session and store its records in its run: built, stamped, validated, stored."""
        session = self._harness(session_id)
        records, outcome = await self._finished_records(session, reward, extra_info)
        await self._store(session, records)
        self._forget(session, outcome)
        return _finished(session, records, outcome)

    async def hand_over(self, session_id: str, reward: float, extra_info: dict[str, Any]
                        ) -> tuple[dict[str, Any], builtins.list[TrajectoryRecord]]:
        """A session worker's finish: close the session and answer its records for the buffer to store (what
        `finish` answers, and the records). The session keeps its journal until the buffer says it stored them
        (`released`); asked again before that (the buffer could not store them), it answers the same records."""
        handed = self._handed.get(session_id)
        if handed is not None:
            return _finished(*handed), handed[1]
        session = self._harness(session_id)
        records, outcome = await self._finished_records(session, reward, extra_info)
        self._handed[session_id] = (session, records, outcome)
        return _finished(session, records, outcome), records

    def released(self, session_ids: builtins.list[str]) -> None:
        """The buffer stored the records of these handed-over sessions: their journals go."""
        for session_id in session_ids:
            handed = self._handed.pop(session_id, None)
            if handed is None:
                continue
            session, _, outcome = handed
            if session.journal is not None:
                session.journal.closed()
            session.ctx.engine.release(session.ctx.uid)
            self._forget(session, outcome, tell_run=False)  # the buffer let it go when it stored the records

    def _harness(self, session_id: str) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise self.closed.refusal(session_id)
        if session_id in self._handed:
            raise SessionError(409, f"session {session_id} is already finished")
        if session.kind is not SessionKind.HARNESS:
            raise SessionError(409, f"session {session_id} belongs to a generator, which closes it")
        return session

    @staticmethod
    async def _finished_records(session: Session, reward: float, extra_info: dict[str, Any]
                                ) -> tuple[builtins.list[TrajectoryRecord], str]:
        try:
            return await finished_records(session, reward, extra_info)
        except InvalidRecords as e:
            raise SessionError(422, str(e)) from None

    async def _store(self, session: Session, records: builtins.list[TrajectoryRecord]) -> None:
        await session.harness_run().accept(records)
        if session.journal is not None:  # only once its records are stored: a failed write keeps it restorable
            session.journal.closed()
        session.ctx.engine.release(session.ctx.uid)

    async def expire(self, session: Session, reason: str, outcome: str = "expired", wait_s: float = 0.0) -> None:
        """Close a harness session as failed: its branches are stored with `status: failed` and the reason
        (turns in flight are cancelled after `wait_s`)."""
        try:
            try:
                records, generated = await failed_records(session, reason, outcome, wait_s)
            except InvalidRecords as e:
                raise SessionError(422, str(e)) from None
            if generated:
                session.harness_run().session_failed(f"session_{outcome}")
                metrics.TRAJECTORIES_FAILED.labels(f"session_{outcome}").inc()
            await self._store(session, records)
        finally:
            self._forget(session, outcome)
        log.warning("session %s closed as failed: %s", session.session_id, reason)

    def _forget(self, session: Session, outcome: str, tell_run: bool = True) -> None:
        if self.sessions.pop(session.session_id, None) is None:
            return
        if self._for_actors.get(session.ctx.uid) is session:
            del self._for_actors[session.ctx.uid]
        if session.kind is SessionKind.HARNESS and session.run is not None and tell_run:
            session.run.session_closed(session.session_id)
        metrics.PROXY_SESSIONS_CLOSED.labels(outcome).inc()
        self.closed.add(session, outcome)

    # ---- runs ----------------------------------------------------------------------------------------
    async def start_run(self, run_id: str) -> None:
        """Nothing to prepare: sessions open here at once."""

    async def end_run(self, run_id: str) -> None:
        """Close the harness sessions of a run that ends (when the server shuts down, only let go of them: they
        stay stored and are restored at the next start), and discard those Ray actors still hold."""
        for session in [s for s in self._for_actors.values() if s.ctx.run.run_id == run_id]:
            try:
                await self._discard(session, f"run {run_id} ended", 0.0)
            except Exception as e:  # the run is ending: keep closing the others
                log.warning("discarding session %s of run %s failed: %s", session.session_id, run_id, e)
        for session in [s for s in self.sessions.values() if s.kind is SessionKind.HARNESS and s.ctx.run.run_id ==
                        run_id and s.session_id not in self._handed]:  # handed over: the buffer has its records
            if self._stopping:
                await session.stop("stopped", 0)  # a turn in flight is cancelled: the client's retry reruns it
                self.sessions.pop(session.session_id, None)
                continue
            try:
                await self.expire(session, f"run {run_id} ended before the session was finished", "failed")
            except Exception as e:  # the run is ending: keep closing the others
                log.warning("closing session %s of run %s failed: %s", session.session_id, run_id, e)
        self._repeats.end_run(run_id)

    # ---- restart -------------------------------------------------------------------------------------
    async def recover(self, runs: RunManager) -> None:
        """After a (re)start, once `runs` resumed its run: restore the stored harness sessions of that run, and
        close those of any other run as failed (a record with the reason each; `proxy.recovery`)."""
        stored = {s.session_id: s for s in load_sessions(self.files)}
        if not stored:
            return
        summaries = {sid: StoredSummary.of(s) for sid, s in stored.items()}
        plan = await recovery_plan(runs, list(summaries.values()))
        for session_id in plan.done:  # finished or expired just before a crash: its records stand
            self.files.remove(session_id)
        unrestored: dict[str, str] = {}
        if plan.run is not None and plan.restore:
            unrestored = self.restore(plan.run, plan.run.loaded_resources(), [stored[sid] for sid in plan.restore])
        for session_id, reason in (plan.fail | unrestored).items():
            await record_failure(runs, summaries[session_id], reason)
            self.files.remove(session_id)
        log.info("restored %d agent sessions after a restart", len(plan.restore) - len(unrestored))
        self.reaper.wake()

    def restore(self, run: HarnessRun, resources: RunResources, stored: builtins.list[StoredSession]
                ) -> dict[str, str]:
        """Restore stored sessions of `run`; those that cannot be, with why (they stay stored)."""
        failed: dict[str, str] = {}
        for s in stored:
            try:
                self._restore(run, resources, s)
            except (ValueError, KeyError, TypeError, RuntimeError, SessionError) as e:
                log.exception("session %s could not be restored", s.session_id)
                failed[s.session_id] = f"session {s.session_id} could not be restored after a restart: {e}"
        self.reaper.wake()
        return failed

    def _restore(self, run: HarnessRun, resources: RunResources, stored: StoredSession) -> Session:
        state = load_state(stored)
        ctx = RolloutContext(resources, stored.instance_id, 0, state["repeat"], stored.uid)
        tree = SessionTree()
        responses: dict[str, ResponseRef] = {}
        last_at = replay(stored, ctx, tree, responses)
        session = self._register(ctx, SessionKind.HARNESS, state["public_url"], state["metadata"], run=run,
                                 session_id=stored.session_id, api_key=state["api_key"])
        session.tree, session.responses, session.created_at = tree, responses, state["created_at"]
        session.last_active = idle_since(last_at, state["created_at"], self.clock.monotonic())
        next_seq = max((t[0] for t in stored.turns), default=-1) + 1
        session.journal = Journal(self.files, stored.session_id, next_seq)
        ctx.engine_stats["turns"] = len(stored.turns)
        self._repeats.taken(run.run_id, stored.instance_id, state["repeat"])
        return session

    # ---- expiry --------------------------------------------------------------------------------------
    def start(self) -> None:
        """Start expiring idle harness sessions (call from the running event loop; `proxy.expiry`)."""
        self.reaper.start()

    async def stop(self) -> None:
        """Stop the expiry loop, and keep harness sessions stored rather than closing them when their run stops
        (call before the runs stop)."""
        self._stopping = True
        await self.reaper.stop()


def _finished(session: Session, records: list[TrajectoryRecord], outcome: str) -> dict[str, Any]:
    """What finishing a session answers."""
    return {"session_id": session.session_id, "run_id": session.ctx.run.run_id, "records": len(records),
            "uids": [r.uid for r in records], "branches": len(session.tree.branches), "status": outcome}
