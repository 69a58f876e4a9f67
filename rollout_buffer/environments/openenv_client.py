"""OpenEnv's wire protocol, spoken without OpenEnv (its package pins its own `mcp`, `openai`, gradio, ...).

An OpenEnv server keeps an environment per WebSocket connection on `/ws` (its HTTP `/reset` and `/step` make a new
environment per call: useless for a multi-step episode). Frames are JSON, strictly one answer per request, with no
request id: `{"type": "reset", "data": {kwargs}}` and `{"type": "step", "data": {action}}` are answered by
`{"type": "observation", "data": {"observation", "reward", "done", "metadata"}}`, failures by
`{"type": "error", "data": {"message", "code"}}`; `{"type": "close"}` ends the session. `GET /schema` gives the
action and observation JSON schemas.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from types import TracebackType
from typing import Any

import httpx
import websockets
from websockets.asyncio.client import ClientConnection

from rollout_buffer.environments.pool import EnvError

_MAX_FRAME_BYTES = 100 * 1024 * 1024  # OpenEnv's own client's limit
_ANSWER_TIMEOUT_S = 300.0
# The action an MCP environment takes (OpenEnv's CallToolAction / ListToolsAction share one `type` discriminator).
MCP_ACTION_TYPES = {"call_tool", "list_tools"}


@dataclass
class StepResult:
    """One answer of the environment."""

    observation: dict[str, Any]
    reward: float | None
    done: bool
    metadata: dict[str, Any] = field(default_factory=dict)


def ws_url(base_url: str) -> str:
    """The server's `/ws` URL from its HTTP base URL."""
    base = base_url.rstrip("/")
    if base.startswith("https://"):
        return "wss://" + base[len("https://"):] + "/ws"
    if base.startswith("http://"):
        return "ws://" + base[len("http://"):] + "/ws"
    return base + "/ws"


async def fetch_schema(http: httpx.AsyncClient, base_url: str) -> dict[str, Any]:
    """The server's `/schema` (action, observation, state JSON schemas); EnvError when it does not answer."""
    try:
        answer = await http.get(base_url.rstrip("/") + "/schema", timeout=30)
        answer.raise_for_status()
        schema: dict[str, Any] = answer.json()
    except (httpx.HTTPError, ValueError) as e:
        raise EnvError("openenv_down", f"the OpenEnv server at {base_url} gave no schema: {e}") from None
    return schema


def is_mcp(schema: dict[str, Any]) -> bool:
    """Whether the environment's actions are MCP tool calls (its action schema is OpenEnv's MCP action)."""
    action = schema.get("action") or {}
    kinds = (action.get("properties") or {}).get("type") or {}
    allowed = set(kinds.get("enum") or ([kinds["const"]] if "const" in kinds else []))
    return bool(allowed & MCP_ACTION_TYPES) or action.get("title") in ("CallToolAction", "ListToolsAction")


class OpenEnvSession:
    """One environment on a server: `async with OpenEnvSession(url) as env: await env.reset(...)`."""

    def __init__(self, base_url: str):
        self.base_url = base_url
        self._ws: ClientConnection | None = None

    async def __aenter__(self) -> OpenEnvSession:
        try:
            self._ws = await websockets.connect(ws_url(self.base_url), max_size=_MAX_FRAME_BYTES, open_timeout=30,
                                                proxy=None)
        except (OSError, websockets.WebSocketException, TimeoutError) as e:
            raise EnvError("openenv_down", f"cannot open a session on the OpenEnv server at {self.base_url}: {e}"
                           ) from None
        return self

    async def __aexit__(self, kind: type[BaseException] | None, error: BaseException | None,
                        tb: TracebackType | None) -> None:
        ws = self._ws
        if ws is not None:
            try:
                await asyncio.wait_for(ws.send(json.dumps({"type": "close"})), 5)
            except (websockets.WebSocketException, OSError, TimeoutError):
                pass
            await ws.close()

    async def reset(self, **kwargs: Any) -> StepResult:
        """A new episode; `kwargs` go to the environment's `reset`."""
        return await self._call({"type": "reset", "data": kwargs})

    async def step(self, action: dict[str, Any]) -> StepResult:
        """One action (a JSON object of the environment's action type)."""
        return await self._call({"type": "step", "data": action})

    async def _call(self, frame: dict[str, Any]) -> StepResult:
        ws = self._ws
        assert ws is not None, "use the session as an async context manager"
        try:
            await ws.send(json.dumps(frame))
            raw = await asyncio.wait_for(ws.recv(), _ANSWER_TIMEOUT_S)
        except websockets.ConnectionClosed as e:
            raise EnvError("openenv_gone", f"the OpenEnv server at {self.base_url} closed the session: {e}") from None
        except TimeoutError:
            raise EnvError("openenv_timeout", f"the OpenEnv server at {self.base_url} did not answer "
                           f"{frame['type']} within {_ANSWER_TIMEOUT_S:g} s") from None
        answer = json.loads(raw)
        data = answer.get("data") or {}
        if answer.get("type") == "error":
            code = data.get("code") or "error"
            raise EnvError("openenv_capacity" if code == "CAPACITY_REACHED" else "openenv_error",
                           f"the OpenEnv environment refused {frame['type']}: {code}: {data.get('message')}"
                           + (f" {data['errors']}" if data.get("errors") else ""))
        if answer.get("type") != "observation":
            raise EnvError("openenv_error", f"the OpenEnv server answered {frame['type']} with a "
                           f"{answer.get('type')!r} frame")
        reward = data.get("reward")
        if reward is not None and not isinstance(reward, (int, float)):
            raise EnvError("env_reward", f"the OpenEnv environment gave a reward that is not a number: {reward!r}")
        return StepResult(data.get("observation") or {}, None if reward is None else float(reward),
                          bool(data.get("done")), data.get("metadata") or {})
