"""Faster chat-template renders: jinja's sandbox decisions on attributes memoized, and dict keys read directly.

transformers renders chat templates in jinja's `ImmutableSandboxedEnvironment`, which asks
`is_safe_attribute(obj, attr, value)` for every attribute and method a template touches (`content.split`,
`loop.index0`, ...). The answer depends on the object's type and the attribute's name only (internal names,
function and frame internals, methods that mutate lists, dicts and sets), yet it is worked out again each
time: about a third of a render. The decisions are remembered per (type, name) on the environment
transformers compiled the template with.

Most of what a chat template reads is a key of a message dict (`message.role`, `message.content`). The
sandbox's `getattr` first asks the dict for an attribute of that name, which raises, and then reads the key:
the exception was a fifth of a render. For an exact dict and a name that is not one of dict's own attributes,
the key is now read directly, with the same result (its value, or the environment's undefined).

Rendered text and the sandbox's verdicts are unchanged. The buffer renders the new messages of every turn and
whole conversations for the tokenization check.
"""

from __future__ import annotations

from typing import Any

from jinja2.sandbox import ImmutableSandboxedEnvironment


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


class _DictKeysFirst:
    """`getattr` of one environment, reading an exact dict's key directly when the name is not an attribute of
    dict (where the sandbox's own `getattr` would fail the attribute lookup and then read the key)."""

    _DICT_ATTRIBUTES = frozenset(dir(dict))

    def __init__(self, env: ImmutableSandboxedEnvironment) -> None:
        self._getattr = env.getattr
        self._undefined = env.undefined

    def __call__(self, obj: Any, attribute: str) -> Any:
        if type(obj) is dict and type(attribute) is str and attribute not in self._DICT_ATTRIBUTES:
            try:
                return obj[attribute]
            except KeyError:
                return self._undefined(obj=obj, name=attribute)
        return self._getattr(obj, attribute)


def speed_up_sandbox(tokenizer: Any) -> int:
    """Memoize the sandbox's attribute decisions and read dict keys directly, for each chat template of
    `tokenizer`.

    Applies only to environments of jinja's own `ImmutableSandboxedEnvironment` class, whose decisions are
    known to depend on type and name alone. Returns how many environments it changed (0 when transformers
    compiles templates some other way: renders are then as they were, only slower).
    """
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:
        return 0
    template = getattr(tokenizer, "chat_template", None)
    sources = list(template.values()) if isinstance(template, dict) else [template]
    changed = 0
    for source in sources:
        if not isinstance(source, str):
            continue
        env = getattr(_compile_jinja_template(source), "environment", None)
        if type(env) is not ImmutableSandboxedEnvironment or isinstance(env.is_safe_attribute, _MemoizedSafety):
            continue
        env.is_safe_attribute = _MemoizedSafety(env.is_safe_attribute)  # type: ignore[method-assign]
        env.getattr = _DictKeysFirst(env)  # type: ignore[method-assign]
        changed += 1
    return changed
