"""Conversation and tokenizer loading, against the real Qwen3 tokenizer and chat template."""

from __future__ import annotations

import asyncio
import os
import typing

import numpy as np
import orjson
import pytest

from rollout_buffer.engine.replay import ReplayParts
from rollout_buffer.engine.sglang_wire import request_body
from rollout_buffer.schemas import Trajectory, TrajectoryRecord
from rollout_buffer.tokens.conversation import Conversation
from rollout_buffer.tokens.renderer import Renderer, renderer
from rollout_buffer.tokens.tokenizer import load_tokenizer

PROMPT = [
    {"role": "system", "content": "You are a careful math assistant."},
    {"role": "user", "content": "What is 17 * 23?"},
]
REASONING_1 = "<think>\nI should multiply with the calculator.\n</think>\n\n"
TURN_1 = REASONING_1 + (
    'Let me compute it.\n<tool_call>\n{"name": "calc", "arguments": {"expr": "17*23"}}\n</tool_call>'
)
TOOL_RESULT = {"role": "tool", "content": "391"}
REASONING_2 = "<think>\nThe tool returned 391.\n</think>\n\n"
TURN_2 = REASONING_2 + "17 * 23 = 391."
FOLLOW_UP = {"role": "user", "content": "Now add 9."}
TURN_3 = "<think>\n391 + 9 = 400.\n</think>\n\nThe result is 400."
CALC_TOOL = {
    "type": "function",
    "function": {
        "name": "calc",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expr": {"type": "string"}}, "required": ["expr"]},
    },
}


@pytest.fixture(scope="module")
def im_end(qwen_tokenizer) -> int:
    return qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")


def engine_output(tok, text: str, im_end: int, *, stop: bool = True, base: float = 0.0):
    """What SGLang returns for `text`: its ids (ending at `<|im_end|>` if stopped), distinct log-probs."""
    ids = tok.encode(text, add_special_tokens=False) + ([im_end] if stop else [])
    return ids, [base - (i + 1) / 1000 for i in range(len(ids))]


def render(tok, messages, *, tools=None, generation_prompt=False, **options) -> str:
    return tok.apply_chat_template(messages, tools=tools, add_generation_prompt=generation_prompt,
                                   tokenize=False, **options)


def segments(conv: Conversation) -> list[tuple[int, list[int]]]:
    """Runs of equal loss in the sequence, as (loss, ids)."""
    runs: list[tuple[int, list[int]]] = []
    for tid, loss in zip(conv.token_ids, conv.loss_mask, strict=True):
        if runs and runs[-1][0] == loss:
            runs[-1][1].append(tid)
        else:
            runs.append((loss, [tid]))
    return runs


def three_turns(tok, im_end, sanity_check="strict", tools=None):
    """Assistant with reasoning and a tool call, tool result, assistant, user follow-up, final assistant."""
    conv = Conversation(PROMPT, tok, tools=tools, sanity_check=sanity_check)
    outputs = []
    for i, text in enumerate((TURN_1, TURN_2, TURN_3)):
        if i == 1:
            conv.add_messages([TOOL_RESULT])
        if i == 2:
            conv.add_messages([FOLLOW_UP])
        ids, lps = engine_output(tok, text, im_end, base=-i)
        conv.add_assistant(ids, lps, text, weight_version=f"w{min(i, 1)}")
        outputs.append((ids, lps))
    return conv, outputs


def test_prompt_is_the_template_rendering_with_generation_prompt(qwen_tokenizer):
    conv = Conversation(PROMPT, qwen_tokenizer)
    expected = qwen_tokenizer.encode(render(qwen_tokenizer, PROMPT, generation_prompt=True))
    assert conv.token_ids == expected
    assert conv.generation_ids() == expected
    assert qwen_tokenizer.decode(expected[-3:]) == "<|im_start|>assistant\n"
    assert conv.prompt_length == len(expected)
    assert conv.loss_mask == [0] * len(expected) and conv.log_probs == [0.0] * len(expected)
    assert conv.response_tokens_used() == 0
    assert conv.record_fields()["response_length"] == 0


