"""Loss masks of messages-only records equal slime's algorithm, checked on the real Qwen3 tokenizer.

The expected ids are assembled by hand from the chat template's pieces, following slime's definition:
every message is rendered on its own, assistant tokens get loss 1 after the `<|im_start|>assistant\\n`
header, everything else gets 0.
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Iterator
from typing import Any

import pytest
from slime_src import SLIME_SRC, slime_on_path
from transformers import AutoTokenizer

from slime_adapter.loss_mask import SLIME_GENERATOR, LossMaskGenerator, get_response_lengths

SYSTEM = "You are a careful math assistant."
TOOL = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression",
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string"}},
            "required": ["expression"],
        },
    },
}
FIRST_ANSWER = "<think>\nI should use the calculator.\n</think>\n\nLet me compute it."
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 17 * 23?"},
    {
        "role": "assistant",
        "content": FIRST_ANSWER,
        "tool_calls": [
            {"type": "function", "function": {"name": "calculator", "arguments": {"expression": "17 * 23"}}}
        ],
    },
    {"role": "tool", "content": "391"},
    {"role": "assistant", "content": "<think>\nThe tool says 391.\n</think>\n\n17 * 23 = 391."},
]
HEADER = "<|im_start|>assistant\n"
TOOLS_BLOCK = (
    "<|im_start|>system\n" + SYSTEM + "\n\n# Tools\n\nYou may call one or more functions to assist with "
    "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n"
    + json.dumps(TOOL, ensure_ascii=False)
    + "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    "<tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": "
    "<args-json-object>}\n</tool_call><|im_end|>\n"
)
USER_TURN = "<|im_start|>user\nWhat is 17 * 23?<|im_end|>\n"
TOOL_TURN = "<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n"
CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "17 * 23"}}\n</tool_call>'


class Expected:
    """Hand-assembled ids and mask: pieces with loss 0, assistant turns with a 0-loss header."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.mask: list[int] = []

    def enc(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def context(self, text: str) -> Expected:
        ids = self.enc(text)
        self.ids += ids
        self.mask += [0] * len(ids)
        return self

    def assistant(self, body: str) -> Expected:
        header, ids = self.enc(HEADER), self.enc(HEADER + body)
        self.ids += ids
        self.mask += [0] * len(header) + [1] * (len(ids) - len(header))
        return self


def test_qwen3_keeps_think_blocks_and_masks_tool_turns(qwen_tokenizer: Any) -> None:
    expected = (
        Expected(qwen_tokenizer)
        .context(TOOLS_BLOCK)
        .context(USER_TURN)
        .assistant(FIRST_ANSWER + "\n" + CALL + "<|im_end|>\n")
        .context(TOOL_TURN)
        .assistant("<think>\nThe tool says 391.\n</think>\n\n17 * 23 = 391.<|im_end|>\n")
    )
    ids, mask = LossMaskGenerator(qwen_tokenizer, "qwen3").get_loss_mask(CONVERSATION, tools=[TOOL])
    assert ids == expected.ids
    assert mask == expected.mask
    trained = qwen_tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m])
    assert trained == (
        FIRST_ANSWER + "\n" + CALL + "<|im_end|>\n"
        "<think>\nThe tool says 391.\n</think>\n\n17 * 23 = 391.<|im_end|>\n"
    )


def test_qwen3_puts_consecutive_tool_messages_into_one_user_turn(qwen_tokenizer: Any) -> None:
    # Parallel calls as a tool-call parser returns them (OpenAI tool_calls, JSON-string arguments).
    calls = [{"id": f"call_{k}", "type": "function",
              "function": {"name": "calculator", "arguments": json.dumps({"expression": e})}}
             for k, e in enumerate(("17 * 23", "17 + 23"))]
    messages = [
        {"role": "user", "content": "What is 17 * 23?"},
        {"role": "assistant", "content": "", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "call_0", "content": "391"},
        {"role": "tool", "tool_call_id": "call_1", "content": "40"},
        {"role": "assistant", "content": "391"},
    ]
    hermes = "\n".join(
        '<tool_call>\n{"name": "calculator", "arguments": ' + c["function"]["arguments"] + "}\n</tool_call>"
        for c in calls)
    expected = (
        Expected(qwen_tokenizer)
        .context(USER_TURN)
        .assistant("<think>\n\n</think>\n\n" + hermes + "<|im_end|>\n")
        .context("<|im_start|>user\n<tool_response>\n391\n</tool_response>\n<tool_response>\n40\n</tool_response>"
                 "<|im_end|>\n")
        .assistant("<think>\n\n</think>\n\n391<|im_end|>\n")
    )
    assert LossMaskGenerator(qwen_tokenizer, "qwen3").get_loss_mask(messages) == (expected.ids, expected.mask)


