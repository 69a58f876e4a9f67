"""The private internals of transformers and jinja2 the buffer relies on, each checked before use, each with a
fallback that stays correct (every fallback is taken while the shortcuts are switched off, `switch`).

Nothing else in the buffer names a private attribute of transformers or jinja2 or replaces one of their
methods: `tokens.renderer` (direct renders of chat templates) and `template_sandbox` (memoized sandbox decisions)
get what they need from here. `tests/test_dependency_internals.py` fails, saying what to review, as soon as an
installed version changes one of them, and forces each fallback to show that renders (text and Qwen3 token ids)
and the sandbox's refusals stay the same.

transformers, `transformers.utils.chat_template_utils` (chosen at first use and logged when a fallback is
taken: the buffer imports transformers only when it loads a tokenizer, which takes about a second):

- `_compile_jinja_template(chat_template)`: the compiled template `apply_chat_template` renders with, cached by
  transformers per template text, so its environment is the one `apply_chat_template` uses. Why: `Renderer`
  renders plain-JSON messages with it directly (the work transformers repeats on every call was about 40% of a
  render), and `speed_up_template_sandbox` changes its environment. Fallback (gone, not a one-argument
  callable, or not returning a jinja `Template`): no compiled template, so every render goes through the
  tokenizer's public `apply_chat_template` and environments keep jinja's own sandbox (same text, slower).
- `_plain_template_data(value)`: transformers' copy, as plain JSON values, of what a template sees (tools,
  special tokens, template options). Why: the renderer makes that copy once instead of on every render.
  Fallback: `_plain_json_copy`, the same copy for exact JSON values (dicts with string keys, lists, str, int,
  float, bool, None) and `NotPlainData` for anything else, which the renderer renders through
  `apply_chat_template`.
- `_REASONING_FIELDS`: the names transformers offers a message's reasoning under (reasoning given under one is
  given under all). Why: the direct render mirrors that step (`REASONING_FIELDS`). Fallback when transformers'
  names are gone or differ from ours: no direct render (`chat_template_for_direct_render` gives None).

jinja2, `jinja2.sandbox` (checked at import, logged when the fallback is taken):

- `is_safe_attribute` of the `ImmutableSandboxedEnvironment` transformers compiled a template with, replaced on
  that instance (`_MemoizedSafety`). Why: the sandbox's decision for every attribute a template touches was
  about a third of a render. The replacement is exact only for the code it was written against: decisions that
  depend on the object's type and the attribute's name alone (`is_safe_attribute`, `is_internal_attribute`,
  `modifies_known_mutable`). `_REVIEWED_SANDBOX_CODE` holds fingerprints of that code (its source without
  docstrings, comments and blank lines). Fallback when the installed jinja2's code differs: environments keep
  jinja's own method (same text, same refusals, slower).
"""

from __future__ import annotations

import ast
import dataclasses
import hashlib
import inspect
import logging
import textwrap
from collections.abc import Callable
from typing import Any, TypeGuard

import jinja2
from jinja2 import sandbox

from rollout_buffer.shortcuts import switch

log = logging.getLogger(__name__)

# transformers' `_REASONING_FIELDS`: reasoning under one of these names is offered to the template under all.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")

_TO_REVIEW = "see rollout_buffer/shortcuts/templates.py and tests/test_dependency_internals.py"


class NotPlainData(ValueError):
    """A value the fallback of `_plain_template_data` does not copy (not an exact JSON value)."""


@dataclasses.dataclass(frozen=True)
class TransformersInternals:
    """What the buffer uses of transformers' chat-template internals, or the fallbacks chosen in their place."""

    compile_template: Callable[[str], Any] | None  # None: render through apply_chat_template
    plain_template_data: Callable[[Any], Any]
    reasoning_fields_match: bool  # False: no direct renders
    fallbacks: tuple[str, ...]  # the internals replaced by their fallbacks (empty when none was)