def test_multi_turn_sequence_masks_and_log_probs(qwen_tokenizer, im_end):
    tok = qwen_tokenizer
    conv, outputs = three_turns(tok, im_end)
    n = len(conv.token_ids)
    assert n == len(conv.loss_mask) == len(conv.log_probs)

    runs = segments(conv)
    # prompt, turn 1, tool delta, turn 2, user delta, turn 3, trailing newline
    assert [loss for loss, _ in runs] == [0, 1, 0, 1, 0, 1, 0]
    assert [ids for loss, ids in runs if loss == 1] == [ids for ids, _ in outputs]
    generated = [lp for lp, loss in zip(conv.log_probs, conv.loss_mask, strict=True) if loss == 1]
    assert generated == [lp for _, lps in outputs for lp in lps]
    assert all(lp == 0.0 for lp, loss in zip(conv.log_probs, conv.loss_mask, strict=True) if loss == 0)

    deltas = [tok.decode(ids) for loss, ids in runs[2::2]]
    assert deltas == [
        "\n<|im_start|>user\n<tool_response>\n391\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        "\n<|im_start|>user\nNow add 9.<|im_end|>\n<|im_start|>assistant\n",
        "\n",
    ]
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "assistant", "user",
                                                  "assistant"]
    assert conv.messages[2]["content"] == TURN_1

    # Apart from the reasoning of the turns before the follow-up question, which Qwen3 drops from
    # history, the sequence is the template's rendering of the messages.
    full = render(tok, conv.messages)
    assert REASONING_1 not in full and REASONING_2 not in full and "<think>\n391 + 9" in full
    decoded = tok.decode(conv.token_ids)
    assert decoded.replace(REASONING_1, "", 1).replace(REASONING_2, "", 1) == full
    kept = list(conv.token_ids)
    for reasoning, (ids, _) in zip((REASONING_1, REASONING_2), outputs, strict=False):
        reasoning_ids = tok.encode(reasoning)
        assert ids[:len(reasoning_ids)] == reasoning_ids
        start = next(i for i in range(len(kept)) if kept[i:i + len(ids)] == ids)
        del kept[start:start + len(reasoning_ids)]
    assert kept == tok.encode(full)


def test_record_fields_fit_the_trajectory_record(qwen_tokenizer, im_end):
    conv, _ = three_turns(qwen_tokenizer, im_end)
    fields = conv.record_fields()
    assert fields["tokens"] == conv.token_ids
    assert fields["loss_mask"] == conv.loss_mask
    assert fields["response_length"] == len(conv.token_ids) - conv.prompt_length
    assert fields["rollout_log_probs"] == conv.log_probs[conv.prompt_length:]
    assert len(fields["rollout_log_probs"]) == fields["response_length"]
    assert fields["weight_versions"] == ["w0", "w1"]
    first_generated = conv.loss_mask.index(1)
    assert first_generated == conv.prompt_length
    record = TrajectoryRecord(uid="u1", instance_id="7", messages=conv.messages, reward=1.0, **fields)
    assert record.tokens == conv.token_ids


def test_tokens_after_a_weight_change_within_their_request_are_marked(qwen_tokenizer, im_end):
    """An answer whose weights changed mid-request (SGLang's `weight_versions`, under an in-place pause): the
    tokens after the change are marked, the marks stay through the next turn and go back with a cut; a fork's
    spans are its own."""
    conv = Conversation(PROMPT, qwen_tokenizer)
    ids, lps = engine_output(qwen_tokenizer, TURN_2, im_end)
    conv.add_assistant(ids, lps, TURN_2, weight_version="4", version_segments=[(3, "3"), (len(ids) - 3, "4")],
                       mid_request=[1])
    start = conv.prompt_length
    assert conv.mid_request_spans() == [[start + 3, start + len(ids), "4"]]
    mark = conv.mark()
    conv.add_messages([FOLLOW_UP])
    more, more_lps = engine_output(qwen_tokenizer, TURN_3, im_end)
    conv.add_assistant(more, more_lps, TURN_3, weight_version="4")
    assert conv.mid_request_spans() == [[start + 3, start + len(ids), "4"]], "a later turn of version 4 is apart"
    assert [s[:3] for s in conv.version_spans][-1][2] == "4" and len(conv.version_spans) == 3
    assert conv.record_fields(mask_offpolicy=True)["loss_mask"][start:start + 3] == [0, 0, 0]
    assert conv.fork(mark).mid_request_spans() == []
    conv.restore(mark)
    assert conv.mid_request_spans() == [[start + 3, start + len(ids), "4"]]


