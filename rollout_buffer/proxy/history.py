"""A request's history converted to canonical messages and match keys, reusing what the session's previous request
already converted.

Agents resend their whole history every turn: hundreds of messages for a coding agent's session, each costing a
few microseconds to convert (its content parts read, its tool calls decoded, its match key built). A session
keeps its last request's raw items (as the JSON parser gave them) with what they became; the next request's
items are compared with them (equality of parsed JSON, done in C) and only the items past the common prefix are
converted. Consecutive assistant messages merge into one (a reply's text and its calls sent apart), so what is
reused ends at a *boundary*: after an item whose last message is not an assistant's, where no later item can
merge into what came before.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.proxy.messages import MessageKey, merged_assistant, message_key

# Converts one raw item (its index given, for error messages) into canonical messages; `calls` (an ordered set)
# holds the tool call ids of the items before it, and gets those the item makes.
ItemConverter = Callable[[Any, int, dict[str, None]], list[dict[str, Any]]]


@dataclass
class Converted:
    """A history converted: merged canonical messages, a match key each, the tool call ids its items made."""

    messages: list[dict[str, Any]]
    keys: list[MessageKey]
    calls: dict[str, None]


@dataclass
class HistoryCache:
    """One session's last converted history (see the module docstring)."""

    head: Any = None
    raw: list[Any] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    keys: list[MessageKey] = field(default_factory=list)
    calls: list[str] = field(default_factory=list)
    # (raw items, messages, calls) at each boundary, in order
    boundaries: list[tuple[int, int, int]] = field(default_factory=list)

    def convert(self, head: Any, head_messages: list[dict[str, Any]], raw: list[Any], one: ItemConverter
                ) -> Converted:
        """`head_messages` (what stands before the items: a system prompt, instructions) and the items of `raw`,
        converted by `one`, merged; the part the previous request shared (same head, same leading items) is
        reused. A converter's WireError leaves the cache as it was."""
        start, at = (0, len(head_messages), 0), 0
        if head == self.head and self.boundaries:
            n = len(self.raw)
            if len(raw) >= n and raw[:n] == self.raw:  # the usual case, compared in one go
                same = n
            else:
                n, same = min(n, len(raw)), 0
                while same < n and raw[same] == self.raw[same]:
                    same += 1
            at = bisect.bisect_right(self.boundaries, (same, math.inf, math.inf)) - 1
            start = self.boundaries[at]
        items, count, call_count = start
        reused = items > 0
        messages = self.messages[:count] if reused else list(head_messages)
        keys = self.keys[:count] if reused else [message_key(m) for m in head_messages]
        calls = dict.fromkeys(self.calls[:call_count]) if reused else {}
        boundaries = self.boundaries[:at + 1] if reused else [start]
        for i in range(items, len(raw)):
            for m in one(raw[i], i, calls):
                if m["role"] == "assistant" and messages and messages[-1]["role"] == "assistant":
                    messages[-1] = merged_assistant(messages[-1], m)
                    keys[-1] = message_key(messages[-1])
                else:
                    messages.append(m)
                    keys.append(message_key(m))
            if messages and messages[-1]["role"] != "assistant":
                boundaries.append((i + 1, len(messages), len(calls)))
        self.head, self.raw, self.boundaries = head, raw, boundaries
        self.messages, self.keys, self.calls = messages, keys, list(calls)
        return Converted(list(messages), list(keys), dict(calls))
