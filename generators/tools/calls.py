"""The tool calls of an assistant message, in either shape they arrive in.

Chat mode against SGLang started with `--tool-call-parser` answers OpenAI `tool_calls` (the call tags are
taken out of the content); token mode, and chat mode without a parser, leave hermes `<tool_call>` tags in
the content. A structured call keeps its `id`, which the tool message answering it carries as
`tool_call_id`.
"""

from __future__ import annotations

from typing import Any

from rollout_buffer.generator_api import ToolCall, parse_tool_calls, tool_call


def message_tool_calls(message: dict[str, Any]) -> list[ToolCall]:
    """The calls of one assistant message, in order: its `tool_calls` when it has any, else the hermes tags of
    its content; [] when it makes none."""
    structured = message.get("tool_calls")
    if structured:
        calls = []
        for entry in structured:
            function = entry.get("function") if isinstance(entry, dict) else None
            if not isinstance(function, dict):
                calls.append(ToolCall("", error='the tool call needs a "function" object'))
                continue
            calls.append(tool_call(function.get("name"), function.get("arguments", {}), entry.get("id")))
        return calls
    content = message.get("content")
    return parse_tool_calls(content) if isinstance(content, str) else []
