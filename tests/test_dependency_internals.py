"""The private internals of transformers and jinja2 the buffer relies on (`shortcuts/templates.py`).

The `*_is_as_reviewed` tests fail, saying what to do, as soon as an installed transformers or jinja2 changes one
of them. The `*_fallback*` tests force each fallback (the internal monkeypatched away or changed while the choice
is made) and show that renders of the real Qwen3 chat template (text and token ids) and the sandbox's refusals
are those of the fast path.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import logging
from typing import Any

import jinja2
import pytest
from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from transformers import AutoTokenizer
from transformers.utils import chat_template_utils as ctu

from rollout_buffer.shortcuts import templates as internals
from rollout_buffer.tokens.renderer import Renderer
from rollout_buffer.tokens.template_sandbox import speed_up_sandbox

TRANSFORMERS = importlib.metadata.version("transformers")
WHAT_TO_DO = (
    "The buffer now renders chat templates through their fallbacks (same text, slower). Read what transformers "
    f"{TRANSFORMERS} does instead (chat_template_utils.render_jinja_template, apply_chat_template), then adapt "
    "rollout_buffer/shortcuts/templates.py (its docstring lists each internal, why, and its fallback) "
    "and tokens/renderer.py, or drop the internal there and here."
)

TOOLS: list[dict[str, Any]] = [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a"]}}}]
CALL = {"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}
CONVERSATIONS: list[list[dict[str, Any]]] = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi", "name": None},
     {"role": "assistant", "content": "Hello!", "reasoning_content": "greet them"},
     {"role": "user", "content": "Sum 1, 2"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
     {"role": "tool", "content": "3"}, {"role": "assistant", "content": "3", "reasoning": "added"}],
]
OPTIONS: list[dict[str, Any]] = [{}, {"enable_thinking": False}]
CASES: list[tuple[Any, dict[str, Any], list[dict[str, Any]], bool]] = [
    (tools, options, messages, generation_prompt) for tools in (None, TOOLS) for options in OPTIONS
    for messages in CONVERSATIONS for generation_prompt in (False, True)]


def _tokenizer(path: str, name: str) -> Any:
    """The Qwen3 tokenizer with a template text of its own (a trailing comment, which renders nothing): its
    compiled template and environment are fresh (transformers caches them by template text)."""
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template += "{#- " + name + " -#}"
    return tok


def _renders(tok: Any) -> tuple[list[str], list[list[int]], list[bool]]:
    """Renderer's renders of every case, their token ids, and whether each renderer rendered directly."""
    texts, direct = [], []
    for tools, options, messages, generation_prompt in CASES:
        renderer = Renderer(tok, tools, options)
        texts.append(renderer.render(messages, generation_prompt))
        direct.append(renderer._template is not None)
    return texts, [tok.encode(text, add_special_tokens=False) for text in texts], direct


def _transformers_ids(tok: Any) -> list[list[int]]:
    return [tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt, tokenize=True,
                                    return_dict=False, **options)
            for tools, options, messages, generation_prompt in CASES]


def _choose_transformers(monkeypatch: pytest.MonkeyPatch, remove: tuple[str, ...] = (),
                         replace: dict[str, Any] | None = None) -> internals.TransformersInternals:
    """Make the choice of transformers' internals with `remove` gone and `replace` changed in transformers (only
    while choosing: transformers itself needs them), and use it for the rest of the test."""
    with monkeypatch.context() as m:
        for name in remove:
            m.delattr(ctu, name)
        for name, value in (replace or {}).items():
            m.setattr(ctu, name, value)
        choice = internals.select_transformers_internals()
    monkeypatch.setattr(internals, "_transformers_choice", choice)
    return choice


def _assert_refusals(tok: Any, name: str, hooked: bool) -> None:
    """The sandbox the tokenizer's templates render in (hooked by `speed_up_sandbox` or jinja's own) refuses to
    mutate the messages or to reach object internals, as jinja's own does."""
    messages = CONVERSATIONS[0]
    for template in ("{{ messages.append(messages[0]) }}", "{{ messages[0].update(role='system') }}",
                     "{{ messages[0].content.__class__.__base__ }}", "{{ messages[0].items.__self__.clear() }}",
                     "{{ raise_exception.__globals__.keys() }}"):
        tok.chat_template = template + "{#- " + name + " -#}"
        assert speed_up_sandbox(tok) == int(hooked)
        env = ctu._compile_jinja_template(tok.chat_template).environment  # what apply_chat_template renders with
        assert isinstance(env.is_safe_attribute, internals._MemoizedSafety) == hooked
        for _ in range(2):  # decisions worked out, then remembered
            with pytest.raises(SecurityError):
                tok.apply_chat_template(messages, tokenize=False)
    assert messages == [{"role": "user", "content": "What is 2 + 2?"}]


