"""Agents as they are: task type `agent` trains any OpenAI- or Anthropic-client agent through the agent proxy.

Three ways to run it (README "Agents"):
- no `agent` and no `agent_command`: the run generates nothing by itself and needs no input file; a harness
  opens sessions with `POST /sessions` and finishes them with their reward;
- `agent: path/to/file.py:function` (or `package.module:function`): per input row, `function(item, base_url,
  api_key)` runs where the trajectory runs (the server, or a Ray actor with `--executor ray`; sync functions in
  a thread) and returns a reward, an answer or None;
- `agent_command: [...]`: per input row, a subprocess in a scratch folder with `OPENAI_BASE_URL`,
  `ANTHROPIC_BASE_URL` and their keys set, the row on stdin and in `item.json`, under a time limit, in a sandbox
  (generators/agent/sandbox.py).
The session's branches become the trajectory's records, sharing the reward (the agent's own, else `scorer`).
"""

from __future__ import annotations

from typing import Any

from generators.agent.options import AgentOptions, check_payload
from generators.agent.run import run_agent
from rollout_buffer.generator_api import RolloutContext, Trajectory

TASK_TYPE = "agent"
REQUIRED_FIELDS = ()

__all__ = ["TASK_TYPE", "check_payload", "input_required", "run_rollout", "runs_in_buffer"]


def input_required(payload: dict[str, Any]) -> bool:
    """An agent run reads an input file when it runs agents itself; a session host does not."""
    return AgentOptions.from_run(payload).runs_agents


def runs_in_buffer(payload: dict[str, Any]) -> bool:
    """A run that only hosts harness sessions stays in the buffer (it generates nothing); one that runs agents
    runs them on the server's executor, a Ray actor's agent opening its session in the buffer over HTTP."""
    return not AgentOptions.from_run(payload).runs_agents


async def run_rollout(item: dict[str, Any], ctx: RolloutContext) -> list[Trajectory]:
    """Run the row's agent; one record per branch of its session."""
    return await run_agent(item, ctx)
