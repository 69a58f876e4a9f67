"""Plain Python functions as tools, their schema inferred by `transformers.utils.get_json_schema`.

The function's type hints give the parameter types and its Google-style docstring gives the description
and the per-argument descriptions (`Args:`); parameters without a default are required. A function that
breaks that contract (no docstring, an untyped or undocumented parameter) is refused when it is
registered, with transformers' `DocstringParsingException` / `TypeHintParsingException`. Async functions
are awaited; sync ones run in a worker thread so they never block the event loop.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from typing import Any

from generators.tools.base import SchemaHolder, as_result, validate_schema


def infer_schema(fn: Callable[..., Any], name: str | None = None) -> dict[str, Any]:
    """The OpenAI function schema of `fn` from its signature and docstring.

    `*args` / `**kwargs` cannot be expressed in JSON Schema and raise TypeError. The `return` entry
    transformers adds is dropped: it is not part of OpenAI's function schema.
    """
    # Imported here: transformers takes most of a second to import, which a server start should not pay.
    from transformers.utils import get_json_schema

    variadic = [p.name for p in inspect.signature(fn).parameters.values()
                if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    if variadic:
        raise TypeError(f"tool function {fn.__qualname__} takes *{variadic[0]}: use a list parameter instead")
    schema = get_json_schema(fn)
    schema["function"].pop("return", None)
    if name is not None:
        schema["function"]["name"] = name
    return validate_schema(schema)


class FunctionTool(SchemaHolder):
    """A function registered as a tool; calling the object still calls the function."""

    def __init__(self, fn: Callable[..., Any], name: str | None = None,
                 schema: dict[str, Any] | None = None) -> None:
        self.fn = fn
        self._schema = validate_schema(schema) if schema is not None else infer_schema(fn, name)
        if name is not None:
            self._schema["function"]["name"] = name
        self._is_async = inspect.iscoroutinefunction(fn)
        functools.update_wrapper(self, fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"FunctionTool({self.name!r}, {self.fn.__module__}.{self.fn.__qualname__})"

    def renamed(self, name: str) -> FunctionTool:
        """The same function under another tool name."""
        return FunctionTool(self.fn, name=name, schema=self._schema)

    async def create(self, instance_id: str | None = None, **kwargs: Any) -> str:
        """Function tools keep no state: nothing to create."""
        return instance_id or ""

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs: Any) -> Any:
        """`fn(**parameters)`, awaited or in a thread; the result normalised by `as_result`."""
        if self._is_async:
            value = await self.fn(**parameters)
        else:
            value = await asyncio.to_thread(functools.partial(self.fn, **parameters))
        return as_result(value)

    async def release(self, instance_id: str, **kwargs: Any) -> None:
        """Function tools keep no state: nothing to release."""


def function_tool(fn_or_name: Callable[..., Any] | str | None = None, /, *, name: str | None = None,
                  schema: dict[str, Any] | None = None) -> Any:
    """Register a function as a tool: `@function_tool`, `@function_tool("name")` or `@function_tool(schema=...)`.

    Bare, the function's name is the tool name; a name given overrides it; `schema` bypasses inference.
    """
    if callable(fn_or_name):
        return FunctionTool(fn_or_name, name=name, schema=schema)
    chosen = fn_or_name if fn_or_name is not None else name

    def decorate(fn: Callable[..., Any]) -> FunctionTool:
        return FunctionTool(fn, name=chosen, schema=schema)

    return decorate
