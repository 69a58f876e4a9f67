"""An OpenEnv environment whose actions are MCP tool calls (OpenEnv's MCPEnvironment, a FastMCP server): a
`calculator` tool; reward 1 and done when a call returns the value the task asks for, else 0 (done after 4 calls).

    python calc_tools.py --port 8766
"""

import argparse
import random
from typing import Any

import uvicorn
from fastmcp import FastMCP
from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction, CallToolObservation
from openenv.core.env_server.types import Action, Observation, State

MAX_CALLS = 4


class CalcState(State):
    target: int = 0


class CalcTools(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self) -> None:
        mcp = FastMCP("calc")

        @mcp.tool()
        def calculator(expression: str) -> str:
            """Evaluate an arithmetic expression of integers with + - * and parentheses."""
            if not set(expression) <= set("0123456789+-*() "):
                raise ValueError(f"not arithmetic: {expression!r}")
            return str(eval(expression))

        super().__init__(mcp)
        self._state = CalcState(episode_id="none", step_count=0)

    def reset(self, seed: int | None = None, episode_id: str | None = None, **kwargs: Any) -> Observation:
        rng = random.Random(seed)
        a, b = rng.randint(11, 49), rng.randint(3, 9)
        self._state = CalcState(episode_id=episode_id or f"seed-{seed}", step_count=0, target=a * b)
        return CallToolObservation(tool_name="", result=None, done=False, reward=None,
                                   metadata={"prompt": f"What is {a} * {b}? Use the calculator."})

    def _score(self, action: Action, obs: Observation) -> Observation:
        if isinstance(action, CallToolAction) and isinstance(obs, CallToolObservation):
            self._state.step_count += 1
            value = getattr(obs.result, "data", None)
            hit = value is not None and str(value).strip() == str(self._state.target)
            obs.reward = 1.0 if hit else 0.0
            obs.done = hit or self._state.step_count >= MAX_CALLS
        return obs

    async def step_async(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._score(action, await super().step_async(action, timeout_s=timeout_s, **kwargs))

    def step(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return self._score(action, super().step(action, timeout_s=timeout_s, **kwargs))

    def _step_impl(self, action: Action, timeout_s: float | None = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": f"not a tool call: {type(action).__name__}"})

    @property
    def state(self) -> CalcState:
        return self._state


app = create_app(CalcTools, CallToolAction, CallToolObservation, env_name="calc_tools", max_concurrent_envs=8,
                 state_cls=CalcState)

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    uvicorn.run(app, host="127.0.0.1", port=parser.parse_args().port, log_level="warning")
