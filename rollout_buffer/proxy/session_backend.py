"""Where agent sessions live: the protocol of a session backend and the error its calls raise.

Two backends implement it: sessions in this process (`proxy.local_backend`) and sessions on session workers
(`proxy.worker_backend`, `serve --session-workers`). The manager (`proxy.manager`) is a router: it sends each call
to the backend that serves the run or holds the session, and nothing else.
"""

from __future__ import annotations

import builtins
from typing import Any, Protocol

from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.run_manager import RunManager
from rollout_buffer.generation.runner import Run
from rollout_buffer.generation.sessions import AgentSession
from rollout_buffer.proxy.session import HarnessRun
from rollout_buffer.schemas import Trajectory

# How long opening a session waits for a just-started run to load its tokenizer.
READY_WAIT_S = 120.0


class SessionError(Exception):
    """A session request the server refuses (`/sessions` endpoints, slime's error shape)."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


async def wait_ready(run: HarnessRun) -> RunResources:
    """The run's resources once loaded; SessionError (409) when it failed or has no tokenizer."""
    try:
        resources = await run.wait_loaded(READY_WAIT_S)
    except RuntimeError as e:
        raise SessionError(409, str(e)) from None
    if resources.tokenizer is None:
        raise SessionError(409, f"run_id: run {run.run_id} has no tokenizer (chat mode); agent sessions "
                           "capture exact tokens and need tokenizer_path")
    return resources


class SessionBackend(Protocol):
    """Sessions held in one place. Every call that cannot reach that place raises SessionError (503)."""

    def serves(self, run_id: str) -> bool:
        """Whether a generator's sessions of `run_id` open here."""
        ...

    def holds(self, session_id: str) -> bool:
        """Whether the harness or generator session `session_id` is open here or closed here recently."""
        ...

    async def open_generator(self, ctx: RolloutContext, metadata: dict[str, Any], public_url: str,
                             near: str | None = None) -> AgentSession:
        """A session for the trajectory `ctx` that a generator in this process closes; WorkerSessionError when it
        cannot be opened where it belongs (the trajectory fails)."""
        ...

    async def open_for_actor(self, ctx: RolloutContext, metadata: dict[str, Any], public_url: str,
                             near: str | None = None) -> AgentSession:
        """A session for the trajectory `ctx` that a Ray actor (on node `near`, if known) runs and closes over
        HTTP."""
        ...

    async def drop_actor(self, uid: str, reason: str) -> None:
        """Discard the session an actor's trajectory `uid` holds here, if any."""
        ...

    async def close_for_actor(self, session_id: str, reward: float, extra_info: dict[str, Any]
                              ) -> builtins.list[Trajectory]:
        """Close an actor's session: its records, for the actor's runner to stamp and store. ValueError when it
        generated nothing; SessionError (404, 409) when no actor's session `session_id` is open here."""
        ...

    async def discard_for_actor(self, session_id: str, reason: str) -> None:
        """Close an actor's session without records (its trajectory failed)."""
        ...

    async def transcript(self, session_id: str) -> builtins.list[dict[str, Any]]:
        """The messages of an open session's latest branch."""
        ...

    async def place(self, run: Run, instance_id: str, metadata: dict[str, Any], public_url: str,
                    near: str | None = None) -> dict[str, Any]:
        """Open a harness session of `run` (`POST /sessions`): its ids, base URLs, key and uid."""
        ...

    async def finish(self, session_id: str, reward: float, extra_info: dict[str, Any]) -> dict[str, Any]:
        """Close a harness session and store its records in its run: what was stored."""
        ...

    async def view(self, session_id: str) -> dict[str, Any] | None:
        """The state of an open or recently closed session (None: not known here)."""
        ...

    async def list(self, run_id: str | None) -> builtins.list[dict[str, Any]]:
        """Summaries of the open sessions (of one run)."""
        ...

    def open_count(self) -> int:
        """How many sessions are open here."""
        ...

    async def recover(self, runs: RunManager) -> None:
        """After a (re)start, once `runs` resumed its run: bring back the stored sessions of that run."""
        ...

    async def start_run(self, run_id: str) -> None:
        """The run loaded its engine and tokenizer."""
        ...

    async def end_run(self, run_id: str) -> None:
        """The run ends: its open harness sessions close as failed (kept stored when the server stops), the
        sessions its actors hold are discarded."""
        ...

    async def stop(self) -> None:
        """The server shuts down: harness sessions stay stored rather than closing with their run."""
        ...
