"""Generator discovery: the built-in `generators` package, installed entry points and configured paths.

A generator is a module with `TASK_TYPE` and `run_rollout`. The native form is
`async def run_rollout(item, ctx)`; a sync `run_rollout(data)` is a slime-style generator that drives the
whole rollout itself and posts records to `/buffer/write`. Every other name a generator may define is declared in
`hooks`, which discovery checks each module against.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import inspect
import logging
import pkgutil
import sys
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from rollout_buffer.generation.hooks import HOOKS, problems
from rollout_buffer.generation.inputs import RequiredField

log = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "rollout_buffer.generators"
BUILTIN_PACKAGE = "generators"


class PluginError(ValueError):
    """A generator could not be loaded, or two claim the same TASK_TYPE."""


@dataclass(frozen=True)
class Generator:
    """A loaded generator module and where it came from."""

    task_type: str
    module: ModuleType
    origin: str

    @property
    def native(self) -> bool:
        """True for `async def run_rollout(item, ctx)`; False for slime-style sync generators."""
        return inspect.iscoroutinefunction(self.module.run_rollout)

    def needs_buffer_process(self, payload: dict[str, Any]) -> bool:
        """True when a run of the generator with this start payload must run its trajectories in the buffer
        process whatever the executor: its optional `runs_in_buffer(payload)` hook says so, else
        `RUNS_IN_BUFFER = True`."""
        hook = self.hook("runs_in_buffer")
        if hook is not None:
            return bool(hook(payload))
        return bool(getattr(self.module, "RUNS_IN_BUFFER", False))

    @property
    def required_fields(self) -> Sequence[RequiredField]:
        """The fields every input line must have (`REQUIRED_FIELDS`; a tuple inside is a choice)."""
        fields: Sequence[RequiredField] = getattr(self.module, "REQUIRED_FIELDS", ())
        return fields

    def hook(self, name: str) -> Callable[..., Any] | None:
        """The generator's hook `name` (one of `hooks.HOOKS`), or None when it defines none."""
        if name not in HOOKS:
            raise KeyError(f"{name!r} is not a generator hook (rollout_buffer/generation/hooks.py)")
        fn = getattr(self.module, name, None)
        return fn if callable(fn) else None


def discover(paths: Sequence[Path] = (), include_entry_points: bool = True) -> dict[str, Generator]:
    """Load every generator; raises PluginError on a duplicate TASK_TYPE or a broken configured path."""
    found: dict[str, Generator] = {}
    for module, origin in _builtin_modules():
        _add(found, module, origin)
    if include_entry_points:
        for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
            try:
                module = ep.load()
            except Exception as e:
                raise PluginError(f"entry point {ep.name!r} ({ep.value}) failed to load: {e}") from e
            if not isinstance(module, ModuleType):
                module = sys.modules[module.__module__]
            _add(found, module, f"entry point {ep.name} ({ep.value})")
    for path in paths:
        for file in _python_files(path):
            _add(found, _load_file(file), str(file))
    return found


def _builtin_modules() -> Iterable[tuple[ModuleType, str]]:
    package = importlib.import_module(BUILTIN_PACKAGE)
    for info in pkgutil.iter_modules(package.__path__):
        if info.name.startswith("_"):
            continue
        name = f"{BUILTIN_PACKAGE}.{info.name}"
        try:
            module = importlib.import_module(name)
        except Exception as e:
            raise PluginError(f"built-in generator {name} failed to import: {e}") from e
        yield module, getattr(module, "__file__", name) or name


def _python_files(path: Path) -> list[Path]:
    if path.is_dir():
        return sorted(p for p in path.glob("*.py") if not p.name.startswith("_"))
    if path.is_file() and path.suffix == ".py":
        return [path]
    raise PluginError(f"--generator-path {path} is neither a .py file nor a directory")


def _load_file(file: Path) -> ModuleType:
    name = f"rollout_buffer_plugin_{file.stem}_{abs(hash(str(file.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None:
        raise PluginError(f"cannot load generator file {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception as e:
        del sys.modules[name]
        raise PluginError(f"generator file {file} failed to import: {type(e).__name__}: {e}") from e
    return module


def _add(found: dict[str, Generator], module: ModuleType, origin: str) -> None:
    task_type = getattr(module, "TASK_TYPE", None)
    if task_type is None:
        return  # helper modules inside a generator folder
    if not isinstance(task_type, str) or not task_type:
        raise PluginError(f"{origin}: TASK_TYPE must be a non-empty string")
    if not callable(getattr(module, "run_rollout", None)):
        raise PluginError(f"{origin}: TASK_TYPE {task_type!r} has no callable run_rollout")
    if wrong := problems(module):
        raise PluginError(f"{origin}: TASK_TYPE {task_type!r}: {'; '.join(wrong)}")
    if task_type in found:
        raise PluginError(
            f"TASK_TYPE {task_type!r} is defined twice: in {found[task_type].origin} and in {origin}"
        )
    found[task_type] = Generator(task_type, module, origin)
