"""The tool layer: schema inference, return values, hermes parsing, truncation, YAML config, call sessions."""

from __future__ import annotations

import asyncio
import functools
import threading
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
from transformers.utils.chat_template_utils import DocstringParsingException, TypeHintParsingException

from generators.tool_call import default_tool_config
from generators.tools import (
    BaseTool,
    CallLimits,
    FunctionTool,
    ToolCall,
    ToolConfigError,
    ToolRegistry,
    ToolResult,
    ToolSession,
    as_result,
    function_tool,
    load_tool_config,
    parse_tool_calls,
    truncate_response,
)
from generators.tools.calculator import calculator

FIXTURES = Path(__file__).parent / "tool_fixtures.py"


def in_event_loop(test: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test function in a fresh event loop."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(test(*args, **kwargs))

    return run


# ------------------------------------------------------------------ schema inference


def test_schema_is_inferred_from_hints_and_google_docstring() -> None:
    @function_tool
    def convert(amount: float, currency: Literal["EUR", "USD"], rounding: int | None = None) -> str:
        """Convert an amount of money.

        Args:
            amount: How much money, e.g. 12.5.
            currency: The currency to convert to.
            rounding: Digits after the decimal point.
        """
        return f"{amount} {currency}"

    assert convert.schema == {
        "type": "function",
        "function": {
            "name": "convert",
            "description": "Convert an amount of money.",
            "parameters": {
                "type": "object",
                "properties": {
                    "amount": {"type": "number", "description": "How much money, e.g. 12.5."},
                    "currency": {"type": "string", "enum": ["EUR", "USD"],
                                 "description": "The currency to convert to."},
                    "rounding": {"type": "integer", "nullable": True, "description": "Digits after the decimal point."},
                },
                "required": ["amount", "currency"],
            },
        },
    }
    assert convert(2.0, "EUR") == "2.0 EUR", "the decorated function can still be called"


def test_explicit_name_and_explicit_schema() -> None:
    @function_tool("calc")
    def evaluate(expression: str) -> str:
        """Evaluate.

        Args:
            expression: The arithmetic.
        """
        return expression

    assert evaluate.name == "calc" and evaluate.schema["function"]["name"] == "calc"
    schema = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object", "properties": {}}}}
    undocumented = function_tool(schema=schema)(lambda: "x")
    assert undocumented.name == "lookup" and undocumented.schema["function"]["description"] == ""


def test_functions_breaking_the_docstring_contract_are_refused() -> None:
    def no_doc(x: int) -> int:
        return x

    def undocumented_arg(x: int, y: int) -> int:
        """Add.

        Args:
            x: First.
        """
        return x + y

    def untyped(x) -> int:  # type: ignore[no-untyped-def]
        """Echo.

        Args:
            x: Anything.
        """
        return x

    def variadic(*xs: int) -> int:
        """Sum.

        Args:
            xs: Numbers.
        """
        return sum(xs)

    with pytest.raises(DocstringParsingException):
        function_tool(no_doc)
    with pytest.raises(DocstringParsingException):
        function_tool(undocumented_arg)
    with pytest.raises(TypeHintParsingException):
        function_tool(untyped)
    with pytest.raises(TypeError, match="list parameter"):
        function_tool(variadic)


def test_bundled_calculator_schema_and_values() -> None:
    assert calculator.schema["function"]["parameters"]["required"] == ["expression"]
    assert calculator("24 * 36 - 785") == "79"
    assert calculator("1,284 / 12") == "107"
    assert calculator("7 / 2") == "3.5" and calculator("0.1 + 0.2") == "0.3"
    for bad, reason in [("9 ** 9 ** 9", "too large"), ("1 / 0", "division by zero"),
                        ("__import__('os')", "unsupported"), ("2 +", "cannot parse")]:
        with pytest.raises(ValueError, match=reason):
            calculator(bad)


# ------------------------------------------------------------------ return values and execution


class _Response:
    text = "verl-style response"


@pytest.mark.parametrize(("value", "expected"), [
    ("plain", ToolResult("plain")),
    ({"b": 1, "a": [1, 2]}, ToolResult('{"b":1,"a":[1,2]}')),
    (42, ToolResult("42")),
    (("text", 0.5), ToolResult("text", 0.5)),
    (("text", None, None), ToolResult("text", 0.0, {})),
    (({"ok": True}, 1, {"calls": 2}), ToolResult('{"ok":true}', 1.0, {"calls": 2})),
    ((_Response(), -0.05, {}), ToolResult("verl-style response", -0.05)),
    (ToolResult("as is", 2.0), ToolResult("as is", 2.0)),
])
def test_return_values_are_normalised(value: Any, expected: ToolResult) -> None:
    assert as_result(value) == expected


def test_non_finite_reward_is_refused() -> None:
    with pytest.raises(ValueError, match="finite"):
        as_result(("text", float("nan")))


@in_event_loop
async def test_sync_functions_run_in_a_thread_without_blocking_the_loop() -> None:
    seen: list[int] = []

    @function_tool
    def slow(seconds: float) -> str:
        """Sleep.

        Args:
            seconds: How long.
        """
        seen.append(threading.get_ident())
        time.sleep(seconds)
        return "done"

    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        for _ in range(100):
            await asyncio.sleep(0.01)
            ticks += 1

    async def call() -> tuple[Any, int]:
        result = await slow.execute("", {"seconds": 0.3})
        return result, ticks

    ticking = asyncio.create_task(ticker())
    result, ticks_during_call = await call()
    ticking.cancel()
    assert result == ToolResult("done")
    assert seen != [threading.get_ident()], "ran in a worker thread"
    assert ticks_during_call >= 3, "the event loop kept running while the function slept"


# ------------------------------------------------------------------ hermes parsing


def test_hermes_calls_are_parsed_in_order() -> None:
    text = (
        "<think>\nMaybe <tool_call>{\"name\": \"ignored\", \"arguments\": {}}</tool_call>\n</think>\n\n"
        'First <tool_call>\n{"name": "calculator", "arguments": {"expression": "2 + 2"}}\n</tool_call>\n'
        '<tool_call>{"name": "lookup", "arguments": "{\\"q\\": \\"x\\"}"}</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "2 + 2"}),
        ToolCall("lookup", {"q": "x"}),
    ]
    assert parse_tool_calls("The answer is \\boxed{4}.") == []


def test_malformed_calls_are_kept_with_an_error() -> None:
    calls = parse_tool_calls(
        '<tool_call>{"name": "calculator", "arguments": {"expression": }</tool_call>'
        '<tool_call>{"arguments": {}}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
    )
    assert [c.error is not None for c in calls] == [True, True, True]
    assert "not valid JSON" in str(calls[0].error) and '"name"' in str(calls[1].error)
    assert calls[2].name == "calculator" and "JSON object" in str(calls[2].error)


# ------------------------------------------------------------------ truncation


def test_truncation_sides() -> None:
    text = "0123456789abcdefghij"
    assert truncate_response(text, 20, "left") == text
    assert truncate_response(text, 6, "left") == "012345...(truncated)"
    assert truncate_response(text, 6, "right") == "(truncated)...efghij"
    assert truncate_response(text, 6, "middle") == "012...(truncated)...hij"
    with pytest.raises(ValueError, match="truncate side"):
        truncate_response(text, 6, "top")  # type: ignore[arg-type]


# ------------------------------------------------------------------ YAML config


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_bundled_config_offers_the_calculator() -> None:
    registry = load_tool_config(default_tool_config())
    assert registry.names == ["calculator"] and registry.schemas == [calculator.schema]


def test_config_loads_functions_and_classes_by_module_and_file(tmp_path: Path) -> None:
    extra = write(tmp_path / "my_tools.py", '''
def shout(text: str) -> str:
    """Upper-case a text.

    Args:
        text: What to shout.
    """
    return text.upper()
''')
    cfg = write(tmp_path / "tools.yaml", f"""
tools:
  - function: generators.tools.calculator:calculator
    name: calc
  - function: {extra.name}:shout
  - class_name: {FIXTURES}:LoggedCalculator
    config: {{type: native, log_path: {tmp_path / 'log.txt'}, reward: 0.5}}
""")
    registry = load_tool_config(cfg)
    assert registry.names == ["calc", "shout", "calculator"]
    assert registry.schemas[1]["function"]["parameters"]["properties"]["text"]["description"] == "What to shout."
    tool = registry.get("calculator")
    assert isinstance(tool, BaseTool) and tool.config["reward"] == 0.5


@pytest.mark.parametrize(("body", "message"), [
    ("tools:\n  - function: generators.tools.calculator:calculator\n"
     "  - function: generators.tools.calculator.calculator\n", "two tools are named 'calculator'"),
    ("tools:\n  - function: generators.tools.calculator:nothing\n", "has no 'nothing'"),
    ("tools:\n  - class_name: no_such_module.Tool\n", "No module named 'no_such_module'"),
    ("tools:\n  - class_name: generators.tools.base.BaseTool\n", "needs a tool_schema"),
    ("tools:\n  - class_name: x.Y\n    config: {type: mcp}\n", "only native"),
    ("tools:\n  - function: a:b\n    class_name: c.D\n", "exactly one"),
    ("tools: [\n", "malformed"),
])
def test_config_errors_name_the_problem(tmp_path: Path, body: str, message: str) -> None:
    with pytest.raises(ToolConfigError, match=message):
        load_tool_config(write(tmp_path / "tools.yaml", body))


def test_missing_config_file(tmp_path: Path) -> None:
    with pytest.raises(ToolConfigError, match="cannot read"):
        load_tool_config(tmp_path / "absent.yaml")


# ------------------------------------------------------------------ sessions: limits, errors, lifecycle


class Probe(BaseTool):
    """Sleeps, counts how many calls overlap, and records its lifecycle."""

    default_schema: ClassVar[dict[str, Any]] = {"type": "function", "function": {"name": "probe", "parameters": {
        "type": "object", "properties": {"sleep": {"type": "number"}, "fail": {"type": "boolean"}}}}}

    def __init__(self, config: dict[str, Any] | None = None, tool_schema: dict[str, Any] | None = None) -> None:
        super().__init__(config, tool_schema)
        self.running = self.peak = 0
        self.events: list[tuple[str, ...]] = []

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        await asyncio.sleep(0.02)  # parallel first calls must still create one instance
        self.events.append(("create", str(instance_id), str(kwargs.get("tag"))))
        return f"{instance_id}/probe"

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(float(parameters.get("sleep", 0.05)))
            if parameters.get("fail"):
                raise RuntimeError("probe failed on purpose")
            self.events.append(("execute", instance_id, str(kwargs.get("mode"))))
            return "x" * 50, 0.25
        finally:
            self.running -= 1

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        self.events.append(("release", instance_id))


def probe_session(probe: Probe, **limits: Any) -> ToolSession:
    kwargs = {"probe": {"create_kwargs": {"tag": "row-7"}, "execute_kwargs": {"mode": "fast"}}}
    return ToolSession(ToolRegistry([probe, calculator]), "traj-1", CallLimits(**limits), kwargs)


@in_event_loop
async def test_parallel_call_limit() -> None:
    probe = Probe()
    session = probe_session(probe, max_parallel_calls=2)
    outcomes = await session.run([ToolCall("probe", {"sleep": 0.2}) for _ in range(3)])
    assert probe.peak == 2, "the first two calls ran together, the third not at all"
    assert [o.error is None for o in outcomes] == [True, True, False]
    assert outcomes[2].text == "Error: not run: at most 2 tool call(s) per turn"
    assert session.total_reward == 0.5
    await session.close()


@in_event_loop
async def test_instance_is_created_once_per_trajectory_and_released() -> None:
    probe = Probe()
    session = probe_session(probe, max_parallel_calls=4)
    await session.run([ToolCall("probe", {"sleep": 0.01}), ToolCall("probe", {"sleep": 0.01})])
    await session.run([ToolCall("probe", {"sleep": 0.01}), ToolCall("calculator", {"expression": "1 + 1"})])
    await session.close()
    assert probe.events[0] == ("create", "traj-1", "row-7")
    assert probe.events[1:4] == [("execute", "traj-1/probe", "fast")] * 3
    assert probe.events[4:] == [("release", "traj-1/probe")]


@in_event_loop
async def test_errors_become_tool_messages() -> None:
    probe = Probe()
    # A timeout far above what the other calls take on a loaded machine; the slow call never ends by itself.
    session = probe_session(probe, max_parallel_calls=8, timeout_s=2.0)
    calls = [
        ToolCall("probe", {"fail": True, "sleep": 0}),
        ToolCall("probe", {"sleep": 3600}),
        ToolCall("nope", {}),
        ToolCall("calculator", {"expression": "1 / 0"}),
        ToolCall("calculator", {"expr": "1"}),
        ToolCall("", error="the tool call is not valid JSON (x)"),
        ToolCall("calculator", {"expression": "6 * 7"}),
    ]
    outcomes = await session.run(calls)
    await session.close()
    texts = [o.message()["content"] for o in outcomes]
    assert texts[0] == "Error: RuntimeError: probe failed on purpose"
    assert texts[1] == "Error: probe took longer than 2s"
    assert texts[2] == "Error: unknown tool 'nope'; available: probe, calculator"
    assert texts[3] == "Error: ValueError: division by zero"
    assert texts[4].startswith("Error: TypeError:") and "expr" in texts[4]
    assert texts[5] == "Error: the tool call is not valid JSON (x)"
    assert outcomes[6].message() == {"role": "tool", "name": "calculator", "content": "42"}
    assert session.total_reward == 0.0, "failed calls give no reward"
    assert probe.events[-1] == ("release", "traj-1/probe")


@in_event_loop
async def test_responses_are_truncated_in_the_session() -> None:
    session = probe_session(Probe(), max_response_length=10, truncate_side="right")
    [outcome] = await session.run([ToolCall("probe", {"sleep": 0})])
    await session.close()
    assert outcome.text == "(truncated)..." + "x" * 10 and outcome.reward == 0.25


def test_function_tool_repr_names_the_function() -> None:
    assert isinstance(calculator, FunctionTool)
    assert "generators.tools.calculator.calculator" in repr(calculator)
