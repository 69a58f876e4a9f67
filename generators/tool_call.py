"""Tool calling: the model calls OpenAI-style function tools until it answers.

Input rows: `prompt` (a string or OpenAI messages); `label` (the reference answer, optional: without it
only tool rewards count); `tools_kwargs` (optional, verl's per-tool `create_kwargs` / `execute_kwargs` /
`release_kwargs`, also read from `extra_info.tools_kwargs`).

The loop, as verl's ToolAgentLoop: the tool schemas go into the chat template; each assistant turn's calls
are read (`generators.tools.calls`: hermes `<tool_call>` blocks after any `</think>`, or in chat mode
against SGLang with a `--tool-call-parser` the message's OpenAI `tool_calls`); a turn without calls is the
answer and ends the trajectory; otherwise the calls run (the first `max_parallel_calls` concurrently, the
rest answered with an error), their responses are cut to `max_tool_response_length` characters and
appended as tool messages (loss 0; with the call's `tool_call_id` when it had one), and the model goes on.
`max_assistant_turns` and `max_user_turns` (tool rounds) bound the loop, as does the run's `max_tokens`
budget.

Reward = answer reward + tool reward. The answer reward is `generators.math.math_reward` of the final
turn against `label` (1 or 0), counted only when the trajectory ended with an answer, never on a turn
that still calls tools. The tool reward is the sum of the rewards every call of the trajectory returned
(a tool may return `(text, reward)`), so a grading tool or a penalty for wasted calls adds to it.
`extra_info` keeps both parts, every call (`tool_calls`), the turn counts and the `stop_reason`
(`answer`, `max_assistant_turns`, `max_user_turns`, `length`, `abort`).

Run options in the `/start_rollout` payload (defaults): `tool_config_path` (the bundled calculator,
`generators/data/tools.yaml`), `system_prompt` (none), `max_assistant_turns` (8), `max_user_turns`
(unbounded), `max_parallel_calls` (1), `max_tool_response_length` (256), `tool_response_truncate_side`
(`middle`; `left` keeps the start, `right` the end), `tool_timeout_s` (30), `reward_timeout_s` (10).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from importlib import resources
from typing import Annotated, Any, ClassVar

from pydantic import Field

from generators.math import prompt_messages, score
from generators.tools import (
    CallLimits,
    ToolRegistry,
    ToolSession,
    TruncateSide,
    load_tool_config,
    message_tool_calls,
)
from rollout_buffer.generator_api import Governed, RolloutContext, RunOptions, Trajectory

TASK_TYPE = "tool_call"
REQUIRED_FIELDS = ("prompt",)

_SHARED_KEY = "tool_call.setup"


def default_tool_config() -> str:
    """The bundled tool config: the calculator."""
    return str(resources.files("generators") / "data" / "tools.yaml")


class ToolCallOptions(RunOptions):
    """The generator's options, read from the run's `/start_rollout` payload."""

    error_prefix: ClassVar[str] = "tool_call run options"

    tool_config_path: Annotated[str | None, Governed("code_paths")] = None  # a tool config names code to import
    system_prompt: str | None = None
    max_assistant_turns: int | None = Field(default=8, ge=1)
    max_user_turns: int | None = Field(default=None, ge=1)
    max_parallel_calls: int = Field(default=1, ge=1)
    max_tool_response_length: int = Field(default=256, ge=1)
    tool_response_truncate_side: TruncateSide = "middle"
    tool_timeout_s: float = Field(default=30.0, gt=0)
    reward_timeout_s: float = Field(default=10.0, gt=0)

    def limits(self) -> CallLimits:
        """How each turn's calls run."""
        return CallLimits(self.max_parallel_calls, self.max_tool_response_length,
                          self.tool_response_truncate_side, self.tool_timeout_s)


@dataclass(frozen=True)
class RunTools:
    """What every trajectory of a run shares: its options and its tools."""

    options: ToolCallOptions
    registry: ToolRegistry


def load_run_tools(config: dict[str, Any]) -> RunTools:
    """Validate the run options and load the tool config (blocking: imports and file reads)."""
    options = ToolCallOptions.from_run(config)
    registry = load_tool_config(options.tool_config_path or default_tool_config())
    if not len(registry):
        raise ValueError(f"tool config {options.tool_config_path} lists no tools")
    return RunTools(options, registry)


async def run_tools(ctx: RolloutContext) -> RunTools:
    """The run's tools, loaded once in a thread by the first trajectory that asks (the others wait for it)."""
    return await ctx.run.once(_SHARED_KEY, lambda: asyncio.to_thread(load_run_tools, ctx.config))


def _tools_kwargs(item: dict[str, Any]) -> dict[str, Any]:
    found = item.get("tools_kwargs") or (item.get("extra_info") or {}).get("tools_kwargs") or {}
    return found if isinstance(found, dict) else {}


async def run_rollout(item: dict[str, Any], ctx: RolloutContext) -> Trajectory:
    """Generate, call tools, repeat until an answer or a limit; score the answer plus tool rewards."""
    tools = await run_tools(ctx)
    opts = tools.options
    conv = await ctx.conversation(prompt_messages(item, opts.system_prompt), tools=tools.registry.schemas)
    session = ToolSession(tools.registry, ctx.uid, opts.limits(), _tools_kwargs(item))
    calls_log: list[dict[str, Any]] = []
    assistant_turns = user_turns = 0
    try:
        while True:
            before = len(conv.messages)
            finish = await ctx.generate(conv)
            if len(conv.messages) > before:
                assistant_turns += 1
            if finish != "stop":
                stop_reason = finish
                break
            calls = message_tool_calls(conv.messages[-1])
            if not calls:
                stop_reason = "answer"
                break
            if opts.max_assistant_turns and assistant_turns >= opts.max_assistant_turns:
                stop_reason = "max_assistant_turns"
                break
            if opts.max_user_turns and user_turns >= opts.max_user_turns:
                stop_reason = "max_user_turns"
                break
            outcomes = await session.run(calls)
            await conv.aadd_messages([o.message() for o in outcomes])
            user_turns += 1
            calls_log += [
                {"turn": assistant_turns, "name": o.name, "arguments": o.arguments, "reward": o.reward,
                 **({"error": o.error} if o.error else {}), **({"metrics": o.metrics} if o.metrics else {})}
                for o in outcomes
            ]
    finally:
        await session.close()

    label = item.get("label")
    answer_reward = 0.0
    if stop_reason == "answer" and label is not None:
        answer_reward = await score(conv.messages[-1]["content"], str(label), opts.reward_timeout_s)
    tool_reward = session.total_reward
    return await ctx.trajectory(
        conv, answer_reward + tool_reward, finish,
        label=None if label is None else str(label), answer_reward=answer_reward, tool_reward=tool_reward,
        tool_calls=calls_log, assistant_turns=assistant_turns, user_turns=user_turns, stop_reason=stop_reason,
    )
