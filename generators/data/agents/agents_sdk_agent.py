"""A calculator agent written with the OpenAI Agents SDK (`openai-agents`), and nothing of rollout-buffer.

Trained through rollout-buffer with the run option `agent: <this file>:agent`: `agent(item, base_url, api_key)`
runs the SDK's agent loop against the session's OpenAI endpoint and returns the final output.
"""

from __future__ import annotations

import ast
import operator
from collections.abc import Callable
from typing import Any

from agents import Agent, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

INSTRUCTIONS = "You are a careful assistant. Use the calculator tool for arithmetic."
_OPERATORS: dict[type[ast.AST], Callable[..., float]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.USub: operator.neg}


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and brackets.

    Args:
        expression: The expression, e.g. 24 * 36 - 785.
    """

    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError("not arithmetic")

    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else str(result)


async def agent(item: dict[str, Any], base_url: str, api_key: str) -> str:
    """Run the SDK's agent loop on the row's prompt; its final output is the answer."""
    set_tracing_disabled(True)  # traces would go to OpenAI with this key
    model = OpenAIChatCompletionsModel(model="policy", openai_client=AsyncOpenAI(base_url=base_url, api_key=api_key))
    calculator_agent = Agent(name="calculator", instructions=INSTRUCTIONS, tools=[calculator], model=model)
    result = await Runner.run(calculator_agent, item["prompt"], max_turns=8)
    return str(result.final_output)
