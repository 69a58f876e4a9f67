"""The sanity check's comparison: a conversation's token sequence against the chat template applied to its final
messages at once (`Conversation.check`), and where they first differ.

- `strict`: token for token. Qwen3's template drops the `<think>` block of every assistant turn that
  precedes a later user message, and adds an empty one to a final turn that has none, so with reasoning
  models `strict` reports those turns: the sequence keeps the reasoning the model generated, which is
  what training must see.
- `ignore_strippable`: decoded text, ignoring whitespace and `<think>…</think>` blocks on both sides,
  the two things such templates rewrite. Qwen3's expected difference passes; a changed word, a lost
  message or a wrong delta is still reported.

Kept apart from the conversation, which builds the sequence: this only reads it.
"""

from __future__ import annotations

import functools
import re
from typing import Any

_REASONING = re.compile(r"<think>.*?</think>", re.DOTALL)
_SNIPPET_TOKENS = (8, 24)
_SNIPPET_CHARS = (40, 120)


def compare_tokens(tokenizer: Any, actual: list[int], expected: list[int]) -> dict[str, Any] | None:
    """None when `actual` is `expected`; else a `strict` report: the first differing token, decoded snippets
    around it on both sides, both lengths."""
    if actual == expected:
        return None
    pos = next((i for i, (a, b) in enumerate(zip(actual, expected, strict=False)) if a != b),
               min(len(actual), len(expected)))
    before, after = _SNIPPET_TOKENS
    window = slice(max(0, pos - before), pos + after)
    decode = functools.partial(tokenizer.decode, skip_special_tokens=False)
    return {
        "mode": "strict", "unit": "token", "position": pos,
        "expected": decode(expected[window]), "actual": decode(actual[window]),
        "expected_length": len(expected), "actual_length": len(actual),
    }


def compare_text(tokenizer: Any, token_ids: list[int], expected: str) -> dict[str, Any] | None:
    """None when `token_ids` decode to `expected` but for whitespace and reasoning blocks; else an
    `ignore_strippable` report: the first differing character (an offset in the decoded sequence), snippets."""
    actual = tokenizer.decode(token_ids, skip_special_tokens=False)
    if _significant(actual) == _significant(expected):
        return None
    a_chars, a_at = _significant_with_offsets(actual)
    e_chars, e_at = _significant_with_offsets(expected)
    k = next((i for i, (a, b) in enumerate(zip(a_chars, e_chars, strict=False)) if a != b),
             min(len(a_chars), len(e_chars)))
    a_pos = a_at[k] if k < len(a_at) else len(actual)
    e_pos = e_at[k] if k < len(e_at) else len(expected)
    before, after = _SNIPPET_CHARS
    return {
        "mode": "ignore_strippable", "unit": "char", "position": a_pos,
        "expected": expected[max(0, e_pos - before): e_pos + after],
        "actual": actual[max(0, a_pos - before): a_pos + after],
        "expected_length": len(expected), "actual_length": len(actual),
    }


def _significant(text: str) -> str:
    """`text` without reasoning blocks and whitespace: what `ignore_strippable` compares."""
    return "".join(_REASONING.sub("", text).split())


def _significant_with_offsets(text: str) -> tuple[str, list[int]]:
    """Like `_significant`, with each kept character's offset in `text` (to point at a difference)."""
    offsets: list[int] = []
    start = 0
    for m in _REASONING.finditer(text):
        offsets.extend(i for i in range(start, m.start()) if not text[i].isspace())
        start = m.end()
    offsets.extend(i for i in range(start, len(text)) if not text[i].isspace())
    return "".join(text[i] for i in offsets), offsets