def select_transformers_internals() -> TransformersInternals:
    """Check transformers' internals (the installed version's) and choose, for each, it or its fallback (every
    fallback while the shortcuts are switched off)."""
    if not switch.enabled("templates"):
        log.info("the templates shortcut is off (%s): chat templates render through apply_chat_template",
                 switch.ENV)
        return TransformersInternals(None, _plain_json_copy, False, ("all",))
    try:
        from transformers.utils import chat_template_utils as ctu
    except ImportError as e:
        log.warning("transformers' chat-template internals cannot be imported (%s): chat templates render through "
                    "apply_chat_template, slower; %s", e, _TO_REVIEW)
        return TransformersInternals(None, _plain_json_copy, False, ("all",))
    fallbacks = []
    compile_template: Callable[[str], Any] | None = None
    theirs = getattr(ctu, "_compile_jinja_template", None)
    if _one_argument(theirs) and _compiles(theirs):
        compile_template = theirs
    else:
        fallbacks.append("_compile_jinja_template")
    plain: Callable[[Any], Any] = _plain_json_copy
    theirs = getattr(ctu, "_plain_template_data", None)
    if _one_argument(theirs):
        plain = theirs
    else:
        fallbacks.append("_plain_template_data")
    reasoning_fields_match = getattr(ctu, "_REASONING_FIELDS", None) == REASONING_FIELDS
    if not reasoning_fields_match:
        fallbacks.append("_REASONING_FIELDS")
    if fallbacks:
        log.warning("transformers %s changed %s: chat templates render through their fallbacks (same text, slower); "
                    "%s", _version("transformers"), ", ".join(fallbacks), _TO_REVIEW)
    return TransformersInternals(compile_template, plain, reasoning_fields_match, tuple(fallbacks))


_transformers_choice: TransformersInternals | None = None


def transformers_internals() -> TransformersInternals:
    """The choice of `select_transformers_internals`, made at the first call."""
    global _transformers_choice
    if _transformers_choice is None:
        _transformers_choice = select_transformers_internals()
    return _transformers_choice


def compiled_chat_template(source: str) -> jinja2.Template | None:
    """transformers' compiled template for the template text `source` (the very object `apply_chat_template`
    renders with), or None when its `_compile_jinja_template` is not usable."""
    compile_template = transformers_internals().compile_template
    return None if compile_template is None else compile_template(source)


def chat_template_for_direct_render(source: str) -> jinja2.Template | None:
    """The compiled template to render messages with directly, after the steps transformers applies to them
    (None values dropped, reasoning under all of `REASONING_FIELDS`); None when renders must go through
    `apply_chat_template`."""
    return compiled_chat_template(source) if transformers_internals().reasoning_fields_match else None


def plain_template_data(value: Any) -> Any:
    """`value` copied as the template is given it by transformers. Raises `NotPlainData` when the fallback is in
    use and `value` is not an exact JSON value."""
    return transformers_internals().plain_template_data(value)


def _plain_json_copy(value: Any) -> Any:
    """The copy `_plain_template_data` makes of an exact JSON value (new dicts and lists, the same scalars)."""
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return value
    if kind is dict:
        if not all(type(k) is str for k in value):
            raise NotPlainData("a dict key is not a string")
        return {k: _plain_json_copy(v) for k, v in value.items()}
    if kind is list:
        return [_plain_json_copy(v) for v in value]
    raise NotPlainData(f"{kind.__name__} is not a JSON value")


def _one_argument(function: Any) -> TypeGuard[Callable[[Any], Any]]:
    """True for a callable taking exactly one positional argument."""
    if not callable(function):
        return False
    try:
        parameters = list(inspect.signature(function).parameters.values())
    except (TypeError, ValueError):
        return False
    return len(parameters) == 1 and parameters[0].kind in (
        inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)


def _compiles(compile_template: Callable[[str], Any]) -> bool:
    """True when `compile_template` gives a jinja template that renders a template text."""
    try:
        template = compile_template("{{ probe }}")
        return isinstance(template, jinja2.Template) and template.render(probe="ok") == "ok"
    except Exception:
        return False


def _version(package: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return "(not installed)"


# ---------------------------------------------------------------------------------------------------------------
# jinja2's sandbox


def code_fingerprint(function: Callable[..., Any]) -> str:
    """sha256 of `function`'s source without its docstring, comments, blank lines and indentation changes."""
    source = textwrap.dedent(inspect.getsource(function))
    lines = source.splitlines()
    node = ast.parse(source).body[0]
    body = getattr(node, "body", [])
    if (body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str) and body[0].end_lineno is not None):
        del lines[body[0].lineno - 1:body[0].end_lineno]
    kept = [line.rstrip() for line in lines if line.strip() and not line.strip().startswith("#")]
    return hashlib.sha256("\n".join(kept).encode()).hexdigest()


