"""Renderer renders what transformers' apply_chat_template renders, for the real Qwen3 template."""

from __future__ import annotations

import dataclasses
import enum
import gc

import pytest
from transformers import AutoTokenizer

from rollout_buffer.tokens.renderer import Renderer, _template_messages

TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]}}},
    {"type": "function", "function": {"name": "noop", "description": None, "parameters": {}}}]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": None}}}
CONVERSATIONS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": None},
     {"role": "assistant", "content": "Hello!", "reasoning_content": "greet them"},
     {"role": "user", "content": "Sum 1, 2"},
     {"role": "assistant", "content": "", "tool_calls": [CALL, CALL]},
     {"role": "tool", "content": "3"}, {"role": "tool", "content": ""},
     {"role": "assistant", "content": "<think>\nok\n</think>\n\n3"}],
    # Reasoning under each of its names, and a None one that must not hide the next.
    [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": "r1"},
     {"role": "user", "content": "c"}, {"role": "assistant", "content": "d", "thinking": "r2"},
     {"role": "user", "content": "e"}, {"role": "assistant", "content": "f", "reasoning_content": None,
                                        "reasoning": "r3"}],
    [{"role": "user", "content": "parts"},
     {"role": "assistant", "content": "y", "tool_calls": [{"type": "function", "function": {
         "name": "add", "arguments": '{"a": 1}'}}, {"type": "function", "function": {
             "name": "add", "arguments": {"a": [1.5, True, None, {"deep": "x"}]}}}]}, {"role": "tool", "content": "1"}],
]
OPTIONS = [{}, {"enable_thinking": False}]


@pytest.fixture()
def tokenizer(qwen_tokenizer_path):
    return AutoTokenizer.from_pretrained(qwen_tokenizer_path)


def _transformers(tok, messages, tools, options, generation_prompt):
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=False,
                                   **options)


def test_plain_messages_render_as_transformers_renders_them(tokenizer):
    for tools in (None, TOOLS):
        for options in OPTIONS:
            renderer = Renderer(tokenizer, tools, options)
            for messages in CONVERSATIONS:
                assert _template_messages(messages) is not None  # rendered by the compiled template itself
                for generation_prompt in (False, True):
                    expected = _transformers(tokenizer, messages, tools, options, generation_prompt)
                    assert renderer.render(messages, generation_prompt) == expected
    assert CONVERSATIONS[1][1]["name"] is None  # the caller's messages are left as they were


class Role(enum.StrEnum):
    USER = "user"


@dataclasses.dataclass
class Part:
    type: str
    text: str


def test_other_messages_go_through_transformers(tokenizer):
    renderer = Renderer(tokenizer, TOOLS, {})
    # Each is something transformers converts (enum members to their text, dataclasses to dicts, tuples kept).
    odd = [
        [{"role": Role.USER, "content": "hi"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "add", "arguments": {"a": Part("text", "hi")}}}]}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "x", "tool_calls": (CALL,)}],
        [{"role": "user", "content": "hi", 1: "int key"}],
    ]
    for messages in odd:
        assert _template_messages(messages) is None
        for generation_prompt in (False, True):
            expected = _transformers(tokenizer, messages, TOOLS, {}, generation_prompt)
            assert renderer.render(messages, generation_prompt) == expected
    with pytest.raises(ValueError, match="empty conversation"):
        renderer.render([], True)


def test_the_template_for_tools_is_chosen_as_transformers_chooses_it(tokenizer):
    tokenizer.chat_template = {
        "default": "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}",
        "tool_use": "tools={{ tools | map(attribute='function.name') | join(',') }} "
                    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}{{ bos_token }}",
    }
    messages = CONVERSATIONS[0]
    for tools in (None, TOOLS):
        expected = _transformers(tokenizer, messages, tools, {}, True)
        assert Renderer(tokenizer, tools, {}).render(messages, True) == expected
    assert Renderer(tokenizer, None, {}).render(messages, True).startswith("[user]")


def test_a_tokenizer_without_a_jinja_template_renders_through_its_own_method():
    class Tokenizer:
        def apply_chat_template(self, messages, tools, add_generation_prompt, tokenize, **options):
            return f"{len(messages)} {tools} {add_generation_prompt} {tokenize} {options}"

    renderer = Renderer(Tokenizer(), None, {"x": 1})
    assert renderer.render([{"role": "user", "content": "hi"}], True) == "1 None True False {'x': 1}"


def test_tool_schemas_keep_their_json_text_while_a_renderer_holds_them(tokenizer):
    # A template writing the schemas twice, with the filter's own options: each text cached per options.
    tokenizer.chat_template = ("{% for t in tools %}{{ t | tojson }}|{{ t | tojson(indent=2) }}|"
                               "{{ t.function | tojson }}{% endfor %}"
                               "{% for m in messages %}{{ m.content }}{% endfor %}")
    renderer = Renderer(tokenizer, TOOLS, {})
    filters = renderer._template.environment.filters
    held = filters["tojson"]._held
    assert len(held) == len(TOOLS)
    for messages in CONVERSATIONS[:2]:
        for _ in range(2):
            assert renderer.render(messages, True) == _transformers(tokenizer, messages, TOOLS, {}, True)
    # jinja looks filters up at render time: the template's tojson calls reached the held texts.
    assert all(len(texts) == 2 for _, texts in held.values()), "the template no longer calls the held tojson filter"
    other = Renderer(tokenizer, TOOLS[:1], {})
    assert other.render(CONVERSATIONS[0], False) == _transformers(tokenizer, CONVERSATIONS[0], TOOLS[:1], {}, False)
    assert len(held) == len(TOOLS) + 1
    del renderer, other
    gc.collect()
    assert held == {}  # what they held is let go with them
