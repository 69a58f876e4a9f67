"""Agent sessions for trajectories running in Ray actors: `SessionHost` over the buffer's HTTP API.

A session captures exact tokens in the buffer's proxy (its engine calls, its tree of branches); only the agent —
its callable or subprocess, and the scorer — runs in the actor. `open` asks the buffer for a generator session
recorded as the trajectory's uid and answers its URLs as this node reaches the buffer (`serve --public-url`);
`close` takes the session's records back instead of storing them, so the actor returns them as the trajectory's
outcome and the runner stamps and stores them once, as for any generator. The buffer discards a session whose
actor was lost when its trajectory (same uid) opens the next one, and every session of a run that ends.

The agent socket (how `agent_network: isolated` agents reach their session) is a file on the machine of the
process serving the session — the buffer, or the session worker on the actor's node: a session answers it only
where that file is; elsewhere it is None and `auto` networking falls back to `host`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from rollout_buffer.generation.sessions import is_socket
from rollout_buffer.schemas import Trajectory

log = logging.getLogger(__name__)

# Closing waits for turns still generating (up to 30 s in the proxy) before it answers.
_TIMEOUT = httpx.Timeout(120.0, connect=10.0)


class SessionUnavailable(Exception):
    """The buffer refused or could not be asked for a session call; `error_kind` fails the trajectory."""

    error_kind = "agent_session"


class RemoteSession:
    """One trajectory's session in the buffer's proxy (`generation.sessions.AgentSession`)."""

    def __init__(self, client: httpx.AsyncClient, opened: dict[str, Any], agent_socket: str | None):
        self._client = client
        self.session_id: str = opened["session_id"]
        self.base_url: str = opened["base_url"]
        self.anthropic_base_url: str = opened["anthropic_base_url"]
        self.api_key: str = opened["api_key"]
        self.agent_socket = agent_socket

    async def transcript(self) -> list[dict[str, Any]]:
        """The messages of the branch that generated last."""
        answer = await _call(self._client, "GET", f"/sessions/{self.session_id}/transcript")
        messages: list[dict[str, Any]] = answer["messages"]
        return messages

    async def close(self, reward: float, **extra_info: Any) -> list[Trajectory]:
        """Close the session; its records (one per branch), which the buffer did not store.

        ValueError when the session generated nothing."""
        body = {"reward": reward, "extra_info": extra_info}
        answer = await _call(self._client, "POST", f"/sessions/{self.session_id}/close", body)
        records: list[Trajectory] = answer["records"]
        return records

    async def discard(self, reason: str) -> None:
        """Close the session without records; one the buffer closed already (its run ended) is left as it is."""
        try:
            await _call(self._client, "POST", f"/sessions/{self.session_id}/discard", {"reason": reason[:4000]})
        except SessionUnavailable as e:
            log.info("session %s not discarded: %s", self.session_id, e)


class BufferSessionHost:
    """Opens the sessions of an actor's trajectories in the buffer at `buffer_url`
    (`generation.sessions.SessionHost`)."""

    def __init__(self, buffer_url: str, auth_token: str | None = None, node: str | None = None):
        self.buffer_url = buffer_url.rstrip("/")
        self.node = node  # the actor's Ray node id: the buffer places its sessions on a session worker there
        self._headers = {"authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._client: httpx.AsyncClient | None = None
        self._sockets: dict[str, bool] = {}

    async def open(self, ctx: Any, metadata: dict[str, Any] | None = None) -> RemoteSession:
        """A session recording trajectory `ctx.uid` (a `RolloutContext`) of its run, opened in the buffer."""
        if self._client is None:  # made on the actor's event loop, where it is used (it lives as long as the actor)
            self._client = httpx.AsyncClient(base_url=self.buffer_url, headers=self._headers, timeout=_TIMEOUT)
        body = {"kind": "generator", "run_id": ctx.run.run_id, "uid": ctx.uid, "instance_id": ctx.instance_id,
                "epoch": ctx.epoch, "repeat": ctx.repeat, "metadata": metadata or {}, "node": self.node}
        opened = await _call(self._client, "POST", "/sessions", body)
        return RemoteSession(self._client, opened, await self._local_socket(opened.get("agent_socket")))

    async def _local_socket(self, path: str | None) -> str | None:
        """The buffer's agent socket when it is on this node, else None."""
        if path is None:
            return None
        if path not in self._sockets:
            self._sockets[path] = await asyncio.to_thread(is_socket, path)
        return path if self._sockets[path] else None

    async def start_run(self, run_id: str) -> None:
        """Nothing to do here: the buffer opens the run on its session workers."""

    async def end_run(self, run_id: str) -> None:
        """Nothing to do here: the buffer discards the run's sessions still open when it ends."""


async def _call(client: httpx.AsyncClient, method: str, path: str, body: dict[str, Any] | None = None
                ) -> dict[str, Any]:
    try:
        resp = await client.request(method, path, json=body)
    except httpx.HTTPError as e:
        raise SessionUnavailable(f"{method} {client.base_url}{path} failed: {type(e).__name__}: {e}") from None
    answer: dict[str, Any]  # the buffer answers a JSON object, error or not
    try:
        answer = resp.json()
    except ValueError:
        answer = {"message": resp.text[:500]}
    if resp.status_code == 409 and (answer.get("detail") or {}).get("error_kind") == "empty_session":
        raise ValueError(answer.get("message", "the session generated no model turn"))
    if resp.status_code >= 400:
        raise SessionUnavailable(f"{method} {path}: the buffer answered {resp.status_code}: "
                                 f"{answer.get('message', answer)}")
    return answer
