"""Tool calls in the hermes format (Qwen, Hermes, many others): `<tool_call>{"name", "arguments"}</tool_call>`.

Only the text after the reasoning (`</think>`) is read: a model thinking about a call has not made it.
A block that is not a JSON object with a string `name` and object `arguments` is kept as a call with an
`error`, so the model is told its call was malformed instead of being silently ignored. `arguments`
given as a JSON string (some models double-encode) is decoded.

Used by the tool-calling generators and by the agent proxy, which turns the calls into OpenAI `tool_calls`
and Anthropic `tool_use` blocks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import orjson

_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made; `error` says why it cannot run when it is malformed.

    `id` is the call's OpenAI id when it came as a structured `tool_calls` entry (see `generators.tools.calls`);
    hermes tags carry none.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str | None = None
    id: str | None = None


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of one assistant message, in order; [] when it makes none."""
    answer = text.rsplit("</think>", 1)[-1]
    return [parse_call_body(body) for body in _CALL.findall(answer)]


def split_tool_calls(answer: str) -> tuple[str, list[ToolCall]]:
    """(the text with every `<tool_call>` block removed, the calls in order) of a reply without reasoning."""
    calls = [parse_call_body(body) for body in _CALL.findall(answer)]
    return (_CALL.sub("", answer) if calls else answer), calls


def parse_call_body(body: str) -> ToolCall:
    """The call written between `<tool_call>` and `</tool_call>`, or one with the `error` that makes it unusable."""
    try:
        call = orjson.loads(body.strip())
    except orjson.JSONDecodeError as e:
        return ToolCall("", error=f"the tool call is not valid JSON ({e})")
    if not isinstance(call, dict):
        return ToolCall("", error='the tool call needs a "name" string')
    return tool_call(call.get("name"), call.get("arguments", {}))


def tool_call(name: Any, arguments: Any, call_id: str | None = None) -> ToolCall:
    """A call from its name and arguments (an object, or a JSON string of one), or one with the `error`."""
    if not isinstance(name, str) or not name:
        return ToolCall("", error='the tool call needs a "name" string', id=call_id)
    if isinstance(arguments, str):
        try:
            arguments = orjson.loads(arguments) if arguments.strip() else {}
        except orjson.JSONDecodeError as e:
            return ToolCall(name, error=f"the arguments of {name} are not valid JSON ({e})", id=call_id)
    if not isinstance(arguments, dict):
        return ToolCall(name, error=f'the "arguments" of {name} must be a JSON object', id=call_id)
    return ToolCall(name, arguments, id=call_id)