def test_qwen3_without_reasoning_gets_an_empty_think_block(qwen_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    expected = (
        Expected(qwen_tokenizer)
        .context("<|im_start|>user\nhi<|im_end|>\n")
        .assistant("<think>\n\n</think>\n\nhello<|im_end|>\n")
    )
    assert LossMaskGenerator(qwen_tokenizer, "qwen3").get_loss_mask(messages) == (expected.ids, expected.mask)


def test_qwen_renders_each_message_alone(qwen_tokenizer: Any) -> None:
    # Alone, an assistant message is not "after the last query", so Qwen3's template drops its reasoning.
    expected = (
        Expected(qwen_tokenizer)
        .context(TOOLS_BLOCK)
        .context(USER_TURN)
        .assistant("Let me compute it.\n" + CALL + "<|im_end|>\n")
        .context(TOOL_TURN)
        .assistant("17 * 23 = 391.<|im_end|>\n")
    )
    ids, mask = LossMaskGenerator(qwen_tokenizer, "qwen").get_loss_mask(CONVERSATION, tools=[TOOL])
    assert (ids, mask) == (expected.ids, expected.mask)


def test_distill_qwen_is_first_message_prompt_plus_last_message_text(qwen_tokenizer: Any) -> None:
    expected = Expected(qwen_tokenizer).context(TOOLS_BLOCK + HEADER)
    response = expected.enc(CONVERSATION[-1]["content"])
    ids, mask = LossMaskGenerator(qwen_tokenizer, "distill_qwen").get_loss_mask(CONVERSATION, tools=[TOOL])
    assert ids == expected.ids + response
    assert mask == expected.mask + [1] * len(response)


def test_step_loss_mask_zero_excludes_a_turn(qwen_tokenizer: Any) -> None:
    messages = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "draft", "step_loss_mask": 0},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "final"},
    ]
    gen = LossMaskGenerator(qwen_tokenizer, "qwen3")
    ids, mask = gen.get_loss_mask(messages)
    assert qwen_tokenizer.decode([t for t, m in zip(ids, mask, strict=True) if m]) == (
        "<think>\n\n</think>\n\nfinal<|im_end|>\n"
    )
    all_masked = [dict(m, step_loss_mask=0) if m["role"] == "assistant" else m for m in messages]
    _, zero = gen.get_loss_mask(all_masked)
    assert set(zero) == {0} and gen.get_response_lengths([zero]) == [0]


def test_template_with_default_system_prompt_is_cut_from_later_turns(qwen_tokenizer_path: str) -> None:
    # Qwen2.5-style template: injects a default system prompt when the conversation has none.
    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_path)
    default_system = (
        "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\n"
    )
    tokenizer.chat_template = (
        "{%- if messages[0]['role'] == 'system' %}{{- '<|im_start|>system\\n' + messages[0]['content'] + "
        "'<|im_end|>\\n' }}{%- else %}{{- '" + default_system.replace("\n", "\\n") + "' }}{%- endif %}"
        "{%- for m in messages %}{%- if not (m.role == 'system' and loop.first) %}"
        "{{- '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
    )
    gen = LossMaskGenerator(tokenizer, "qwen")
    expected = Expected(tokenizer).context(default_system)
    assert gen.system_message_length == len(expected.ids)
    assert gen.gen_token_length == len(expected.enc(HEADER))
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4"}]
    expected.context("<|im_start|>user\n2+2?<|im_end|>\n").assistant("4<|im_end|>\n")
    assert gen.get_loss_mask(messages) == (expected.ids, expected.mask)


def test_response_lengths_run_from_first_trained_token_to_the_end() -> None:
    assert get_response_lengths([[0, 0, 1, 0, 1, 1], [0, 0], [1], []]) == [4, 0, 1, 0]


def test_unknown_type_is_refused_up_front(qwen_tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="qwen3"):
        LossMaskGenerator(qwen_tokenizer, "llama")


@pytest.fixture(scope="module")
def slimes_generator() -> Iterator[type]:
    """slime's `MultiTurnLossMaskGenerator`: the installed one, else the one of SLIME_SRC (`.ci/run` sets it)."""
    if SLIME_GENERATOR is not None:
        yield SLIME_GENERATOR
    elif SLIME_SRC:
        with slime_on_path():
            yield importlib.import_module("slime.utils.mask_utils").MultiTurnLossMaskGenerator
    else:
        pytest.skip("slime is not installed and SLIME_SRC is not set")


@pytest.mark.parametrize("mask_type", ["qwen", "qwen3", "distill_qwen"])
def test_same_as_slimes_own_class(slimes_generator: type, qwen_tokenizer: Any, mask_type: str) -> None:
    ours = LossMaskGenerator(qwen_tokenizer, mask_type).get_loss_mask(CONVERSATION, tools=[TOOL])
    slime_generator = slimes_generator(qwen_tokenizer, tokenizer_type=mask_type)
    theirs = slime_generator.get_loss_mask(CONVERSATION, tools=[TOOL])
    assert ours == tuple(theirs)
