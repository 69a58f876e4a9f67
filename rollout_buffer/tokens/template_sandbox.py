"""Faster chat-template renders: jinja's sandbox decisions on attributes memoized.

transformers renders chat templates in jinja's `ImmutableSandboxedEnvironment`, which asks
`is_safe_attribute(obj, attr, value)` for every attribute and method a template touches (`content.split`,
`loop.index0`, ...). The answer depends on the object's type and the attribute's name only (internal names,
function and frame internals, methods that mutate lists, dicts and sets), yet it is worked out again each
time: about a third of a render. The decisions are remembered per (type, name) on the environment
transformers compiled the template with.

Rendered text and the sandbox's verdicts are unchanged. The buffer renders the new messages of every turn and
whole conversations for the tokenization check.

This replaces a method of jinja's sandbox at run time and is exact only for the jinja2 code it was written
against: it lives in `dependency_internals` with the other private internals of dependencies, which checks
that code at import and leaves the sandbox as it is when an installed jinja2 (or transformers) changed it.
"""

from __future__ import annotations

from typing import Any

from rollout_buffer.shortcuts.templates import speed_up_template_sandbox


def speed_up_sandbox(tokenizer: Any) -> int:
    """Memoize the sandbox's attribute decisions, for each chat template of `tokenizer`.

    Applies only to environments of jinja's own `ImmutableSandboxedEnvironment` class, whose decisions are
    known to depend on type and name alone. Returns how many environments it changed (0 when transformers
    compiles templates some other way, or a dependency changed what the speed-up relies on: renders are then
    as they were, only slower).
    """
    template = getattr(tokenizer, "chat_template", None)
    sources = list(template.values()) if isinstance(template, dict) else [template]
    return sum(speed_up_template_sandbox(source) for source in sources if isinstance(source, str))
