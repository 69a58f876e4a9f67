"""Tools the tool-calling tests load by file path (`tests/tool_fixtures.py:Name`), in the buffer process too."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, ClassVar

from generators.tools import BaseTool, ToolResult
from generators.tools.calculator import evaluate, format_value


class LoggedCalculator(BaseTool):
    """A calculator with per-trajectory state that logs its lifecycle to `config.log_path`.

    Each call returns the value, then `config.padding` dots (to exercise truncation), and
    `config.reward` as the tool reward; `create_kwargs.tag` is kept for the instance and logged.
    """

    default_schema: ClassVar[dict[str, Any]] = {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "The arithmetic."}},
                "required": ["expression"],
            },
        },
    }

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema)
        self.log_path = Path(self.config["log_path"])
        self.instances: dict[str, str] = {}

    async def _log(self, line: str) -> None:
        def append() -> None:
            with self.log_path.open("a") as f:
                f.write(line + "\n")

        await asyncio.to_thread(append)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        assert instance_id is not None
        self.instances[instance_id] = str(kwargs.get("tag", ""))
        await self._log(f"create {instance_id} {self.instances[instance_id]}")
        return instance_id

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> ToolResult:
        await self._log(f"execute {instance_id} {self.instances[instance_id]}")
        text = format_value(evaluate(parameters["expression"])) + " " + "." * int(self.config.get("padding", 0))
        return ToolResult(text, float(self.config.get("reward", 0.0)))

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        del self.instances[instance_id]
        await self._log(f"release {instance_id}")
