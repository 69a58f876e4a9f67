"""Chat-template renders as `tokenizer.apply_chat_template(..., tokenize=False)` gives them, without the work
transformers repeats on every call.

Each call of `apply_chat_template` looks the template up, rebuilds the special-token map, and copies the
tools, the template options and every message as plain JSON values (rich objects are turned into them, so the
sandboxed template cannot call their methods). The buffer renders once per turn (the new messages) and once
per trajectory (the tokenization check), always with the same tools and options: that repeated work was about
40% of a render. A `ChatRenderer` does the per-template part once, and renders
messages that are already plain JSON (dicts with string keys, lists, strings, numbers, booleans, None) with
the compiled template directly, after the two per-message steps transformers applies to them: keys whose
value is None are left out, and reasoning given under any of its names is offered under all of them. Other
messages (objects, tuples, numpy values) and tokenizers without a jinja template go through
`apply_chat_template` itself. `tests/test_chat_render.py` holds the renders equal to transformers'.

The compiled template and the copy of plain values are transformers' private internals: `dependency_internals`
checks them and gives this module either them or fallbacks; when a fallback cannot render directly, every render
goes through `apply_chat_template` (same text, slower).

Templates write every tool's schema as JSON (`tool | tojson`) at the top of every render: with 20 tools that
was two thirds of the render of a turn's new messages. The renderer's copies of the tools are its own and never
change (the sandbox forbids templates to), so the template's `tojson` filter keeps their text (`_HeldJson`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from typing import Any

import jinja2
import orjson

from rollout_buffer.shortcuts.templates import (
    REASONING_FIELDS,
    NotPlainData,
    chat_template_for_direct_render,
    plain_template_data,
)

_SCALARS = (str, int, float, bool)


class ChatRenderer:
    """Renders one tokenizer's chat template with one tool list and one set of template options."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None, options: dict[str, Any]):
        self._tokenizer = tokenizer
        self._tools = tools
        self._options = options
        self._template: jinja2.Template | None = None
        self._variables: dict[str, Any] = {}
        try:
            source = tokenizer.get_chat_template(None, tools)
            special = tokenizer.special_tokens_map
        except (AttributeError, ValueError):
            return  # not a transformers tokenizer with a template: every render goes through apply_chat_template
        if tools is not None and not all(type(t) is dict for t in tools):
            return  # callables become schemas in transformers
        template = chat_template_for_direct_render(source)
        if template is None:
            return  # transformers changed what direct renders rely on: every render goes through it
        try:
            plain_tools = plain_template_data(tools)
            variables = {"tools": plain_tools, "documents": None, **plain_template_data({**special, **options})}
        except NotPlainData:
            return  # the fallback copies only exact JSON values: renders with others go through transformers
        self._template, self._variables = template, variables
        filters = template.environment.filters
        if "tojson" in filters and plain_tools:
            if not isinstance(filters["tojson"], _HeldJson):
                filters["tojson"] = _HeldJson(filters["tojson"])
            weakref.finalize(self, filters["tojson"].release, filters["tojson"].hold(plain_tools))

    def render(self, messages: list[dict[str, Any]], generation_prompt: bool) -> str:
        """`apply_chat_template(messages, tools=..., add_generation_prompt=generation_prompt, tokenize=False,
        **options)` of this renderer's tokenizer, tools and options."""
        template = self._template
        chat = _template_messages(messages) if template is not None else None
        if template is None or chat is None:
            text: str = self._tokenizer.apply_chat_template(  # a transformers tokenizer: str with tokenize=False
                messages, tools=self._tools, add_generation_prompt=generation_prompt, tokenize=False,
                **self._options,
            )
            return text
        return template.render(messages=chat, add_generation_prompt=generation_prompt, **self._variables)


class _HeldJson:
    """A template environment's `tojson` filter that keeps the text of the objects renderers hold (their tool
    schemas) while they hold them; any other value is encoded afresh, as before."""

    def __init__(self, tojson: Callable[..., str]):
        self._tojson = tojson
        self._held: dict[int, tuple[Any, dict[Any, str]]] = {}  # id -> (the object, its text by filter options)

    def hold(self, values: list[Any]) -> list[int]:
        """Keep the text of `values` (objects nothing changes) until `release` of the ids returned."""
        ids = [id(v) for v in values]
        for v in values:
            self._held[id(v)] = (v, {})  # the reference keeps the id from being reused while held
        return ids

    def release(self, ids: list[int]) -> None:
        """Forget the objects `hold` returned these ids for."""
        for i in ids:
            self._held.pop(i, None)

    def __call__(self, value: Any, *args: Any, **kwargs: Any) -> str:
        held = self._held.get(id(value))
        if held is None or held[0] is not value or args:
            return self._tojson(value, *args, **kwargs)
        try:
            options = tuple(sorted(kwargs.items()))
            return held[1][options]
        except KeyError:
            text = held[1][options] = self._tojson(value, **kwargs)
            return text
        except TypeError:  # an option that cannot be a key (a list of separators)
            return self._tojson(value, **kwargs)


@functools.lru_cache(maxsize=256)
def chat_renderer(tokenizer: Any, tools_json: bytes, options_json: bytes) -> ChatRenderer:
    """The renderer of `tokenizer` with the tools and template options given as JSON (one per combination)."""
    return ChatRenderer(tokenizer, orjson.loads(tools_json), orjson.loads(options_json))


def _template_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]] | None:
    """The messages as transformers hands them to the template, or None when one is not plain JSON."""
    if not messages:
        return None  # transformers refuses an empty conversation with its own error
    chat = []
    for message in messages:
        if type(message) is not dict:
            return None
        kept = {}
        for key, value in message.items():
            if value is None:
                continue
            if type(key) is not str or not (type(value) in _SCALARS or _plain(value)):
                return None
            kept[key] = value
        reasoning = next((kept[k] for k in REASONING_FIELDS if k in kept), None)
        if reasoning is not None:
            kept = {"thinking": reasoning, **kept, "reasoning_content": reasoning}
        chat.append(kept)
    return chat


def _plain(value: Any) -> bool:
    """True for JSON values built from exact dicts with string keys, lists and scalars (no subclasses)."""
    kind = type(value)
    if value is None or kind in _SCALARS:
        return True
    if kind is dict:
        return all(type(k) is str and _plain(v) for k, v in value.items())
    if kind is list:
        return all(_plain(v) for v in value)
    return False