def sandbox_code() -> dict[str, Callable[..., Any]]:
    """The jinja2 code `_MemoizedSafety` is exact for, by name."""
    return {
        "SandboxedEnvironment.is_safe_attribute": sandbox.SandboxedEnvironment.is_safe_attribute,
        "ImmutableSandboxedEnvironment.is_safe_attribute": sandbox.ImmutableSandboxedEnvironment.is_safe_attribute,
        "is_internal_attribute": sandbox.is_internal_attribute,
        "modifies_known_mutable": sandbox.modifies_known_mutable,
    }


# `code_fingerprint` of each in `sandbox_code()`, as reviewed (jinja2 3.1.6). A new jinja2 that changes one: read
# its code, check that decisions still depend on (type, attribute name) alone, then add the new fingerprints here
# (keep the old ones while older versions are supported).
_REVIEWED_SANDBOX_CODE: dict[str, frozenset[str]] = {
    "SandboxedEnvironment.is_safe_attribute": frozenset(
        {"90acb5b572dda20ea64b9502d4c601cdb29373c9635fe30fc43b3a5893a09e24"}),
    "ImmutableSandboxedEnvironment.is_safe_attribute": frozenset(
        {"6f39b0d17ef290b30987578eaddb163d1e1e795f2468eda23401737abeec16b8"}),
    "is_internal_attribute": frozenset({"2d17697b37104a8b620dc4c0a90f748ed04728334177cd7a4e739f21fd27b689"}),
    "modifies_known_mutable": frozenset({"a3f5c54bd1c67b0e29474632a78a08797733c21805dd328f409b91b7d409b629"}),
}


def unreviewed_sandbox_code() -> dict[str, str]:
    """Fingerprints of the installed jinja2's sandbox code that `_REVIEWED_SANDBOX_CODE` does not hold, by name
    (`"no source"` when it cannot be read); empty when all of it is as reviewed."""
    unreviewed = {}
    for name, function in sandbox_code().items():
        try:
            fingerprint = code_fingerprint(function)
        except (OSError, TypeError, SyntaxError, IndexError):
            fingerprint = "no source"
        if fingerprint not in _REVIEWED_SANDBOX_CODE[name]:
            unreviewed[name] = fingerprint
    return unreviewed


def select_sandbox_hooks() -> bool:
    """True when the installed jinja2's sandbox is the code `_MemoizedSafety` is exact for."""
    unreviewed = unreviewed_sandbox_code()
    if unreviewed:
        log.warning("jinja2 %s changed %s: chat templates render in jinja's own sandbox (same text and refusals, "
                    "slower); %s", jinja2.__version__, ", ".join(unreviewed), _TO_REVIEW)
    return not unreviewed


_sandbox_hooks_reviewed = select_sandbox_hooks()


class _MemoizedSafety:
    """`is_safe_attribute` of one environment, answered from a table keyed by (type, attribute name)."""

    def __init__(self, decide: Any) -> None:
        self._decide = decide
        self._known: dict[tuple[type, str], bool] = {}

    def __call__(self, obj: Any, attr: str, value: Any) -> bool:
        key = (type(obj), attr)
        safe = self._known.get(key)
        if safe is None:
            safe = self._known[key] = bool(self._decide(obj, attr, value))
        return safe


def speed_up_template_sandbox(source: str) -> bool:
    """Memoize the sandbox's attribute decisions in the environment transformers renders the template text
    `source` with. True when it changed that environment; False when it was already changed, or is not jinja's
    own `ImmutableSandboxedEnvironment`, or a fallback is in use (renders are then as they were, only slower)."""
    if not _sandbox_hooks_reviewed or not switch.enabled("templates"):
        return False
    template = compiled_chat_template(source)
    env = getattr(template, "environment", None)
    if type(env) is not sandbox.ImmutableSandboxedEnvironment or isinstance(env.is_safe_attribute, _MemoizedSafety):
        return False
    env.is_safe_attribute = _MemoizedSafety(env.is_safe_attribute)  # type: ignore[method-assign]
    return True
