"""Chat template and tokenizer work behind a conversation's token ids, done once where it can be: what a template
writes around messages (`Frame`: the generation prompt, an assistant turn's closing, the added tokens encoding
restarts after), a rendered prompt and its ids (`prompt`, cached for the repeats of a group, with the head the
sanity check reuses), `encode`, the fast path to a tokenizer's ids, and `light`, whether such work is cheap
enough to run on the event loop (`INLINE_CHARS`).

Kept apart from the conversation (`conversation.Conversation`), which appends turns to a sequence: this is what
the template and the tokenizer give, asked once per tokenizer, tool list and options, or per prompt.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import orjson

from rollout_buffer.tokens.chat_render import chat_renderer
from rollout_buffer.tokens.tokenizer import end_of_turn_ids

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


@dataclass(frozen=True)
class Frame:
    """What the chat template writes around messages, for one tokenizer, tool list and template options."""

    base_text: str
    generation_prompt_ids: tuple[int, ...]
    # The generation prompt opens a reasoning block (`<think>`): the model's output starts inside it.
    opens_reasoning: bool
    closing_text: str  # after an assistant reply's content: end-of-turn token and what follows it
    closing_ids: tuple[int, ...]
    end_of_turn: frozenset[int]
    # Added tokens the tokenizer's encoding provably restarts after (see `_restart_tokens`), by id.
    restart_tokens: dict[int, str]


@functools.lru_cache(maxsize=256)
def frame(tokenizer: Any, tools_json: bytes, options_json: bytes) -> Frame:
    render = chat_renderer(tokenizer, tools_json, options_json).render
    base = render(BASE_HISTORY, False)
    with_prompt = render(BASE_HISTORY, True)
    replied = render([*BASE_HISTORY, {"role": "assistant", "content": _PROBE_REPLY}], False)
    if not with_prompt.startswith(base):
        raise ValueError("chat template rewrites the history when asked for a generation prompt")
    closing = replied[replied.rindex(_PROBE_REPLY) + len(_PROBE_REPLY):]
    closing_ids = tokenizer.encode(closing, add_special_tokens=False)
    eot = end_of_turn_ids(tokenizer)
    if not closing_ids or closing_ids[0] != eot[0]:
        raise ValueError(f"chat template closes assistant turns with {closing!r}, not an end-of-turn token")
    return Frame(
        base_text=base,
        generation_prompt_ids=tuple(tokenizer.encode(with_prompt[len(base):], add_special_tokens=False)),
        opens_reasoning=with_prompt.rstrip().endswith("<think>"),
        closing_text=closing,
        closing_ids=tuple(closing_ids),
        end_of_turn=frozenset(eot),
        restart_tokens=_restart_tokens(tokenizer),
    )


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


# The repeats of one task (a GRPO group) open with the same prompt, usually back to back: render it once.
# Only prompts up to this size (as JSON) are kept, which bounds the cache to a few MB.
PROMPT_CACHE_MAX_BYTES = 8192


@dataclass(frozen=True)
class Prompt:
    """A rendered prompt, its ids, and the part of both up to its last restart token (when verified)."""

    text: str
    ids: tuple[int, ...]
    head: tuple[str, tuple[int, ...]] | None


@functools.lru_cache(maxsize=256)
def prompt(tokenizer: Any, messages_json: bytes, tools_json: bytes, options_json: bytes) -> Prompt:
    text = chat_renderer(tokenizer, tools_json, options_json).render(orjson.loads(messages_json), True)
    ids = tuple(encode(tokenizer, text))
    return Prompt(text, ids, _head(tokenizer, frame(tokenizer, tools_json, options_json), text, ids))


def _head(tokenizer: Any, frame: Frame, text: str, ids: tuple[int, ...]) -> tuple[str, tuple[int, ...]] | None:
    """`text` and `ids` up to the last restart token, when encoding the two halves apart gives `ids` again.

    Every sequence that starts with this head then encodes as the head's ids followed by the encoding of the
    rest: the tokenization check encodes only what follows the prompt's last `<|im_start|>`. Computed once
    per prompt (the cache above), so the two verifying encodes are shared by the whole group.
    """
    k = next((k for k in range(len(ids) - 1, -1, -1) if ids[k] in frame.restart_tokens), None)
    if k is None:
        return None
    cut = text.rfind(frame.restart_tokens[ids[k]]) + len(frame.restart_tokens[ids[k]])
    head_text, head_ids = text[:cut], ids[:k + 1]
    if tuple(encode(tokenizer, head_text)) != head_ids or tuple(encode(tokenizer, text[cut:])) != ids[k + 1:]:
        return None
    return head_text, head_ids


def encode(tokenizer: Any, text: str) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=False)`, through the Rust tokenizer directly when there is one:
    same ids without the Python wrapping of transformers nor the character offsets it computes and drops
    (`encode_batch_fast`), and letting go of the GIL while it works (this runs for every turn, in worker
    threads for long ones)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        ids: list[int] = backend.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return ids
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids


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

