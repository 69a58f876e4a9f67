"""Loading the Python code an agent run names (the `agent` callable, a scorer hook).

A reference is `path/to/file.py:function` (a relative path is read from the server's working directory) or
`package.module:function`. The server's policy decides which a client may name (`--allow-code` for files,
`--allow-module` for modules; `rollout_buffer.policy`) before anything here imports them.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import Any

from generators.tools.config import resolve_reference


def check_reference(ref: str, field: str) -> Callable[..., Any]:
    """The function `ref` names, loaded (the server's policy allowed it: `rollout_buffer.policy`); ValueError
    naming `field` when it is malformed or not a function."""
    module_part, sep, attr = ref.rpartition(":")
    if not sep or not module_part or not attr:
        raise ValueError(f"{field}: {ref!r} is not a reference like path/file.py:function or module:function")
    try:
        fn = resolve_reference(ref, Path.cwd())
    except Exception as e:  # an import error of the user's module is the request's fault here
        raise ValueError(f"{field}: cannot load {ref!r}: {type(e).__name__}: {e}") from None
    if not callable(fn):
        raise ValueError(f"{field}: {ref!r} is not a function")
    return fn


async def call(fn: Callable[..., Any], *args: Any, executor: Executor | None = None, **kwargs: Any) -> Any:
    """Call a sync or async function; a sync one runs in a worker thread of `executor` (agents block on HTTP
    for seconds: they get threads of their own rather than the loop's default pool)."""
    if inspect.iscoroutinefunction(fn):
        return await fn(*args, **kwargs)
    loop = asyncio.get_running_loop()
    result = await loop.run_in_executor(executor, functools.partial(fn, *args, **kwargs))
    return await result if inspect.isawaitable(result) else result


def accepted(fn: Callable[..., Any], offered: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `offered` that `fn` declares (or all of them when it takes **kwargs)."""
    params = inspect.signature(fn).parameters
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return offered
    return {k: v for k, v in offered.items() if k in params}
