"""A generator's session on a session worker (`serve --session-workers`): what an `agent` run's trajectory, or an
environment's episode, holds when its session lives on a worker. The agent talks to the worker; the transcript
and the records are asked of it, and the runner stores the records as for a session in the buffer."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rollout_buffer.schemas import Trajectory

log = logging.getLogger(__name__)

# POST a body to a path of the session's worker: its status and answer (WorkerUnavailable when it cannot be asked).
Ask = Callable[[str, dict[str, Any]], Awaitable[tuple[int, dict[str, Any]]]]


class WorkerUnavailable(Exception):
    """A session worker could not be asked (down, restarting, not answering): 503 to the caller."""


class WorkerCallError(WorkerUnavailable):
    """A session worker refused the buffer's call; `status` is what it answered."""

    def __init__(self, status: int, message: str):
        super().__init__(message)
        self.status = status


class WorkerSessionError(Exception):
    """A generator's session on a session worker could not be opened, asked or closed; `error_kind` fails the
    trajectory (as for a Ray actor's session in the buffer)."""

    error_kind = "agent_session"


class WorkerSession:
    """A generator's session on a session worker (`generation.sessions.AgentSession`): the agent talks to the
    worker; its transcript and records are asked of it."""

    def __init__(self, ask: Ask, forget: Callable[[], None], worker: int, run_id: str, opened: dict[str, Any]):
        self._ask_worker, self._forget, self.worker, self.run_id = ask, forget, worker, run_id
        self.session_id: str = opened["session_id"]
        self.base_url: str = opened["base_url"]
        self.anthropic_base_url: str = opened["anthropic_base_url"]
        self.api_key: str = opened["api_key"]
        # The worker's own agent socket: a path on the worker's node (whoever runs the agent checks it is there).
        self.agent_socket: str | None = opened.get("agent_socket")

    async def transcript(self) -> list[dict[str, Any]]:
        """The messages of the branch that generated last."""
        messages: list[dict[str, Any]] = (await self._ask("transcript", {}))["messages"]
        return messages

    async def close(self, reward: float, **extra_info: Any) -> list[Trajectory]:
        """Close the session: its records (not stored: the runner stores them). ValueError when it generated
        nothing."""
        try:
            records: list[Trajectory] = (await self._ask("close", {"reward": reward, "extra_info": extra_info})
                                         )["records"]
            return records
        finally:
            self._forget()

    async def discard(self, reason: str) -> None:
        """Close the session without records (one its worker lost is gone already)."""
        try:
            await self._ask("discard", {"reason": reason[:4000]})
        except WorkerSessionError as e:
            log.info("session %s not discarded: %s", self.session_id, e)
        finally:
            self._forget()

    async def _ask(self, what: str, body: dict[str, Any]) -> dict[str, Any]:
        try:
            status, answer = await self._ask_worker(f"/worker/sessions/{self.session_id}/{what}", body)
        except WorkerUnavailable as e:
            raise WorkerSessionError(str(e)) from None
        if status == 409 and (answer.get("detail") or {}).get("error_kind") == "empty_session":
            raise ValueError(answer.get("message", "the session generated no model turn"))
        if status != 200:
            raise WorkerSessionError(f"session worker {self.worker} answered {status} to {what}: "
                                     f"{answer.get('message', answer)}")
        return answer