# ---------------------------------------------------------------------------------------------------------------
# Each internal as reviewed: these fail loudly when an installed version changes one.


def test_transformers_compile_jinja_template_is_as_reviewed(qwen_tokenizer_path):
    compile_template = getattr(ctu, "_compile_jinja_template", None)
    assert compile_template is not None, (
        f"transformers {TRANSFORMERS} removed chat_template_utils._compile_jinja_template. {WHAT_TO_DO}")
    assert list(inspect.signature(compile_template).parameters) == ["chat_template"], (
        f"transformers {TRANSFORMERS} changed the signature of _compile_jinja_template to "
        f"{inspect.signature(compile_template)}. {WHAT_TO_DO}")
    assert hasattr(compile_template, "cache_info"), (
        f"transformers {TRANSFORMERS} no longer caches _compile_jinja_template: Renderer's tojson cache and "
        f"speed_up_sandbox change an environment apply_chat_template no longer renders with. {WHAT_TO_DO}")
    tok = _tokenizer(qwen_tokenizer_path, "compile reviewed")
    template = compile_template(tok.chat_template)
    assert compile_template(tok.chat_template) is template
    assert isinstance(template, jinja2.Template) and type(template.environment) is ImmutableSandboxedEnvironment, (
        f"transformers {TRANSFORMERS} compiles chat templates as {type(template)} in "
        f"{type(getattr(template, 'environment', None))}, not a jinja Template in jinja's "
        f"ImmutableSandboxedEnvironment (speed_up_sandbox now leaves it alone). {WHAT_TO_DO}")
    assert "tojson" in template.environment.filters

    # Its environment is the one apply_chat_template renders with: what the buffer changes there applies to both.
    tok.chat_template = "{{ messages[0] | tojson }}{#- compile shared -#}"
    env = compile_template(tok.chat_template).environment
    own_tojson = env.filters["tojson"]
    env.filters["tojson"] = lambda value, **kwargs: "seen by apply_chat_template"
    try:
        assert tok.apply_chat_template(CONVERSATIONS[0], tokenize=False) == "seen by apply_chat_template", (
            f"transformers {TRANSFORMERS} renders apply_chat_template with another environment than "
            f"_compile_jinja_template's. {WHAT_TO_DO}")
    finally:
        env.filters["tojson"] = own_tojson
    assert internals.select_transformers_internals().compile_template is compile_template


def test_transformers_plain_template_data_is_as_reviewed():
    plain = getattr(ctu, "_plain_template_data", None)
    assert plain is not None, (
        f"transformers {TRANSFORMERS} removed chat_template_utils._plain_template_data. {WHAT_TO_DO}")
    assert list(inspect.signature(plain).parameters) == ["value"], (
        f"transformers {TRANSFORMERS} changed the signature of _plain_template_data to {inspect.signature(plain)}. "
        f"{WHAT_TO_DO}")
    value = {"tools": TOOLS, "special": {"eos_token": "<|im_end|>"}, "n": [1, 2.5, True, None, "x"]}
    copy = plain(value)
    assert copy == value == internals._plain_json_copy(value), (
        f"transformers {TRANSFORMERS} changed what _plain_template_data makes of plain JSON values: {copy!r}. "
        f"{WHAT_TO_DO}")
    assert copy is not value and copy["tools"][0] is not TOOLS[0]  # a copy: templates never see the caller's data
    assert internals.select_transformers_internals().plain_template_data is plain


def test_transformers_reasoning_fields_are_as_mirrored():
    theirs = getattr(ctu, "_REASONING_FIELDS", None)
    assert theirs == internals.REASONING_FIELDS, (
        f"transformers {TRANSFORMERS} offers a message's reasoning under {theirs!r}, not "
        f"{internals.REASONING_FIELDS!r} as tokens/renderer.py mirrors it. {WHAT_TO_DO}")
    assert internals.select_transformers_internals().fallbacks == ()


