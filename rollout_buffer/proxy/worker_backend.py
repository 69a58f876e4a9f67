"""Agent sessions on the session workers (a `proxy.session_backend.SessionBackend`, `serve --session-workers`):
the pool (`proxy.worker_pool`) places and asks them; this backend answers for them in the buffer, keeps the
sessions Ray actors hold there, and turns a worker that cannot be asked into a 503."""

from __future__ import annotations

import builtins
from typing import Any

from rollout_buffer.generation.context import RolloutContext
from rollout_buffer.generation.run_manager import RunManager
from rollout_buffer.generation.runner import Run
from rollout_buffer.proxy.session_backend import SessionError, wait_ready
from rollout_buffer.proxy.worker_pool import SessionWorkers
from rollout_buffer.proxy.worker_sessions import WorkerCallError, WorkerSession, WorkerSessionError, WorkerUnavailable
from rollout_buffer.schemas import Trajectory


class WorkerBackend:
    """The sessions of the training run, on the session workers."""

    def __init__(self, pool: SessionWorkers):
        self.pool = pool
        self._for_actors: dict[str, WorkerSession] = {}  # uid -> the session an actor's trajectory holds
        self._actors: dict[str, WorkerSession] = {}  # session id -> the same sessions
        self._stopping = False  # the server shuts down: the workers keep their sessions stored

    def serves(self, run_id: str) -> bool:
        """Generator sessions of the training run open on the workers (an evaluation's stay in the buffer)."""
        return self.pool.serves(run_id)

    def holds(self, session_id: str) -> bool:
        """Whether a worker holds the session, or held it until it closed recently."""
        return self.pool.holds(session_id)

    # ---- generators' sessions ------------------------------------------------------------------------
    async def open_generator(self, ctx: RolloutContext, metadata: dict[str, Any], public_url: str,
                             near: str | None = None) -> WorkerSession:
        """A session on a worker for a trajectory the buffer runs (its agent socket kept only if on this machine)."""
        try:
            remote = await self.pool.open_generator(ctx, metadata)
        except WorkerUnavailable as e:
            raise WorkerSessionError(str(e)) from None
        remote.agent_socket = await self.pool.socket_here(remote.agent_socket)
        return remote

    async def open_for_actor(self, ctx: RolloutContext, metadata: dict[str, Any], public_url: str,
                             near: str | None = None) -> WorkerSession:
        """A session on a worker (one on the actor's node `near`, if any) for a trajectory a Ray actor runs."""
        try:
            remote = await self.pool.open_generator(ctx, metadata, near)
        except WorkerUnavailable as e:
            raise SessionError(503, str(e)) from None
        self._for_actors[ctx.uid] = self._actors[remote.session_id] = remote
        return remote

    async def drop_actor(self, uid: str, reason: str) -> None:
        """Discard the session the actor's trajectory `uid` holds on a worker, if any."""
        earlier = self._for_actors.get(uid)
        if earlier is not None:
            self._let_go(earlier.session_id)
            await earlier.discard(reason)

    async def close_for_actor(self, session_id: str, reward: float, extra_info: dict[str, Any]
                              ) -> builtins.list[Trajectory]:
        """Close an actor's session on its worker: its records."""
        remote = self._let_go(session_id)
        try:
            return await remote.close(reward, **extra_info)
        except WorkerSessionError as e:
            raise SessionError(503, str(e)) from None

    async def discard_for_actor(self, session_id: str, reason: str) -> None:
        """Close an actor's session on its worker without records."""
        await self._let_go(session_id).discard(reason)

    async def transcript(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """The messages of an actor's session's latest branch, asked of its worker."""
        remote = self._actors.get(session_id)
        if remote is None:
            raise SessionError(404, f"session_id: no open session {session_id!r}")
        try:
            return await remote.transcript()
        except WorkerSessionError as e:
            raise SessionError(503, str(e)) from None

    def _let_go(self, session_id: str) -> WorkerSession:
        """An actor's session, forgotten here (it is being closed); SessionError (409) when no actor opened it."""
        remote = self._actors.pop(session_id, None)
        if remote is None:
            raise SessionError(409, f"session_id: session {session_id} is not open for a Ray actor")
        self._for_actors = {uid: s for uid, s in self._for_actors.items() if s is not remote}
        return remote

    # ---- harness sessions ----------------------------------------------------------------------------
    async def place(self, run: Run, instance_id: str, metadata: dict[str, Any], public_url: str,
                    near: str | None = None) -> dict[str, Any]:
        """Place a harness session on a worker (one on node `near`, if any): its ids, URLs, key, uid, worker."""
        await wait_ready(run)
        try:
            return await self.pool.place(run, instance_id, metadata, near)
        except WorkerCallError as e:
            raise SessionError(e.status, str(e)) from None
        except WorkerUnavailable as e:
            raise SessionError(503, str(e)) from None

    async def finish(self, session_id: str, reward: float, extra_info: dict[str, Any]) -> dict[str, Any]:
        """Finish a harness session at its worker and store the records it hands over."""
        try:
            status, answer = await self.pool.finish(session_id, {"reward": reward, "extra_info": extra_info})
        except WorkerUnavailable as e:
            raise SessionError(503, str(e)) from None
        except ValueError as e:  # its run is gone from the store
            raise SessionError(409, str(e)) from None
        if status != 200:
            raise SessionError(status, str(answer.get("message", answer)))
        return {k: v for k, v in answer.items() if k != "success"}

    async def view(self, session_id: str) -> dict[str, Any] | None:
        """A session's state, asked of its worker."""
        try:
            return await self.pool.view(session_id)
        except WorkerUnavailable as e:
            raise SessionError(503, str(e)) from None

    async def list(self, run_id: str | None) -> builtins.list[dict[str, Any]]:
        """The open sessions of every worker that answers."""
        return await self.pool.list(run_id)

    def open_count(self) -> int:
        """Sessions placed on the workers."""
        return len(self.pool.held.placed)

    # ---- runs ----------------------------------------------------------------------------------------
    async def recover(self, runs: RunManager) -> None:
        """Start the workers: each restores the stored sessions of its folder for the run `runs` resumed."""
        await self.pool.start(runs)

    async def start_run(self, run_id: str) -> None:
        """An agent run opens on each worker (in the background)."""
        self.pool.prepare(run_id)

    async def end_run(self, run_id: str) -> None:
        """The workers close the run's open sessions as failed and discard those its actors hold."""
        for remote in [s for s in self._actors.values() if s.run_id == run_id]:
            self._let_go(remote.session_id)
        if not self._stopping:
            await self.pool.end_run(run_id)

    async def stop(self) -> None:
        """Stop the workers; their sessions stay stored for the next start."""
        self._stopping = True
        await self.pool.stop()
