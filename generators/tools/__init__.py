"""Tools for the tool-calling generator: schemas, lifecycle, YAML config, call parsing (hermes tags or
OpenAI `tool_calls`), truncation.

Kept light to import (the server imports this package at start): transformers is loaded only when a
function's schema is inferred, and the bundled calculator only when a config names it.
"""

from generators.tools.base import BaseTool, Tool, ToolResult, as_result, validate_schema
from generators.tools.calls import message_tool_calls
from generators.tools.config import ToolConfigError, load_tool_config, resolve_reference
from generators.tools.function import FunctionTool, function_tool, infer_schema
from generators.tools.registry import ToolRegistry
from generators.tools.session import CallLimits, ToolOutcome, ToolSession
from generators.tools.truncation import TRUNCATE_SIDES, TruncateSide, truncate_response
from rollout_buffer.generator_api import ToolCall, parse_tool_calls

__all__ = [
    "TRUNCATE_SIDES",
    "BaseTool",
    "CallLimits",
    "FunctionTool",
    "Tool",
    "ToolCall",
    "ToolConfigError",
    "ToolOutcome",
    "ToolRegistry",
    "ToolResult",
    "ToolSession",
    "TruncateSide",
    "as_result",
    "function_tool",
    "infer_schema",
    "load_tool_config",
    "message_tool_calls",
    "parse_tool_calls",
    "resolve_reference",
    "truncate_response",
    "validate_schema",
]
