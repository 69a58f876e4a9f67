"""The model's raw output of one turn, parsed into what the wire formats send back.

`<think>…</think>` becomes the reasoning; hermes `<tool_call>` blocks (only when the request offered tools)
become tool calls and leave the visible text. A malformed call (not JSON, no name, arguments not an object)
is not turned into a call: the reply is sent as text, as the model wrote it, and the turn is counted as
ill-formed in the record. The exact tokens are untouched by any of this: the session keeps the engine's ids.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.generation.hermes import split_tool_calls
from rollout_buffer.proxy.messages import MessageKey, assistant_message, message_key, tool_call


@dataclass(frozen=True)
class ReplyCall:
    """One tool call of a reply, with the id sent to the client."""

    id: str
    name: str
    arguments: dict[str, Any]


@dataclass
class Reply:
    """One assistant turn as the client sees it, and what it cost."""

    text: str
    reasoning: str
    calls: list[ReplyCall]
    # "stop" | "length" | "tool_calls" | "stop_sequence"
    finish: str
    prompt_tokens: int
    completion_tokens: int
    stop_sequence: str | None = None
    ill_formed: bool = False
    call_errors: list[str] = field(default_factory=list)

    def key(self) -> MessageKey:
        """The match key of this reply as the client will echo it."""
        calls = [tool_call(c.name, c.arguments) for c in self.calls]
        return message_key(assistant_message(self.text, calls))


def parse_reply(raw: str, tools_offered: bool) -> tuple[str, str, list[ReplyCall], list[str]]:
    """(visible text, reasoning, tool calls, errors of malformed calls) of a raw assistant output."""
    reasoning, answer = "", raw
    if "</think>" in raw:
        head, answer = raw.split("</think>", 1)
        reasoning = head.split("<think>", 1)[-1].strip()
    if not tools_offered:
        return answer.strip(), reasoning, [], []
    text, calls = split_tool_calls(answer)
    errors = [c.error for c in calls if c.error is not None]
    if errors:
        return answer.strip(), reasoning, [], errors
    return text.strip(), reasoning, [ReplyCall(_call_id(), c.name, c.arguments) for c in calls], []


def _call_id() -> str:
    return f"call_{secrets.token_hex(12)}"