def test_jinja_sandbox_code_is_as_reviewed():
    unreviewed = internals.unreviewed_sandbox_code()
    assert not unreviewed, (
        f"jinja2 {jinja2.__version__} changed {', '.join(unreviewed)}: the buffer now leaves transformers' sandbox "
        "as it is (same renders and refusals, slower). Read the new code: if the sandbox's decisions still depend "
        "on (type, attribute name) alone, add these fingerprints to _REVIEWED_SANDBOX_CODE in "
        f"rollout_buffer/shortcuts/templates.py: {unreviewed}; otherwise change _MemoizedSafety there "
        "first.")
    assert internals._sandbox_hooks_reviewed


def test_templates_consult_the_sandbox_hooks(qwen_tokenizer_path):
    # The sandbox's getattr must ask the environment's is_safe_attribute at render time: otherwise the memo is
    # never called (renders stay right, but slow).
    tok = _tokenizer(qwen_tokenizer_path, "hooks consulted")
    assert speed_up_sandbox(tok) == 1
    memo = ctu._compile_jinja_template(tok.chat_template).environment.is_safe_attribute
    assert isinstance(memo, internals._MemoizedSafety)
    tok.apply_chat_template(CONVERSATIONS[1], tools=TOOLS, tokenize=False)
    assert (str, "startswith") in memo._known or (str, "split") in memo._known, (
        f"jinja2 {jinja2.__version__}: the sandbox's getattr no longer asks environment.is_safe_attribute. Review "
        "_MemoizedSafety in rollout_buffer/shortcuts/templates.py.")


