"""One trajectory's use of the tools: instances created on first use, calls run under limits, all released.

Every failure a call can meet (malformed call, unknown tool, bad arguments, an exception in the tool, a
timeout, a create that failed, a call over the per-turn limit) becomes the text of its tool message,
`Error: ...`, so the model sees what went wrong and the trajectory goes on.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

from generators.tools.base import as_result
from generators.tools.registry import ToolRegistry
from generators.tools.truncation import TruncateSide, truncate_response
from rollout_buffer.generator_api import ToolCall

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CallLimits:
    """How calls run: per-turn parallelism, response length and side, time per call."""

    max_parallel_calls: int = 1
    max_response_length: int = 256
    truncate_side: TruncateSide = "middle"
    timeout_s: float = 30.0


@dataclass(frozen=True)
class ToolOutcome:
    """What one call produced: the (truncated) text for the tool message, a reward, metrics or an error."""

    name: str
    arguments: dict[str, Any]
    text: str
    reward: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    call_id: str | None = None  # the structured call's id, answered as `tool_call_id`

    def message(self) -> dict[str, Any]:
        """The OpenAI tool message the model reads next."""
        message = {"role": "tool", "name": self.name, "content": self.text}
        if self.call_id is not None:
            message["tool_call_id"] = self.call_id
        return message


class ToolSession:
    """The tools as one trajectory sees them; `close()` releases every instance it created.

    `tools_kwargs` is the input row's verl-style `{tool name: {"create_kwargs": {...},
    "execute_kwargs": {...}, "release_kwargs": {...}}}`.
    """

    def __init__(self, registry: ToolRegistry, instance_id: str, limits: CallLimits | None = None,
                 tools_kwargs: dict[str, Any] | None = None) -> None:
        self.registry = registry
        self.instance_id = instance_id
        self.limits = limits or CallLimits()
        self.tools_kwargs: dict[str, Any] = dict(tools_kwargs or {})
        self.outcomes: list[ToolOutcome] = []
        self._instances: dict[str, asyncio.Future[str]] = {}

    @property
    def total_reward(self) -> float:
        """The sum of the rewards every call of the trajectory returned."""
        return sum(o.reward for o in self.outcomes)

    async def run(self, calls: list[ToolCall]) -> list[ToolOutcome]:
        """Run one turn's calls, the first `max_parallel_calls` concurrently; one outcome per call, in order.

        Calls past the limit are not run: their outcome tells the model so.
        """
        limit = self.limits.max_parallel_calls
        ran = await asyncio.gather(*(self._call(c) for c in calls[:limit]))
        skipped = [self._error(c, f"not run: at most {limit} tool call(s) per turn") for c in calls[limit:]]
        outcomes = [*ran, *skipped]
        self.outcomes.extend(outcomes)
        return outcomes

    async def close(self) -> None:
        """Release every instance this trajectory created; release errors are logged, not raised."""
        instances, self._instances = self._instances, {}
        for name, created in instances.items():
            tool = self.registry.get(name)
            try:
                # A create still running (the trajectory was cut short) is given its time, then released.
                async with asyncio.timeout(self.limits.timeout_s):
                    instance = await asyncio.shield(created)
            except Exception:  # the create failed (its calls said so) or never finished
                created.cancel()
                continue
            if tool is None:
                continue
            try:
                await tool.release(instance, **self._kwargs(name, "release_kwargs"))
            except Exception:
                log.exception("releasing tool %s (instance %s) failed", name, instance)

    async def _call(self, call: ToolCall) -> ToolOutcome:
        if call.error is not None:
            return self._error(call, call.error)
        tool = self.registry.get(call.name)
        if tool is None:
            return self._error(call, f"unknown tool {call.name!r}; available: {', '.join(self.registry.names)}")
        try:
            async with asyncio.timeout(self.limits.timeout_s):
                instance = await self._instance(call.name)
                value = await tool.execute(instance, call.arguments, **self._kwargs(call.name, "execute_kwargs"))
            result = as_result(value)
        except TimeoutError:
            return self._error(call, f"{call.name} took longer than {self.limits.timeout_s:g}s")
        except Exception as e:
            log.debug("tool %s failed on %s", call.name, self.instance_id, exc_info=True)
            return self._error(call, f"{type(e).__name__}: {e}")
        text = truncate_response(result.text, self.limits.max_response_length, self.limits.truncate_side)
        return ToolOutcome(call.name, call.arguments, text, result.reward, result.metrics, call_id=call.id)

    async def _instance(self, name: str) -> str:
        created = self._instances.get(name)
        if created is None:
            tool = self.registry.get(name)
            assert tool is not None
            # A future shared by this turn's parallel calls of the same tool: the instance is created once.
            created = asyncio.ensure_future(tool.create(self.instance_id, **self._kwargs(name, "create_kwargs")))
            self._instances[name] = created
        return await asyncio.shield(created)

    def _kwargs(self, name: str, kind: str) -> dict[str, Any]:
        per_tool = self.tools_kwargs.get(name) or {}
        return dict(per_tool.get(kind) or {})

    def _error(self, call: ToolCall, text: str) -> ToolOutcome:
        return ToolOutcome(call.name, call.arguments, truncate_response(
            f"Error: {text}", self.limits.max_response_length, self.limits.truncate_side), error=text,
            call_id=call.id)
