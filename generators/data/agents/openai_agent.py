"""A calculator agent written with the plain `openai` package, and nothing of rollout-buffer.

Point it at any OpenAI-compatible endpoint. Trained through rollout-buffer, it runs either way:
- as a function, run option `agent: <this file>:agent` — `agent(item, base_url, api_key)` returns the answer;
- as a command, run option `agent_command: [python, <this file>]` — the row comes on stdin, the endpoint from
  OPENAI_BASE_URL / OPENAI_API_KEY, and the answer is the last line it prints.
"""

from __future__ import annotations

import ast
import json
import operator
import os
import sys
from collections.abc import Callable
from typing import Any

from openai import OpenAI
from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam

SYSTEM_PROMPT = "You are a careful assistant. Use the calculator tool for arithmetic."
TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "calculator",
            "description": "Evaluate an arithmetic expression with + - * / and brackets.",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string", "description": "e.g. 24 * 36 - 785"}},
                "required": ["expression"],
            },
        },
    }
]
_OPERATORS: dict[type[ast.AST], Callable[..., float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.USub: operator.neg}


def calculator(expression: str) -> str:
    """The value of an arithmetic expression, or an error message."""

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"Error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


def agent(item: dict[str, Any], base_url: str, api_key: str, max_turns: int = 8) -> str:
    """Ask the model, run its calculator calls, until it answers; return the answer."""
    client = OpenAI(base_url=base_url, api_key=api_key)
    messages: list[ChatCompletionMessageParam] = [{"role": "system", "content": SYSTEM_PROMPT},
                                                  {"role": "user", "content": item["prompt"]}]
    for _ in range(max_turns):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        if not message.tool_calls:
            return message.content or ""
        calls = [call for call in message.tool_calls if call.type == "function"]  # the only tools offered
        messages.append({"role": "assistant", "content": message.content, "tool_calls": [
            {"id": call.id, "type": "function",
             "function": {"name": call.function.name, "arguments": call.function.arguments}} for call in calls]})
        for call in calls:
            arguments = json.loads(call.function.arguments)
            messages.append({"role": "tool", "tool_call_id": call.id, "content": calculator(**arguments)})
    return ""


if __name__ == "__main__":
    print(agent(json.load(sys.stdin), os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]))
