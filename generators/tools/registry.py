"""The tools of one run by name, and the schemas the chat template shows the model."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from generators.tools.base import Tool


class ToolRegistry:
    """Tools keyed by the name the model calls them by; a name may be registered once."""

    def __init__(self, tools: Iterable[Tool] = ()) -> None:
        self._tools: dict[str, Tool] = {}
        for tool in tools:
            self.add(tool)

    def add(self, tool: Tool) -> None:
        """Register `tool`; ValueError when its name is taken."""
        if tool.name in self._tools:
            raise ValueError(f"two tools are named {tool.name!r}: {self._tools[tool.name]!r} and {tool!r}")
        self._tools[tool.name] = tool

    def get(self, name: str) -> Tool | None:
        """The tool called `name`, or None."""
        return self._tools.get(name)

    @property
    def names(self) -> list[str]:
        """Tool names in registration order."""
        return list(self._tools)

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The OpenAI schemas, for `apply_chat_template(..., tools=...)`."""
        return [tool.schema for tool in self._tools.values()]

    def __len__(self) -> int:
        return len(self._tools)

    def __contains__(self, name: object) -> bool:
        return name in self._tools

    def __iter__(self) -> Iterator[Tool]:
        return iter(self._tools.values())
