"""Every name a generator module may define, in one place: what the buffer calls, with what, and when.

A generator is a module; discovery (`plugins`) checks each name it defines against this table (a hook that is not
callable, an `async` one where a plain function is called or the reverse, one that cannot take the arguments the
buffer passes) and refuses the module with the reason, so a mistake shows at start-up instead of mid-run.
`docs/generators.md` is the guide; the names are slime's where slime has one.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Literal


@dataclass(frozen=True)
class Hook:
    """A function a generator may define: the arguments the buffer passes, whether it is awaited, and when."""

    name: str
    args: tuple[str, ...]
    kind: Literal["async", "sync", "either"]
    when: str


@dataclass(frozen=True)
class Constant:
    """A value a generator may define."""

    name: str
    types: tuple[type, ...]
    when: str


HOOKS: dict[str, Hook] = {h.name: h for h in (
    Hook("run_rollout", ("item", "ctx"), "either",
         "async: one trajectory from one input row with a RolloutContext (native); sync, one argument: the "
         "whole rollout of a slime-style generator, which posts its own records"),
    Hook("check_payload", ("payload", "policy"), "sync",
         "at /start_rollout and /start_eval, in a thread: raise ValueError naming the option (a 422) or "
         "PolicyRefused (a 403)"),
    Hook("input_required", ("payload",), "sync", "whether this run needs an input file"),
    Hook("default_input", ("payload", "runs_here"), "async",
         "the generator's own rows when no input_file is named; runs_here: whether its trajectories run here"),
    Hook("runs_in_buffer", ("payload",), "sync", "whether this run's trajectories must run in the buffer process"),
    Hook("is_valid_group", ("group",), "sync", "slime's: False drops a complete group (in a thread, bounded)"),
    Hook("transform_group", ("group",), "sync", "slime's: the group's records rewritten (in a thread, bounded)"),
    Hook("get_group_data_meta_info", ("groups",), "sync", "slime's: extra meta_info of a delivered batch"),
)}

CONSTANTS: dict[str, Constant] = {c.name: c for c in (
    Constant("TASK_TYPE", (str,), "the run option task_type that selects the generator (required)"),
    Constant("REQUIRED_FIELDS", (tuple, list),
             "fields every input line must have; a tuple inside is a choice (one of them)"),
    Constant("RUNS_IN_BUFFER", (bool,), "every run's trajectories in the buffer process, whatever the executor"),
)}


def problems(module: Any) -> list[str]:
    """What is wrong with the hooks and constants `module` defines (empty when nothing is)."""
    found = []
    for name, constant in CONSTANTS.items():
        value = getattr(module, name, None)
        if value is not None and not isinstance(value, constant.types):
            found.append(f"{name} must be {' or '.join(t.__name__ for t in constant.types)}, not "
                         f"{type(value).__name__}")
    for name, hook in HOOKS.items():
        fn = getattr(module, name, None)
        if fn is None:
            continue
        if not callable(fn):
            found.append(f"{name} must be a function ({hook.when})")
            continue
        is_async = inspect.iscoroutinefunction(fn)
        if hook.kind != "either" and is_async != (hook.kind == "async"):
            found.append(f"{name} must be {'async def' if hook.kind == 'async' else 'a plain def'} ({hook.when})")
        args = hook.args if hook.name != "run_rollout" or is_async else ("data",)
        try:
            inspect.signature(fn).bind(*args)
        except TypeError:
            found.append(f"{name} must take ({', '.join(args)}) ({hook.when})")
        except ValueError:  # no signature to read (a builtin): taken as it is
            pass
    return found
