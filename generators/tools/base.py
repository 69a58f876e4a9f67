"""What every tool is: an OpenAI function schema and a create / execute / release lifecycle.

Two kinds implement it: `FunctionTool` (a plain function, `generators.tools.function`) and subclasses of
`BaseTool` below (state per trajectory: sandboxes, scratch files, an answer being graded). The generator
creates a tool's instance at the tool's first call in a trajectory and releases it when the trajectory
ends, so `instance_id` names one trajectory's state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Protocol, runtime_checkable

import orjson
from pydantic import BaseModel, ConfigDict, Field


class FunctionSpec(BaseModel):
    """The `function` part of an OpenAI tool schema."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str = ""
    parameters: dict[str, Any] = Field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolSchema(BaseModel):
    """An OpenAI function tool schema, as chat templates and `/v1/chat/completions` take it."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"] = "function"
    function: FunctionSpec


def validate_schema(schema: dict[str, Any]) -> dict[str, Any]:
    """`schema` checked against the OpenAI function-tool shape, returned as a plain dict.

    Raises pydantic's ValidationError naming the bad field.
    """
    return ToolSchema.model_validate(schema).model_dump(exclude_none=True)


@dataclass(frozen=True)
class ToolResult:
    """What one call gives back: the text the model reads, a reward for the trajectory and metrics."""

    text: str
    reward: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)


def as_result(value: Any) -> ToolResult:
    """Normalise what a tool returned into a `ToolResult`.

    Accepted: a `ToolResult`; `(response, reward)` or `(response, reward, metrics)` with `None` read as
    0.0 / `{}`; a string (the text); an object with a `text` attribute (verl's `ToolResponse`); anything
    else is JSON-encoded. Raises ValueError for a reward that is not a finite number.
    """
    if isinstance(value, ToolResult):
        return _checked(value)
    if isinstance(value, tuple) and len(value) in (2, 3):
        reward = 0.0 if value[1] is None else value[1]
        metrics = value[2] if len(value) == 3 and value[2] is not None else {}
        if not isinstance(reward, int | float) or isinstance(reward, bool):
            raise ValueError(f"tool reward must be a number, got {type(reward).__name__}")
        return _checked(ToolResult(as_result(value[0]).text, float(reward), dict(metrics)))
    if isinstance(value, str):
        return ToolResult(value)
    text = getattr(value, "text", None)
    if isinstance(text, str) or (text is None and hasattr(value, "text")):
        return ToolResult(text or "")
    try:
        return ToolResult(orjson.dumps(value, option=orjson.OPT_NON_STR_KEYS).decode())
    except TypeError:
        return ToolResult(str(value))


def _checked(result: ToolResult) -> ToolResult:
    if not math.isfinite(result.reward):
        raise ValueError(f"tool reward must be finite, got {result.reward}")
    return result


@runtime_checkable
class Tool(Protocol):
    """The interface the generator calls; `FunctionTool` and `BaseTool` implement it."""

    @property
    def name(self) -> str: ...

    @property
    def schema(self) -> dict[str, Any]: ...

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str: ...

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any: ...

    async def release(self, instance_id: str, **kwargs: Any) -> None: ...


class SchemaHolder:
    """`name` and `schema` of a tool that keeps its validated OpenAI schema in `_schema`."""

    _schema: dict[str, Any]

    @property
    def name(self) -> str:
        """The function name the model calls."""
        return str(self._schema["function"]["name"])

    @property
    def schema(self) -> dict[str, Any]:
        """The OpenAI schema put into the chat template."""
        return self._schema


class BaseTool(SchemaHolder):
    """A tool with per-trajectory state: subclass it, override `execute` (and `create` / `release`).

    The YAML config builds one object per run with `config` (the entry's `config` mapping) and
    `tool_schema` (the entry's `tool_schema`, else the class attribute `default_schema`). `execute` may
    return anything `as_result` accepts; `create` kwargs and `execute` kwargs come from the input row's
    `tools_kwargs.<tool name>.create_kwargs` / `execute_kwargs`, as in verl.
    """

    default_schema: ClassVar[dict[str, Any] | None] = None

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        schema = tool_schema if tool_schema is not None else self.default_schema
        if schema is None:
            raise ValueError(f"{type(self).__name__} needs a tool_schema (in the config or as default_schema)")
        self.config: dict[str, Any] = dict(config or {})
        self._schema = validate_schema(schema)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Set up one trajectory's state; returns the instance id later calls use."""
        return instance_id or ""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        """Run one call with the model's arguments."""
        raise NotImplementedError(f"{type(self).__name__}.execute")

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Tear down one trajectory's state."""
