"""The faster sandbox (memoized decisions): same renders, same refusals, for the real Qwen3 chat template."""

from __future__ import annotations

import pytest
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import AutoTokenizer

from rollout_buffer.shortcuts.templates import _MemoizedSafety
from rollout_buffer.tokens.template_sandbox import speed_up_sandbox

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\ngreet\n</think>\n\nHello!"}, {"role": "user", "content": "Sum 1, 2"},
     {"role": "assistant", "content": "", "tool_calls": [{"type": "function",
                                                         "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]},
     {"role": "tool", "content": "3"}, {"role": "assistant", "content": "<think>\nok\n</think>\n\n3"}],
]
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}]


def test_decisions_are_the_sandboxs_own():
    env = ImmutableSandboxedEnvironment()
    memo = _MemoizedSafety(env.is_safe_attribute)
    probes = [([], "append"), ({}, "update"), ({}, "get"), ("", "split"), ("", "__class__"),
              (str, "mro"), (test_decisions_are_the_sandboxs_own, "__globals__"), (set(), "add"), ((), "count")]
    for _ in range(2):  # first answer worked out, second remembered
        for obj, attr in probes:
            assert memo(obj, attr, getattr(obj, attr)) == env.is_safe_attribute(obj, attr, getattr(obj, attr))


def test_renders_and_refusals_are_unchanged(qwen_tokenizer_path):
    tok = AutoTokenizer.from_pretrained(qwen_tokenizer_path)
    # A comment makes a template of its own (transformers caches compiled templates by their text).
    tok.chat_template += "{#- memo test -#}"
    before = [tok.apply_chat_template(c, tools=TOOLS, tokenize=False, add_generation_prompt=g)
              for c in CONVERSATIONS for g in (False, True)]
    assert speed_up_sandbox(tok) == 1
    assert speed_up_sandbox(tok) == 0  # already done
    for _ in range(2):
        after = [tok.apply_chat_template(c, tools=TOOLS, tokenize=False, add_generation_prompt=g)
                 for c in CONVERSATIONS for g in (False, True)]
        assert after == before

    tok.chat_template = "{{ messages.append(messages[0]) }}{{ messages | length }}"
    assert speed_up_sandbox(tok) == 1
    for _ in range(2):
        with pytest.raises(SecurityError):
            tok.apply_chat_template(CONVERSATIONS[0], tokenize=False)
