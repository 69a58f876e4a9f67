"""One chat template and its tokenizer, as a conversation's exact tokens need them: `Renderer` renders messages
(`render`), encodes text (`encode`), knows what the template writes around messages (`frame`) and renders and
encodes a prompt once for the repeats of a group (`prompt`). A conversation owns one (`renderer`, one per
tokenizer, tool list and template options) and renders and tokenizes through nothing else.

Renders are what `tokenizer.apply_chat_template(..., tokenize=False)` gives, without the work transformers
repeats on every call. Each call looks the template up, rebuilds the special-token map, and copies the tools, the
template options and every message as plain JSON values (rich objects are turned into them, so the sandboxed
template cannot call their methods): about 40% of a render. A renderer does the per-template part once, and
renders messages that are already plain JSON (dicts with string keys, lists, strings, numbers, booleans, None)
with the compiled template directly, after the two per-message steps transformers applies to them: keys whose
value is None are left out, and reasoning given under any of its names is offered under all of them. Other
messages (objects, tuples, numpy values) and tokenizers without a jinja template go through
`apply_chat_template` itself. `tests/test_renderer.py` holds the renders equal to transformers'.

The compiled template and the copy of plain values are transformers' private internals: `shortcuts.templates`
checks them and gives this module either them or fallbacks; when a fallback cannot render directly, every render
goes through `apply_chat_template` (same text, slower).

Templates write every tool's schema as JSON (`tool | tojson`) at the top of every render: with 20 tools that was
two thirds of the render of a turn's new messages. A renderer's copies of the tools are its own and never change
(the sandbox forbids templates to), so the template's `tojson` filter keeps their text (`_HeldJson`).

`light` says whether such work is cheap enough to run on the event loop (`INLINE_CHARS`).
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jinja2
import orjson

from rollout_buffer.shortcuts.templates import (
    REASONING_FIELDS,
    NotPlainData,
    chat_template_for_direct_render,
    plain_template_data,
)

# Environment messages are rendered after this history, which has no assistant turn for a template to
# rewrite; only the text past it is appended.
BASE_HISTORY: list[dict[str, Any]] = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "Hello."},
]
_PROBE_REPLY = "rollout-buffer probe reply"
# Template renders and encodes of conversations up to this size (characters of message content) run on the
# event loop: a math prompt renders and encodes in about 0.1 ms, while a hop to a worker thread costs the loop
# more than that under load (future chaining plus a GIL hand-off each way). Bigger ones go to a thread.
INLINE_CHARS = 2048
_PER_MESSAGE_CHARS = 32  # the template's framing of one message
# The repeats of one task (a GRPO group) open with the same prompt, usually back to back: render it once.
# Only prompts up to this size (as JSON) are kept, which bounds the cache to a few MB.
PROMPT_CACHE_MAX_BYTES = 8192
_SCALARS = (str, int, float, bool)


@dataclass(frozen=True)
class Frame:
    """What the chat template writes around messages, for one tokenizer, tool list and template options."""

    base_text: str
    generation_prompt_ids: tuple[int, ...]
    # The generation prompt opens a reasoning block (`<think>`): the model's output starts inside it.
    opens_reasoning: bool
    closing_text: str  # after an assistant reply's content: end-of-turn token and what follows it
    closing_ids: tuple[int, ...]
    # The token the template closes assistant turns with, and the eos token when it is another one: an engine
    # output that ends with one of these finished its turn; anything else was cut or stopped on a stop string.
    end_of_turn: frozenset[int]
    # Added tokens the tokenizer's encoding provably restarts after (see `_restart_tokens`), by id.
    restart_tokens: dict[int, str]


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt, its ids, and the part of both up to its last restart token (when verified)."""

    text: str
    ids: tuple[int, ...]
    head: tuple[str, tuple[int, ...]] | None


