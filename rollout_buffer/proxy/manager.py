"""The server's agent sessions: a router over the session backends (`proxy.session_backend`).

Sessions are opened by generators (`SessionHost.open`), by Ray actors over HTTP (`open_for_actor`) or by a harness
(`POST /sessions`, `place`), and then found by id. They live in this process (`proxy.local_backend`) or, with
`serve --session-workers`, the training run's live on the workers (`proxy.worker_backend`): a call goes to the
backend that serves the run or holds the session; what happens to a session is each backend's.
"""

from __future__ import annotations

import builtins
from collections.abc import Callable
from typing import Any

from rollout_buffer.config import ServerConfig
from rollout_buffer.generation.context import RolloutContext
from rollout_buffer.generation.run_manager import RunManager
from rollout_buffer.generation.runner import Run
from rollout_buffer.generation.sessions import AgentSession
from rollout_buffer.proxy.local_backend import LocalBackend
from rollout_buffer.proxy.session import HarnessRun
from rollout_buffer.proxy.session_backend import SessionBackend, wait_ready
from rollout_buffer.proxy.worker_backend import WorkerBackend
from rollout_buffer.proxy.worker_pool import SessionWorkers
from rollout_buffer.schemas import Trajectory

_ACTOR_LOST = "its trajectory opened a new session (the actor running it was lost)"


class SessionManager:
    """Every agent session of the server; implements `generation.sessions.SessionHost`."""

    def __init__(self, config: ServerConfig, workers: SessionWorkers | None = None):
        self.config = config
        self.local = LocalBackend(config)
        self.on_workers = WorkerBackend(workers) if workers is not None else None
        backends: list[SessionBackend | None] = [self.on_workers, self.local]
        self._backends = [b for b in backends if b is not None]

    @property
    def pool(self) -> SessionWorkers | None:
        """The session workers, if the server has them."""
        return self.on_workers.pool if self.on_workers is not None else None

    def _serving(self, run_id: str) -> SessionBackend:
        """Where a generator's sessions of `run_id` open."""
        return next(b for b in self._backends if b.serves(run_id))

    def _holding(self, session_id: str) -> SessionBackend:
        """Where session `session_id` is (this process when no worker holds it: it answers for unknown ids)."""
        return next((b for b in self._backends if b.holds(session_id)), self.local)

    # ---- generators' and actors' sessions ------------------------------------------------------------
    async def open(self, ctx: RolloutContext, metadata: dict[str, Any] | None = None) -> AgentSession:
        """A session for one trajectory a generator runs (`SessionHost.open`)."""
        return await self._serving(ctx.run.run_id).open_generator(ctx, metadata or {}, self.config.local_url)

    async def open_for_actor(self, run: HarnessRun, uid: str, instance_id: str, epoch: int, repeat: int,
                             metadata: dict[str, Any], public_url: str, near: str | None = None) -> AgentSession:
        """A generator session for trajectory `uid` of `run`, which a Ray actor (on node `near`, if known) runs;
        a session the trajectory opened before (on an actor since lost) is discarded."""
        resources = await wait_ready(run)
        for backend in self._backends:
            await backend.drop_actor(uid, _ACTOR_LOST)
        ctx = RolloutContext(resources, instance_id, epoch, repeat, uid)
        return await self._serving(run.run_id).open_for_actor(ctx, metadata, public_url, near)

    async def close_for_actor(self, session_id: str, reward: float, extra_info: dict[str, Any]
                              ) -> builtins.list[Trajectory]:
        """Close an actor's session: its records (not stored: the actor hands them to the runner, which stamps
        and stores them). ValueError when it generated nothing (it is closed all the same)."""
        return await self._holding(session_id).close_for_actor(session_id, reward, extra_info)

    async def discard_for_actor(self, session_id: str, reason: str) -> None:
        """Close an actor's session without records (its trajectory failed)."""
        await self._holding(session_id).discard_for_actor(session_id, reason)

    async def transcript(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """The messages of an open session's latest branch."""
        return await self._holding(session_id).transcript(session_id)

    # ---- harness sessions ----------------------------------------------------------------------------
    async def place(self, run: Run, instance_id: str, metadata: dict[str, Any], public_url: Callable[[], str],
                    near: str | None = None) -> dict[str, Any]:
        """Open a harness session (`POST /sessions`): on a session worker when the server has them (one on node
        `near`, if any), else here (at `public_url()`). Its ids, base URLs, key and uid (and worker, node)."""
        return await self._backends[0].place(run, instance_id, metadata, public_url(), near)

    async def finish(self, session_id: str, reward: float, extra_info: dict[str, Any]) -> dict[str, Any]:
        """Close a harness session and store its records in its run; returns what was stored."""
        return await self._holding(session_id).finish(session_id, reward, extra_info)

    async def view(self, session_id: str) -> dict[str, Any] | None:
        """The state of an open or recently closed session."""
        return await self._holding(session_id).view(session_id)

    async def list(self, run_id: str | None = None) -> builtins.list[dict[str, Any]]:
        """Summaries of the open sessions (of one run), wherever they are."""
        return [s for b in reversed(self._backends) for s in await b.list(run_id)]

    def open_count(self) -> int:
        """Sessions open here and on the session workers."""
        return sum(b.open_count() for b in self._backends)

    # ---- runs and the server's life ------------------------------------------------------------------
    async def start_run(self, run_id: str) -> None:
        """The run is ready (`SessionHost.start_run`): with session workers, an agent run opens on each of them."""
        for backend in self._backends:
            await backend.start_run(run_id)

    async def end_run(self, run_id: str) -> None:
        """Close the harness sessions of a run that ends (`SessionHost.end_run`; when the server shuts down, only
        let go of them: they stay stored and are restored at the next start), and discard those Ray actors still
        hold."""
        for backend in self._backends:
            await backend.end_run(run_id)

    async def recover(self, runs: RunManager) -> None:
        """After a (re)start, once `runs` resumed its run: the session workers start, each restoring its stored
        sessions, and this process restores its own (`proxy.recovery` decides which)."""
        for backend in self._backends:
            await backend.recover(runs)

    def start(self) -> None:
        """Start expiring idle harness sessions here (call from the running event loop)."""
        self.local.start()

    async def stop(self) -> None:
        """The server shuts down: harness sessions stay stored rather than closing when their run stops (call
        before the runs stop)."""
        for backend in reversed(self._backends):
            await backend.stop()