def test_missing_log_probs_are_left_out_not_faked(qwen_tokenizer, im_end):
    conv = Conversation(PROMPT, qwen_tokenizer)
    ids, _ = engine_output(qwen_tokenizer, TURN_2, im_end)
    conv.add_assistant(ids, None, TURN_2)
    fields = conv.record_fields()
    assert "rollout_log_probs" not in fields
    assert fields["response_length"] == len(ids) + 1  # the output and Qwen's newline after <|im_end|>
    with pytest.raises(ValueError, match="log-probs"):
        conv2 = Conversation(PROMPT, qwen_tokenizer)
        conv2.add_assistant(ids, [0.0], TURN_2)


def test_qwen3_dropped_reasoning_fails_strict_and_passes_ignore_strippable(qwen_tokenizer, im_end):
    strict, _ = three_turns(qwen_tokenizer, im_end, "strict")
    report = strict.check()
    assert report is not None
    assert report["unit"] == "token" and report["position"] == strict.prompt_length
    assert "<think>" in report["actual"] and "<think>" not in report["expected"]
    dropped = len(qwen_tokenizer.encode(REASONING_1)) + len(qwen_tokenizer.encode(REASONING_2))
    assert report["actual_length"] - report["expected_length"] == dropped

    tolerant, _ = three_turns(qwen_tokenizer, im_end, "ignore_strippable")
    assert tolerant.check() is None
    assert three_turns(qwen_tokenizer, im_end, "disable")[0].check() is None


def test_tool_turns_without_new_user_message_match_strictly(qwen_tokenizer, im_end):
    tok = qwen_tokenizer
    conv = Conversation(PROMPT, tok, tools=[CALC_TOOL])
    prompt_text = tok.decode(conv.token_ids)
    assert "# Tools" in prompt_text and '"name": "calc"' in prompt_text
    assert conv.token_ids == tok.encode(render(tok, PROMPT, tools=[CALC_TOOL], generation_prompt=True))
    for text, env in ((TURN_1, TOOL_RESULT), (TURN_2, None)):
        ids, lps = engine_output(tok, text, im_end)
        conv.add_assistant(ids, lps, text)
        if env:
            conv.add_messages([env])
    assert conv.check() is None
    assert conv.token_ids == tok.encode(render(tok, conv.messages, tools=[CALC_TOOL]))


def test_whitespace_only_difference(qwen_tokenizer, im_end):
    # The model wrote its reasoning without the newlines the template puts around it.
    text = "<think>Quick.</think>17 * 23 = 391."
    for mode, consistent in (("strict", False), ("ignore_strippable", True)):
        conv = Conversation(PROMPT, qwen_tokenizer, sanity_check=mode)
        ids, lps = engine_output(qwen_tokenizer, text, im_end)
        conv.add_assistant(ids, lps, text)
        assert (conv.check() is None) is consistent, mode


def test_text_that_does_not_match_the_ids_is_reported(qwen_tokenizer, im_end):
    ids, lps = engine_output(qwen_tokenizer, TURN_2, im_end)
    wrong = TURN_2.replace("391.", "392.")
    for mode in ("strict", "ignore_strippable"):
        conv = Conversation(PROMPT, qwen_tokenizer, sanity_check=mode)
        conv.add_assistant(ids, lps, wrong)
        report = conv.check()
        assert report is not None, mode
        assert "392" in report["expected"] and "391" in report["actual"]
    actual_text = qwen_tokenizer.decode(conv.token_ids)
    assert report["unit"] == "char" and actual_text[report["position"]] == "1"


def test_length_cut_truncates_the_conversation(qwen_tokenizer, im_end):
    tok = qwen_tokenizer
    conv = Conversation(PROMPT, tok)
    cut = "<think>\nMultiply.\n</think>\n\n17 * 23 is"
    ids, lps = engine_output(tok, cut, im_end, stop=False)
    conv.add_assistant(ids, lps, cut, finish_reason="length")
    assert conv.truncated and conv.finish_reason == "length"
    assert conv.token_ids[-len(ids):] == ids and conv.loss_mask[-len(ids):] == [1] * len(ids)
    assert im_end not in conv.token_ids[conv.prompt_length:]
    assert conv.check() is None
    with pytest.raises(RuntimeError, match="cut"):
        conv.add_messages([FOLLOW_UP])
    with pytest.raises(RuntimeError, match="cut"):
        conv.generation_ids()
    assert conv.record_fields()["response_length"] == len(ids)


