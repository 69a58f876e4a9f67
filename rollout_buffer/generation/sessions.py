"""What generation needs of agent sessions: the two protocols the agent proxy (`rollout_buffer.proxy`)
implements. A generator opens a session with `RolloutContext.open_session()`, points an agent at its base URL,
and closes it with the episode's reward to get the session's records (one per branch of its message tree).
In the buffer process the proxy's `SessionManager` is the host; in a Ray actor it is
`rollout_buffer.executors.session_client.BufferSessionHost`, which asks the buffer's proxy over HTTP.
"""

from __future__ import annotations

import os
import stat
from typing import Any, Protocol

from rollout_buffer.schemas import Trajectory


def is_socket(path: str) -> bool:
    """Whether `path` is a Unix socket on this machine: an agent socket answered by a server on another node is
    not (blocking: a stat)."""
    try:
        return stat.S_ISSOCK(os.stat(path).st_mode)
    except OSError:
        return False


class AgentSession(Protocol):
    """One trajectory captured at the proxy: any OpenAI or Anthropic client pointed at it is the policy."""

    session_id: str
    base_url: str  # the OpenAI base URL, `{buffer}/sessions/{id}/v1`
    anthropic_base_url: str  # `{buffer}/sessions/{id}`: the Anthropic client appends `/v1/messages`
    api_key: str
    # A Unix socket that serves only the session endpoints (the way in for sandboxed agents), or None.
    agent_socket: str | None

    async def transcript(self) -> list[dict[str, Any]]:
        """The messages of the branch that generated last ([] before any turn)."""
        ...

    async def close(self, reward: float, **extra_info: Any) -> list[Trajectory]:
        """Close the session: one record per branch (the reward shared), not yet stamped by the runner.

        Raises ValueError when the session generated nothing.
        """
        ...

    async def discard(self, reason: str) -> None:
        """Close the session without records (the trajectory failed)."""
        ...


class SessionHost(Protocol):
    """Opens sessions for a run's trajectories and closes those left open when the run ends."""

    async def open(self, ctx: Any, metadata: dict[str, Any] | None = None) -> AgentSession:
        """A session generating through `ctx`'s (a `RolloutContext`) engine, tokenizer and sampling, recording
        as `ctx.uid`."""
        ...

    async def start_run(self, run_id: str) -> None:
        """The run loaded its engine and tokenizer: a host that serves sessions in processes of their own opens the
        run there now (in the background), so that its first sessions do not wait for it."""
        ...

    async def end_run(self, run_id: str) -> None:
        """The run is ending: close its sessions that a harness still holds (as failed); when the server itself
        shuts down, the proxy keeps them stored instead (they are restored at the next start)."""
        ...
