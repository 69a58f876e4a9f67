"""Loading a run's tools from a YAML file (the run option `tool_config_path`).

```yaml
tools:
  # A plain function (or a @function_tool object): schema inferred from hints and docstring.
  - function: generators.tools.calculator:calculator
    name: calc                       # optional: another tool name
  # A class with the create / execute / release lifecycle (verl's layout).
  - class_name: my_tools.py:SandboxTool
    config: {type: native, timeout_s: 5}
    tool_schema: {type: function, function: {name: run_code, description: ..., parameters: {...}}}
```

A reference is `module:attr`, `module.attr` (verl's `class_name` form) or `path/to/file.py:attr`, a
relative file path being read from the YAML file's folder. `tool_schema` overrides a function's inferred
schema or a class's `default_schema`. `config.type` may be `native`; MCP tools are not supported.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from generators.tools.base import Tool
from generators.tools.function import FunctionTool
from generators.tools.registry import ToolRegistry


class ToolConfigError(ValueError):
    """The tool config file is missing, malformed, or names something that cannot be loaded."""


class ToolEntry(BaseModel):
    """One item of `tools:`: a function or a class."""

    model_config = ConfigDict(extra="forbid")

    function: str | None = None
    class_name: str | None = None
    name: str | None = None
    config: dict[str, Any] = Field(default_factory=dict)
    tool_schema: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_kind(self) -> ToolEntry:
        if (self.function is None) == (self.class_name is None):
            raise ValueError("give exactly one of `function` and `class_name`")
        if self.function is not None and self.config:
            raise ValueError("`config` is for class tools; function tools take no config")
        if self.class_name is not None and self.name is not None:
            raise ValueError("a class tool's name comes from its schema: set tool_schema.function.name")
        kind = self.config.get("type", "native")
        if kind != "native":
            raise ValueError(f"config.type {kind!r} is not supported (only native tools)")
        return self


class ToolConfigFile(BaseModel):
    """The whole YAML document."""

    model_config = ConfigDict(extra="forbid")

    tools: list[ToolEntry] = Field(default_factory=list)


def load_tool_config(path: str | Path) -> ToolRegistry:
    """The tools listed in the YAML file at `path`, imported and built.

    Blocking (file reads, imports, schema inference): call it through `asyncio.to_thread` from async code.
    Raises ToolConfigError naming the file and the entry at fault; duplicate names are refused.
    """
    file = Path(path).expanduser()
    try:
        raw = yaml.safe_load(file.read_text()) or {}
        doc = ToolConfigFile.model_validate(raw)
    except OSError as e:
        raise ToolConfigError(f"cannot read tool config {file}: {e}") from e
    except (yaml.YAMLError, ValidationError) as e:
        raise ToolConfigError(f"tool config {file} is malformed: {e}") from e
    registry = ToolRegistry()
    for i, entry in enumerate(doc.tools):
        where = f"tool config {file}, tools[{i}]"
        try:
            tool = _build(entry, file.parent.resolve())
            registry.add(tool)
        except ToolConfigError:
            raise
        except Exception as e:  # import errors, schema errors, constructor errors: all name the entry
            raise ToolConfigError(f"{where}: {type(e).__name__}: {e}") from e
    return registry


def _build(entry: ToolEntry, base_dir: Path) -> Tool:
    if entry.function is not None:
        obj = resolve_reference(entry.function, base_dir)
        if isinstance(obj, FunctionTool):
            if entry.tool_schema is not None or entry.name is not None:
                return FunctionTool(obj.fn, name=entry.name, schema=entry.tool_schema or obj.schema)
            return obj
        if not callable(obj):
            raise TypeError(f"{entry.function} is not a function")
        return FunctionTool(obj, name=entry.name, schema=entry.tool_schema)
    assert entry.class_name is not None
    cls = resolve_reference(entry.class_name, base_dir)
    if not isinstance(cls, type):
        raise TypeError(f"{entry.class_name} is not a class")
    tool = cls(config=entry.config, tool_schema=entry.tool_schema)
    if not isinstance(tool, Tool):
        raise TypeError(f"{entry.class_name} lacks the tool interface (name, schema, create, execute, release)")
    return tool


def resolve_reference(ref: str, base_dir: Path) -> Any:
    """The object `ref` names: `module:attr`, `module.attr` or `file.py:attr` (relative to `base_dir`)."""
    module_part, sep, attr = ref.rpartition(":")
    if not sep:
        module_part, sep, attr = ref.rpartition(".")
    if not sep or not module_part or not attr:
        raise ValueError(f"{ref!r} is not a reference like module:attr or path/file.py:attr")
    if module_part.endswith(".py") or "/" in module_part:
        module = _load_file(base_dir / module_part)
    else:
        module = importlib.import_module(module_part)
    try:
        return getattr(module, attr)
    except AttributeError:
        raise ValueError(f"{module_part} has no {attr!r}") from None


def _load_file(file: Path) -> ModuleType:
    file = file.resolve()
    name = f"rollout_buffer_tools_{file.stem}_{hashlib.blake2b(str(file).encode(), digest_size=6).hexdigest()}"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, file)
    if spec is None or spec.loader is None or not file.is_file():
        raise ValueError(f"cannot load tool file {file}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module
