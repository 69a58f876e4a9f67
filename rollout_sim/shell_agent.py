"""The simulated engine as a coding agent's model: when the prompt offers a shell tool in a coding agent's own
format (Claude Code's `Bash`, Codex's `exec_command`, a `shell` tool), it runs one command, then answers with
what the command printed.

The command is the first one the task quotes in backticks (``Run `ls -a` here``), else `ls`. The turn after
the tool's response (the last `<tool_response>` since the task) ends the episode with its last lines (agents put
their own scaffolding before the command's output). So a
session through a real agent goes: model turn calling the tool, the agent runs it, the tool's output, model turn,
final answer.
"""

from __future__ import annotations

import json
import re
from typing import Any

# tool name -> its command parameter, for the agents whose shell tool this policy knows
SHELL_TOOLS = {"Bash": "command", "exec_command": "cmd", "shell": "command", "bash": "command"}
_TOOLS = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)
_QUOTED = re.compile(r"`([^`\n]+)`")
# A tool's answer as Qwen's template renders it (every scripted policy reads them this way).
TOOL_RESPONSE = re.compile(r"<tool_response>\s*(.*?)\s*</tool_response>", re.DOTALL)
_SHOWN_LINES = 3


def shell_tool(text: str) -> tuple[str, str, bool] | None:
    """(name, command parameter, whether it takes an argv list) of the shell tool the prompt offers, if any."""
    found = _TOOLS.search(text)
    if found is None:
        return None
    for line in found.group(1).splitlines():
        try:
            tool: Any = json.loads(line)
        except json.JSONDecodeError:
            continue
        function = tool.get("function", tool) if isinstance(tool, dict) else {}
        name = function.get("name") if isinstance(function, dict) else None
        if name in SHELL_TOOLS:
            param = SHELL_TOOLS[name]
            schema = (function.get("parameters") or {}).get("properties", {}).get(param, {})
            return name, param, isinstance(schema, dict) and schema.get("type") == "array"
    return None


def _task(text: str) -> tuple[str, str]:
    """(the last user turn that is not a tool response, the conversation after it)."""
    at = len(text)
    while (at := text.rfind("<|im_start|>user", 0, at)) >= 0:
        body_start = at + len("<|im_start|>user")
        end = text.find("<|im_end|>", body_start)
        body = text[body_start:end if end >= 0 else len(text)].strip()
        if not body.startswith("<tool_response>"):
            return body, text[end if end >= 0 else len(text):]
    return "", text


def shell_reply(text: str) -> str:
    """The next turn of a coding agent's model: a shell call, or the answer once the call was answered."""
    tool = shell_tool(text)
    assert tool is not None, "the shell policy applies only where a shell tool is offered"
    name, param, argv = tool
    task, after = _task(text)
    responses = TOOL_RESPONSE.findall(after)
    if responses:
        lines = [line for line in responses[-1].splitlines() if line.strip()][-_SHOWN_LINES:]
        shown = "\n".join(lines) if lines else "(nothing)"
        return f"<think>\nThe command ran; I will report its output.\n</think>\n\nThe command printed:\n{shown}"
    quoted = _QUOTED.search(task)
    command = quoted.group(1) if quoted else "ls"
    value: Any = ["bash", "-lc", command] if argv else command
    call = json.dumps({"name": name, "arguments": {param: value}})
    return f"<think>\nI will run `{command}` with the {name} tool.\n</think>\n\n<tool_call>\n{call}\n</tool_call>"
