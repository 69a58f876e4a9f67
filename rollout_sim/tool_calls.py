"""What SGLang's OpenAI chat server does with tool calls, for the simulated engine.

Two behaviours of `sglang/srt/entrypoints/openai/serving_chat.py`:

- every request: string `function.arguments` of assistant `tool_calls` in the history are parsed to
  objects before the chat template renders them (a string that is not a JSON object is refused);
- with `--tool-call-parser qwen` (or its older name `qwen25`), and a request with `tools` and a
  `tool_choice` other than `none`: an answer containing `<tool_call>\\n…\\n</tool_call>` blocks (Qwen 2.5 /
  Qwen3's hermes format, `Qwen25Detector`) comes back as OpenAI `message.tool_calls` (`id` `call_` + 24 hex
  digits, `index`, `type`, `function.name`, `function.arguments` as a JSON string written with
  `ensure_ascii=False`), the content is the text before the first block, stripped, and a `stop` finish
  becomes `tool_calls`. Blocks that are not JSON, and calls of tools the request did not offer, are
  dropped, as SGLang drops them.
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from typing import Any

logger = logging.getLogger(__name__)

# SGLang's parser names that select its Qwen25Detector.
TOOL_CALL_PARSERS = ("qwen", "qwen25")
_BOT, _EOT = "<tool_call>\n", "\n</tool_call>"
_BLOCK = re.compile(re.escape(_BOT) + "(.*?)" + re.escape(_EOT), re.DOTALL)


def normalize_history(messages: list[dict[str, Any]]) -> None:
    """Parse the JSON-string arguments of assistant tool calls in place; ValueError as SGLang words it."""
    for message in messages:
        if message.get("role") != "assistant" or not isinstance(message.get("tool_calls"), list):
            continue
        for call in message["tool_calls"]:
            function = call.get("function") if isinstance(call, dict) else None
            if not isinstance(function, dict) or not isinstance(function.get("arguments"), str):
                continue
            try:
                arguments = json.loads(function["arguments"])
            except json.JSONDecodeError as e:
                raise ValueError("Assistant tool call function.arguments must be valid JSON.") from e
            if not isinstance(arguments, dict):
                raise ValueError("Assistant tool call function.arguments must be a JSON object.")
            function["arguments"] = arguments


def parse_tool_calls(text: str, tools: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]]] | None:
    """(content, tool_calls) of an answer that contains calls, or None when it contains none."""
    if _BOT not in text:
        return None
    indices = {t.get("function", {}).get("name"): i for i, t in enumerate(tools)}
    calls = []
    for block in _BLOCK.findall(text):
        try:
            action = json.loads(block.strip())
        except json.JSONDecodeError as e:
            logger.warning("Failed to parse JSON part: %s, JSON parse error: %s", block, e)
            continue
        name = action.get("name") if isinstance(action, dict) else None
        if not name or name not in indices:
            logger.warning("Model attempted to call undefined function: %s", name)
            continue
        arguments = action.get("parameters") or action.get("arguments", {})
        calls.append({
            "id": f"call_{uuid.uuid4().hex[:24]}",
            "index": indices[name],
            "type": "function",
            "function": {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)},
        })
    return text[: text.index(_BOT)].strip(), calls
