"""Long trajectory records (thousands of tokens) built with the real Qwen3 tokenizer, as the runner makes them.

Each record is a real token-mode `Conversation`: a rendered prompt, an assistant turn of engine output ids
with a log-prob each, the loss mask, and the messages beside them, so both adapter paths (exact tokens,
and re-tokenizing the messages) see exactly what they would in training.
"""

from __future__ import annotations

import random
from typing import Any

from rollout_buffer.tokens.conversation import Conversation

_WORDS = ("the", "sum", "of", "both", "terms", "gives", "so", "we", "check", "each", "step", "again", "then",
          "carry", "one", "to", "next", "column", "and", "result", "is", "equal", "twice", "value", "minus")


def _text(rng: random.Random, words: int) -> str:
    parts = []
    for i in range(words):
        parts.append(str(rng.randrange(1000)) if i % 7 == 3 else rng.choice(_WORDS))
        if i % 40 == 39:
            parts.append(".\n")
    return " ".join(parts)


def long_records(tokenizer: Any, count: int, tokens: int, group_size: int = 8, distinct: int = 8,
                 seed: int = 0) -> list[dict[str, Any]]:
    """`count` records of about `tokens` tokens (one eighth prompt), in groups of `group_size`.

    `distinct` different conversations are built and reused under new uids: building is not what is
    measured, and the tokenizer would take a while for a thousand 8k-token texts.
    """
    rng = random.Random(seed)
    bases = []
    for _ in range(distinct):
        # About 1.4 tokens a word here; the reply's ids are cut to size and its text decoded from them.
        conv = Conversation([{"role": "user", "content": _text(rng, tokens // 12)}], tokenizer)
        want = tokens - len(conv.token_ids) - 1
        ids = tokenizer.encode(_text(rng, want), add_special_tokens=False)[:want]
        reply = tokenizer.decode(ids)
        ids.append(tokenizer.convert_tokens_to_ids("<|im_end|>"))
        conv.add_assistant(ids, [-rng.random() * 4 for _ in ids], reply)
        bases.append({"messages": conv.messages, **conv.record_fields()})
    records = []
    for i in range(count):
        base = bases[i % distinct]
        group, repeat = divmod(i, group_size)
        records.append({
            "uid": f"long-{group}-{repeat}",
            "instance_id": f"long-{group}",
            "reward": float(repeat % 2),
            "extra_info": {"epoch": 0, "repeat": repeat, "finish_reason": "stop", "timestamp": 0.0},
            **base,
        })
    return records