class Renderer:
    """One tokenizer's chat template with one tool list and one set of template options."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None, options: dict[str, Any]):
        self.tokenizer = tokenizer
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
            text: str = self.tokenizer.apply_chat_template(  # a transformers tokenizer: str with tokenize=False
                messages, tools=self._tools, add_generation_prompt=generation_prompt, tokenize=False,
                **self._options,
            )
            return text
        return template.render(messages=chat, add_generation_prompt=generation_prompt, **self._variables)

    def encode(self, text: str) -> list[int]:
        """`tokenizer.encode(text, add_special_tokens=False)`, through the Rust tokenizer directly when there is
        one: same ids without the Python wrapping of transformers nor the character offsets it computes and drops
        (`encode_batch_fast`), and letting go of the GIL while it works (this runs for every turn, in worker
        threads for long ones)."""
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is not None:
            ids: list[int] = backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
            return ids
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids

    @functools.cached_property
    def frame(self) -> Frame:
        """What the template writes around messages. Raises `ValueError` for a template the exact tokens cannot
        follow: one that rewrites the history when asked for a generation prompt, or closes assistant turns with
        anything but a special token."""
        tokenizer = self.tokenizer
        base = self.render(BASE_HISTORY, False)
        with_prompt = self.render(BASE_HISTORY, True)
        replied = self.render([*BASE_HISTORY, {"role": "assistant", "content": _PROBE_REPLY}], False)
        if not with_prompt.startswith(base):
            raise ValueError("chat template rewrites the history when asked for a generation prompt")
        closing = replied[replied.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]
        closing_ids = self.encode(closing)
        if not closing_ids or closing_ids[0] not in set(tokenizer.all_special_ids) | set(
                tokenizer.added_tokens_decoder):
            raise ValueError(f"chat template closes assistant turns with {closing!r}, not an end-of-turn token")
        eos = tokenizer.eos_token_id
        return Frame(
            base_text=base,
            generation_prompt_ids=tuple(self.encode(with_prompt[len(base):])),
            opens_reasoning=with_prompt.rstrip().endswith("<think>"),
            closing_text=closing,
            closing_ids=tuple(closing_ids),
            end_of_turn=frozenset({closing_ids[0]} if eos is None else {closing_ids[0], eos}),
            restart_tokens=_restart_tokens(tokenizer),
        )

    def prompt(self, messages: list[dict[str, Any]]) -> Prompt:
        """`messages` rendered with the generation prompt and encoded; kept for the next asks of small JSON
        prompts (with the head the tokenization check reuses)."""
        try:
            key = orjson.dumps(messages)
        except TypeError:  # not JSON (a caller's own objects): rendered without the cache
            key = None
        if key is not None and len(key) <= PROMPT_CACHE_MAX_BYTES:
            return _kept_prompt(self, key)
        text = self.render(messages, True)
        return Prompt(text, tuple(self.encode(text)), None)

    def _head(self, text: str, ids: tuple[int, ...]) -> tuple[str, tuple[int, ...]] | None:
        """`text` and `ids` up to the last restart token, when encoding the two halves apart gives `ids` again.

        Every sequence that starts with this head then encodes as the head's ids followed by the encoding of the
        rest: the tokenization check encodes only what follows the prompt's last `<|im_start|>`. Computed once
        per kept prompt, so the two verifying encodes are shared by the whole group.
        """
        restart = self.frame.restart_tokens
        k = next((k for k in range(len(ids) - 1, -1, -1) if ids[k] in restart), None)
        if k is None:
            return None
        cut = text.rfind(restart[ids[k]]) + len(restart[ids[k]])
        head_text, head_ids = text[:cut], ids[:k + 1]
        if tuple(self.encode(head_text)) != head_ids or tuple(self.encode(text[cut:])) != ids[k + 1:]:
            return None
        return head_text, head_ids


@functools.lru_cache(maxsize=256)
def _renderer(tokenizer: Any, tools_json: bytes, options_json: bytes) -> Renderer:
    return Renderer(tokenizer, orjson.loads(tools_json), orjson.loads(options_json))


def renderer(tokenizer: Any, tools: list[dict[str, Any]] | None, options: dict[str, Any]) -> Renderer:
    """The renderer of `tokenizer` with these tools and template options (one per combination, kept)."""
    return _renderer(tokenizer, orjson.dumps(tools), orjson.dumps(options, option=orjson.OPT_SORT_KEYS))


@functools.lru_cache(maxsize=256)
def _kept_prompt(renderer: Renderer, messages_json: bytes) -> Prompt:
    text = renderer.render(orjson.loads(messages_json), True)
    ids = tuple(renderer.encode(text))
    return Prompt(text, ids, renderer._head(text, ids))


def light(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> bool:
    """True when rendering and encoding `messages` is cheaper than handing the work to a thread."""
    size = len(orjson.dumps(tools)) if tools else 0
    for m in messages:
        content = m.get("content")
        size += _PER_MESSAGE_CHARS + (len(content) if isinstance(content, str) else len(orjson.dumps(content)))
        if m.get("tool_calls"):
            size += len(orjson.dumps(m["tool_calls"]))
        if size > INLINE_CHARS:
            return False
    return True


def _restart_tokens(tokenizer: Any) -> dict[int, str]:
    """Added tokens (`<|im_start|>`, ...) at whose end the fast tokenizer's encoding starts afresh.

    A fast tokenizer cuts the text at added tokens before anything else, so the ids of `a + b` are the ids of
    `a` and of `b` when `a` ends with such a token, provided the token strips no whitespace next to it, is
    matched on the raw text, and is not part of a longer added token (which could match across the cut).
    """
    if getattr(tokenizer, "backend_tokenizer", None) is None:
        return {}
    added = dict(getattr(tokenizer, "added_tokens_decoder", None) or {})
    contents = [t.content for t in added.values()]
    return {
        i: t.content for i, t in added.items()
        if not (t.lstrip or t.rstrip or t.single_word or t.normalized)
        and t.content and not any(t.content != other and t.content in other for other in contents)
    }


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