def test_length_cut_inside_reasoning(qwen_tokenizer, im_end):
    # Qwen3's template puts an empty reasoning block before an unfinished one: only strict objects.
    cut = "<think>\nFirst, 17 * 20 is"
    for mode, consistent in (("strict", False), ("ignore_strippable", True)):
        conv = Conversation(PROMPT, qwen_tokenizer, sanity_check=mode)
        ids, lps = engine_output(qwen_tokenizer, cut, im_end, stop=False)
        conv.add_assistant(ids, lps, cut, finish_reason="length")
        assert (conv.check() is None) is consistent, mode


def test_stop_string_turn_is_closed_by_the_template(qwen_tokenizer, im_end):
    tok = qwen_tokenizer
    conv = Conversation(PROMPT, tok)
    text = "<think>\nSearch first.\n</think>\n\n<search>17 * 23</search>"
    ids, lps = engine_output(tok, text, im_end, stop=False)
    conv.add_assistant(ids, lps, text, finish_reason="stop")
    assert not conv.truncated
    assert conv.token_ids[-2:] == tok.encode("<|im_end|>\n") and conv.loss_mask[-2:] == [0, 0]
    assert conv.check() is None
    conv.add_messages([{"role": "user", "content": "<information>391</information>"}])
    assert tok.decode(conv.generation_ids()).endswith(
        "</search><|im_end|>\n<|im_start|>user\n<information>391</information><|im_end|>\n<|im_start|>assistant\n"
    )