def test_fingerprints_ignore_docstrings_comments_and_blank_lines_only(tmp_path):
    variants = {"reviewed": 'def f(x):\n    """A docstring."""\n    # a comment\n\n    return x + 1\n',
                "reworded": 'def f(x):\n    """Another docstring,\n    on two lines."""\n    return x + 1\n',
                "changed": 'def f(x):\n    return x + 2\n'}
    fingerprints = {}
    for name, source in variants.items():
        (tmp_path / f"fp_{name}.py").write_text(source)
        spec = importlib.util.spec_from_file_location(f"fp_{name}", tmp_path / f"fp_{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        fingerprints[name] = internals.code_fingerprint(module.f)
    assert fingerprints["reviewed"] == fingerprints["reworded"] != fingerprints["changed"]


# ---------------------------------------------------------------------------------------------------------------
# Each fallback forced: the same renders, the same refusals.


def test_fast_path_renders_directly_and_as_transformers_does(qwen_tokenizer_path):
    tok = _tokenizer(qwen_tokenizer_path, "fast path")
    texts, ids, direct = _renders(tok)
    assert all(direct)
    assert ids == _transformers_ids(tok)
    assert texts[0].startswith("<|im_start|>user\nWhat is 2 + 2?<|im_end|>")


@pytest.mark.parametrize("change", [{"remove": ("_compile_jinja_template",)},
                                    {"replace": {"_compile_jinja_template": lambda chat_template, strict: None}},
                                    {"replace": {"_compile_jinja_template": lambda chat_template: None}}],
                         ids=["removed", "signature changed", "no template returned"])
def test_without_compile_jinja_template_renders_go_through_apply_chat_template(qwen_tokenizer_path, monkeypatch,
                                                                               caplog, change):
    fast_texts, fast_ids, _ = _renders(_tokenizer(qwen_tokenizer_path, "compile fast"))
    with caplog.at_level(logging.WARNING, logger=internals.__name__):
        choice = _choose_transformers(monkeypatch, **change)
    assert choice.compile_template is None and choice.fallbacks == ("_compile_jinja_template",)
    assert "_compile_jinja_template" in caplog.text and "fallbacks" in caplog.text

    tok = _tokenizer(qwen_tokenizer_path, "compile fallback")
    texts, ids, direct = _renders(tok)
    assert not any(direct)  # every render through the tokenizer's public apply_chat_template
    assert texts == fast_texts and ids == fast_ids == _transformers_ids(tok)
    assert speed_up_sandbox(tok) == 0  # nothing to change: the sandbox is jinja's own
    _assert_refusals(tok, "refusals without compile", hooked=False)


def test_without_plain_template_data_the_fallback_copy_renders_the_same(qwen_tokenizer_path, monkeypatch, caplog):
    fast_texts, fast_ids, _ = _renders(_tokenizer(qwen_tokenizer_path, "plain fast"))
    # Tools that are not exact JSON values (a tuple): transformers' copy takes them, the fallback's does not.
    odd_tools: list[dict[str, Any]] = [{"type": "function", "function": {**TOOLS[0]["function"], "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ("a",)}}}]
    fast_odd = Renderer(_tokenizer(qwen_tokenizer_path, "plain fast"), odd_tools, {})
    assert fast_odd._template is not None
    with caplog.at_level(logging.WARNING, logger=internals.__name__):
        choice = _choose_transformers(monkeypatch, remove=("_plain_template_data",))
    assert choice.plain_template_data is internals._plain_json_copy and "_plain_template_data" in caplog.text

    tok = _tokenizer(qwen_tokenizer_path, "plain fallback")
    texts, ids, direct = _renders(tok)
    assert all(direct)  # plain JSON tools and options: still rendered directly, with the fallback's copy
    assert texts == fast_texts and ids == fast_ids == _transformers_ids(tok)
    odd = Renderer(tok, odd_tools, {})
    assert odd._template is None  # the fallback refuses the tuple: these renders go through apply_chat_template
    for messages in CONVERSATIONS:
        assert odd.render(messages, True) == fast_odd.render(messages, True)
    with pytest.raises(internals.NotPlainData):
        internals.plain_template_data({"t": ("a",)})
    with pytest.raises(internals.NotPlainData):
        internals.plain_template_data({1: "int key"})


@pytest.mark.parametrize("change", [{"remove": ("_REASONING_FIELDS",)},
                                    {"replace": {"_REASONING_FIELDS": ("reasoning_content", "thinking")}}],
                         ids=["removed", "changed"])
def test_when_reasoning_fields_differ_renders_go_through_apply_chat_template(qwen_tokenizer_path, monkeypatch,
                                                                             caplog, change):
    fast_texts, fast_ids, _ = _renders(_tokenizer(qwen_tokenizer_path, "reasoning fast"))
    with caplog.at_level(logging.WARNING, logger=internals.__name__):
        choice = _choose_transformers(monkeypatch, **change)
    assert not choice.reasoning_fields_match and "_REASONING_FIELDS" in caplog.text
    assert choice.compile_template is not None  # the sandbox speed-up still applies

    tok = _tokenizer(qwen_tokenizer_path, "reasoning fallback")
    texts, ids, direct = _renders(tok)
    assert not any(direct)
    assert texts == fast_texts and ids == fast_ids == _transformers_ids(tok)


def _changed_is_safe_attribute(self: Any, obj: Any, attr: str, value: Any) -> bool:
    """A jinja2 that would decide on the value too (which a memo by type and name would get wrong)."""
    return not callable(value) or attr != "mro"


def test_a_changed_jinja_sandbox_keeps_jinjas_own_methods(qwen_tokenizer_path, monkeypatch, caplog):
    fast = _tokenizer(qwen_tokenizer_path, "sandbox fast")
    assert speed_up_sandbox(fast) == 1
    fast_texts = [fast.apply_chat_template(m, tools=t, add_generation_prompt=g, tokenize=False, **o)
                  for t, o, m, g in CASES]
    with monkeypatch.context() as m, caplog.at_level(logging.WARNING, logger=internals.__name__):
        m.setattr(ImmutableSandboxedEnvironment, "is_safe_attribute", _changed_is_safe_attribute)
        reviewed = internals.select_sandbox_hooks()
    assert not reviewed and "ImmutableSandboxedEnvironment.is_safe_attribute" in caplog.text
    monkeypatch.setattr(internals, "_sandbox_hooks_reviewed", reviewed)

    tok = _tokenizer(qwen_tokenizer_path, "sandbox fallback")
    assert speed_up_sandbox(tok) == 0
    env = ctu._compile_jinja_template(tok.chat_template).environment
    assert not isinstance(env.is_safe_attribute, internals._MemoizedSafety)
    texts = [tok.apply_chat_template(m, tools=t, add_generation_prompt=g, tokenize=False, **o) for t, o, m, g in CASES]
    assert texts == fast_texts
    assert [tok.encode(t, add_special_tokens=False) for t in texts] == _transformers_ids(fast)
    _assert_refusals(tok, "refusals of a changed jinja2", hooked=False)


def test_the_fast_sandbox_refuses_what_jinjas_refuses(qwen_tokenizer_path):
    tok = _tokenizer(qwen_tokenizer_path, "sandbox refusals")
    assert internals._sandbox_hooks_reviewed
    _assert_refusals(tok, "refusals of the fast sandbox", hooked=True)