def test_consecutive_tool_messages_share_one_block(qwen_tokenizer, im_end):
    tok = qwen_tokenizer
    one_call, two_calls = Conversation(PROMPT, tok), Conversation(PROMPT, tok)
    ids, lps = engine_output(tok, TURN_1, im_end)
    results = [TOOL_RESULT, {"role": "tool", "content": "checked"}]
    for conv in (one_call, two_calls):
        conv.add_assistant(ids, lps, TURN_1)
    one_call.add_messages(results)
    for message in results:
        two_calls.add_messages([message])
    assert two_calls.token_ids == one_call.token_ids
    assert two_calls.messages == one_call.messages
    assert tok.decode(two_calls.generation_ids()).endswith(
        "<tool_response>\n391\n</tool_response>\n<tool_response>\nchecked\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    ids2, lps2 = engine_output(tok, TURN_2, im_end)
    two_calls.add_assistant(ids2, lps2, TURN_2)
    assert two_calls.check() is None


@pytest.mark.parametrize("split", [(3,), (1, 1, 1), (2, 1), (1, 2)], ids=["one_call", "one_by_one", "2+1", "1+2"])
def test_parallel_tool_results_render_as_the_template_however_they_are_appended(qwen_tokenizer, im_end, split):
    tok = qwen_tokenizer
    calls = "\n".join(f'<tool_call>\n{{"name": "calc", "arguments": {{"expr": "{e}"}}}}\n</tool_call>'
                      for e in ("17*23", "17+23", "17-23"))
    turn_1 = "Three at once.\n" + calls  # no reasoning: the follow-up would make Qwen3's template drop it
    results = [{"role": "tool", "tool_call_id": f"call_{k}", "content": c} for k, c in enumerate(("391", "40", "-6"))]
    conv = Conversation(PROMPT, tok, tools=[CALC_TOOL])
    conv.add_assistant(*engine_output(tok, turn_1, im_end), turn_1)
    start = 0
    for n in split:
        conv.add_messages(results[start:start + n])
        start += n
    conv.add_messages([FOLLOW_UP])  # a user turn after the tool results: a block of its own
    conv.add_assistant(*engine_output(tok, TURN_3, im_end), TURN_3)
    assert conv.check() is None, "strict: token for token the template's rendering"
    assert conv.token_ids == tok.encode(render(tok, conv.messages, tools=[CALC_TOOL]))
    assert tok.decode(conv.token_ids).count("<|im_start|>user\n<tool_response>") == 1


def test_messages_before_the_first_turn_join_the_prompt(qwen_tokenizer):
    conv = Conversation(PROMPT[:1], qwen_tokenizer)
    conv.add_messages(PROMPT[1:])
    expected = qwen_tokenizer.encode(render(qwen_tokenizer, PROMPT, generation_prompt=True))
    assert conv.token_ids == expected and conv.prompt_length == len(expected)
    assert conv.messages == PROMPT


def test_response_budget_counts_the_next_generation_prompt(qwen_tokenizer, im_end):
    conv = Conversation(PROMPT, qwen_tokenizer)
    ids, lps = engine_output(qwen_tokenizer, TURN_1, im_end)
    conv.add_assistant(ids, lps, TURN_1)
    conv.add_messages([TOOL_RESULT])
    assert conv.response_tokens_used() == len(conv.generation_ids()) - conv.prompt_length
    assert conv.response_tokens_used() > len(conv.token_ids) - conv.prompt_length


def test_template_options_reach_every_render(qwen_tokenizer, im_end):
    tok = qwen_tokenizer
    options = {"enable_thinking": False}
    conv = Conversation(PROMPT, tok, chat_template_kwargs=options, sanity_check="ignore_strippable")
    assert tok.decode(conv.generation_ids()).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids, lps = engine_output(tok, "Let me check.", im_end)
    conv.add_assistant(ids, lps, "Let me check.")
    conv.add_messages([FOLLOW_UP])
    assert tok.decode(conv.generation_ids()).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    ids, lps = engine_output(tok, "400.", im_end)
    conv.add_assistant(ids, lps, "400.")
    assert conv.check() is None


def test_misuse_is_refused(qwen_tokenizer, im_end):
    conv = Conversation(PROMPT, qwen_tokenizer)
    with pytest.raises(ValueError, match="add_assistant"):
        conv.add_messages([{"role": "assistant", "content": "scripted"}])
    with pytest.raises(ValueError, match="renders nothing"):
        conv.add_messages([{"role": "observation", "content": "unknown role to Qwen's template"}])
    with pytest.raises(RuntimeError, match="add_assistant"):
        conv.add_assistant_text("text would have to be re-tokenized")
    ids, lps = engine_output(qwen_tokenizer, TURN_1, im_end)
    conv.add_assistant(ids, lps, TURN_1)
    before = (list(conv.token_ids), list(conv.messages))
    with pytest.raises(ValueError, match="renders nothing"):
        conv.add_messages([{"role": "observation", "content": "391"}])
    assert (conv.token_ids, conv.messages) == before
    with pytest.raises(ValueError, match="sanity_check"):
        Conversation(PROMPT, qwen_tokenizer, sanity_check="loose")  # type: ignore[arg-type]


def test_chat_mode_keeps_messages_only():
    conv = Conversation(PROMPT, None, tools=[CALC_TOOL])
    assert not conv.token_mode
    conv.add_assistant_text("Let me compute it.")
    conv.add_messages([TOOL_RESULT])
    conv.add_assistant_text("17 * 23 = 391", finish_reason="length")
    assert [m["role"] for m in conv.messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert conv.truncated
    assert conv.record_fields() == {}
    assert conv.check() is None
    with pytest.raises(RuntimeError, match="chat mode"):
        conv.generation_ids()
    with pytest.raises(RuntimeError, match="chat mode"):
        conv.add_assistant([1, 2], None, "x")
    assert asyncio.run(conv.acheck()) is None


def test_async_variants_match_the_sync_ones(qwen_tokenizer, im_end):
    sync, _ = three_turns(qwen_tokenizer, im_end, "ignore_strippable")

    async def build() -> tuple[Conversation, dict | None]:
        conv = await Conversation.acreate(PROMPT, qwen_tokenizer, sanity_check="ignore_strippable")
        for i, text in enumerate((TURN_1, TURN_2, TURN_3)):
            if i:
                await conv.aadd_messages([TOOL_RESULT if i == 1 else FOLLOW_UP])
            ids, lps = engine_output(qwen_tokenizer, text, im_end, base=-i)
            await conv.aadd_assistant(ids, lps, text, weight_version=f"w{min(i, 1)}")
        return conv, await conv.acheck()

    conv, report = asyncio.run(build())
    assert report is None
    assert conv.record_fields() == sync.record_fields()
    assert conv.messages == sync.messages


def test_load_tokenizer_is_cached_and_local_only(qwen_tokenizer_path, tmp_path):
    tok = load_tokenizer(qwen_tokenizer_path)
    assert load_tokenizer(qwen_tokenizer_path + os.sep) is tok
    assert renderer(tok, None, {}).frame.end_of_turn == {tok.convert_tokens_to_ids("<|im_end|>")}
    with pytest.raises(ValueError, match="Qwen/Qwen3-8B"):
        load_tokenizer("Qwen/Qwen3-8B")
    with pytest.raises(ValueError, match=str(tmp_path)):
        load_tokenizer(str(tmp_path))


def test_fast_encode_gives_the_tokenizers_ids(qwen_tokenizer):
    texts = [
        render(qwen_tokenizer, PROMPT, generation_prompt=True),
        "<think>\nI carry the one.\n</think>\n\n  The answer is \\boxed{\\frac{3}{4}}.<|im_end|>\n",
        "naïve café — 数学 🙂\n\n\n\t x",
        "cafe\u0301 \u212b A\u030a",  # the normalizer composes these
        "<tool_call>\n{\"name\": \"ls\", \"arguments\": {}}\n</tool_call><|im_end|>\n<|im_start|>user\n"
        + "".join(f"def handler_{i}(request, retries={i % 7}):\n    return dispatch(request, {i})\n"
                  for i in range(400)),
        "",
    ]
    encode = renderer(qwen_tokenizer, None, {}).encode
    for text in texts:
        assert encode(text) == qwen_tokenizer.encode(text, add_special_tokens=False)


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def test_strict_check_agrees_with_encoding_the_whole_render(qwen_tokenizer, im_end, monkeypatch):
    """The check reuses the prompt's ids up to its last `<|im_start|>` and encodes only the rest: its verdict
    and the position it reports are those of encoding the template's whole rendering, boundary merges too."""
    tok = qwen_tokenizer
    hello = tok.encode("Hello", add_special_tokens=False)
    split_hello = [i for part in ("Hel", "lo") for i in tok.encode(part, add_special_tokens=False)]
    assert split_hello != hello  # a non-canonical tokenization of the same text
    cases = {
        "canonical": ("<think>\nEasy.\n</think>\n\n17 * 23 = 391.", None),
        # The generation prompt ends with "\n"; the canonical encoding merges it with the reply's "\n\n".
        "merge at the prompt boundary": ("\n\n17 * 23 = 391.", None),
        "non-canonical ids": ("Hello there.", split_hello + tok.encode(" there.", add_special_tokens=False)),
    }
    conversations = {"three turns": three_turns(tok, im_end)[0]}
    for name, (text, ids) in cases.items():
        conv = Conversation(PROMPT, tok, tools=[CALC_TOOL])
        ids = (ids or tok.encode(text, add_special_tokens=False)) + [im_end]
        conv.add_assistant(ids, [0.0] * len(ids), text)
        conversations[name] = conv

    encoded: list[str] = []
    real_encode = Renderer.encode
    monkeypatch.setattr(Renderer, "encode", lambda self, text: encoded.append(text) or real_encode(self, text))
    verdicts = {}
    for name, conv in conversations.items():
        whole = tok.encode(render(tok, conv.messages, tools=conv.tools))
        encoded.clear()
        report = conv.check()
        verdicts[name] = report is None
        assert (report is None) == (conv.token_ids == whole), name
        if report is not None:
            assert report["position"] == _first_difference(conv.token_ids, whole), name
            assert report["expected_length"] == len(whole), name
        assert encoded and not any(PROMPT[1]["content"] in text for text in encoded), name
    assert verdicts == {"three turns": False, "canonical": True, "merge at the prompt boundary": False,
                        "non-canonical ids": False}


def test_mark_restore_and_fork_for_branches(qwen_tokenizer, im_end):
    conv = Conversation(PROMPT, qwen_tokenizer, tools=[CALC_TOOL])
    conv.add_assistant(*engine_output(qwen_tokenizer, TURN_1, im_end), TURN_1)
    after_first = conv.mark()
    snapshot = (list(conv.token_ids), list(conv.loss_mask), list(conv.messages))
    # A turn the client never received is undone exactly.
    conv.add_messages([TOOL_RESULT])
    conv.add_assistant(*engine_output(qwen_tokenizer, TURN_2, im_end, base=-1.0), TURN_2)
    with pytest.raises(RuntimeError, match="right after an assistant turn"):
        Conversation(PROMPT, qwen_tokenizer).mark()
    conv.restore(after_first)
    assert (conv.token_ids, conv.loss_mask, conv.messages) == snapshot
    # A fork keeps the parent's exact tokens as its prompt (loss 0) up to its own first turn; context messages
    # may include an assistant message the engine did not generate.
    conv.add_messages([TOOL_RESULT])
    conv.add_assistant(*engine_output(qwen_tokenizer, TURN_2, im_end), TURN_2)
    fork = conv.fork(after_first)
    foreign = {"role": "assistant", "content": "I was edited."}
    fork.add_context([{"role": "tool", "content": "392"}, foreign, FOLLOW_UP])
    ids, log_probs = engine_output(qwen_tokenizer, TURN_3, im_end, base=-2.0)
    fork.add_assistant(ids, log_probs, TURN_3)
    fields = fork.record_fields()
    prompt = len(fork.token_ids) - fields["response_length"]
    assert fork.token_ids[:after_first.tokens] == snapshot[0] and not any(fork.loss_mask[:prompt])
    assert fork.token_ids[prompt:prompt + len(ids)] == ids and fields["rollout_log_probs"][:len(ids)] == log_probs
    assert fork.messages[after_first.messages:] == [{"role": "tool", "content": "392"}, foreign, FOLLOW_UP,
                                                    {"role": "assistant", "content": TURN_3}]
    assert len(conv.messages) == 5 and conv.token_ids[:after_first.tokens] == snapshot[0], "the parent is untouched"
    with pytest.raises(ValueError, match="use add_assistant"):
        fork.add_messages([foreign])


def test_the_engine_payload_of_the_ids_is_their_json_as_the_conversation_grows_and_cuts_back(qwen_tokenizer,
                                                                                            im_end):
    """The ids sent to the engine are serialized once per token (a long session resends its whole context each
    turn); what is sent is always exactly the JSON of `generation_ids`, also after a turn is taken back or forked."""
    tok = qwen_tokenizer
    conv = Conversation(PROMPT, tok)

    def sent(c: Conversation, tail: list[int] | None = None) -> list[int]:
        prompt = c.engine_prompt()
        assert len(prompt) == c.generation_length() == len(c.generation_ids())
        body = request_body({"input_ids": prompt.payload(tail or []), "return_logprob": True})
        payload = orjson.loads(body if isinstance(body, bytes) else b"".join(body))["input_ids"]
        assert payload == [*c.generation_ids(), *(tail or [])]
        return payload

    sent(conv)
    ids, lps = engine_output(tok, TURN_1, im_end)
    sent(conv, ids[:3])  # an interrupted generation resumed with its output so far
    conv.add_assistant(ids, lps, TURN_1)
    mark = conv.mark()
    conv.add_messages([TOOL_RESULT])
    sent(conv)
    ids, lps = engine_output(tok, TURN_2, im_end)
    conv.add_assistant(ids, lps, TURN_2)
    sent(conv)
    conv.restore(mark)  # the second turn taken back
    conv.add_messages([FOLLOW_UP])
    sent(conv)
    fork = conv.fork(mark)
    fork.add_messages([TOOL_RESULT])
    sent(fork)
    sent(conv)
    for step in range(40):  # more turns than the pieces its ids are kept in before they are joined
        ids, lps = engine_output(tok, TURN_3, im_end)
        conv.add_assistant(ids, lps, TURN_3)
        conv.add_messages([{"role": "user", "content": f"Step {step}."}])
        sent(conv, ids[:2] if step % 7 == 0 else None)


def replayed(conv: Conversation, output: list[int], width: int = 4) -> ReplayParts:
    """What an engine answer asked for routed experts (from the rows `conv` holds) and top-p ids brings for a turn
    of `output` after `conv`'s generation prompt: row i is [i, i, ...], token t kept [t, t + 1]."""
    start, end = conv.routed_rows, conv.generation_length() + len(output) - 1
    kept = [[t, t + 1] for t in output]
    return ReplayParts(bytearray(np.repeat(np.arange(start, end), width).astype("<i4").tobytes()), end - start,
                       width, True, bytearray(np.asarray([i for k in kept for i in k], "<i4").tobytes()),
                       bytearray(np.cumsum([0, *map(len, kept)]).astype("<i4").tobytes()))


def test_replayed_rows_and_kept_ids_stay_aligned_with_the_tokens(qwen_tokenizer, im_end):
    """Routed-expert rows follow the positions (a turn's answer brings those before it, the closing after the last
    turn is asked apart), kept ids go to the engine's tokens only; a restore cuts both back, a fork copies what it
    shares, and a conversation rebuilt from its tail keeps the kept ids."""
    conv = Conversation(PROMPT, qwen_tokenizer)
    for text, then in ((TURN_1, [TOOL_RESULT]), (TURN_2, [FOLLOW_UP])):
        ids, lps = engine_output(qwen_tokenizer, text, im_end)
        conv.add_assistant(ids, lps, text, replay=replayed(conv, ids), resumed=1)
        conv.add_messages(then)
    ids, lps = engine_output(qwen_tokenizer, TURN_3, im_end)
    conv.add_assistant(ids, lps, TURN_3, replay=replayed(conv, ids))
    assert conv.routed_rows == len(conv.token_ids) - 2  # the closing "\n" after <|im_end|>: no turn answered it
    conv.extend_routed(ReplayParts(bytearray(np.repeat([conv.routed_rows], 4).astype("<i4").tobytes()), 1, 4))
    fields = conv.record_fields()
    rows = np.frombuffer(fields["rollout_routed_experts"], "<i4").reshape(-1, 4)
    assert rows.shape[0] == len(conv.token_ids) - 1 and rows[:, 0].tolist() == list(range(rows.shape[0]))
    offsets = np.frombuffer(fields["rollout_top_p_token_offsets"], "<i4").tolist()
    kept = np.frombuffer(fields["rollout_top_p_token_ids"], "<i4").tolist()
    assert len(offsets) == fields["response_length"] + 1
    for k in range(fields["response_length"]):
        position = conv.prompt_length + k
        want = [conv.token_ids[position], conv.token_ids[position] + 1] if conv.loss_mask[position] else []
        assert kept[offsets[k]:offsets[k + 1]] == want
    TrajectoryRecord.model_validate({"uid": "u", "instance_id": "i", "messages": conv.messages, "reward": 0.0,
                                     **fields})
    assert conv.assistant_turns == 3 and conv.abort_resumes == 2

    rebuilt = Conversation.restored(conv.tail(0, 0, 0), qwen_tokenizer)
    assert rebuilt.record_fields()["rollout_top_p_token_ids"] == fields["rollout_top_p_token_ids"]
    assert rebuilt.abort_resumes == 2 and rebuilt.routed_rows == 0  # rows are asked for again from 0
    fork = conv.fork(conv.mark())
    assert fork.routed_rows == len(conv.token_ids) - 1 and fork.top_p_offsets == conv.top_p_offsets
    fork.routed[:4] = b"\xff" * 4
    assert conv.routed[:4] != b"\xff" * 4  # its own copy
    conv_two = Conversation(PROMPT, qwen_tokenizer)
    ids, lps = engine_output(qwen_tokenizer, TURN_1, im_end)
    conv_two.add_assistant(ids, lps, TURN_1, replay=replayed(conv_two, ids))
    first = conv_two.mark()
    conv_two.add_messages([TOOL_RESULT])
    ids, lps = engine_output(qwen_tokenizer, TURN_2, im_end)
    conv_two.add_assistant(ids, lps, TURN_2, replay=replayed(conv_two, ids))
    conv_two.restore(first)
    assert conv_two.routed_rows <= first.tokens and len(conv_two.top_p_offsets) == first.tokens + 1


def test_a_trajectory_is_a_record_but_for_what_the_runner_fills_in(qwen_tokenizer, im_end):
    """`Trajectory` (what generators return) names every field of `TrajectoryRecord` and nothing else but chat mode's
    `tools`; a token-mode conversation's record fields are among its keys."""
    keys = set(typing.get_type_hints(Trajectory))
    assert keys - {"tools"} == set(TrajectoryRecord.model_fields)
    conv = Conversation(PROMPT, qwen_tokenizer)
    conv.add_assistant(*engine_output(qwen_tokenizer, TURN_1, im_end), TURN_1)
    assert set(conv.record_fields()) <= keys
