"""Trajectory records become slime Samples: exact tokens as they are, messages through the mask generator."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from slime_adapter.loss_mask import LossMaskGenerator
from slime_adapter.records import RecordError, SampleBuilder, sample_index
from slime_adapter.sample import Sample

MESSAGES = [
    {"role": "user", "content": "What is 2+2?"},
    {"role": "assistant", "content": "<think>\nsmall sum\n</think>\n\n4"},
]


def builder(tokenizer: Any, mask_type: str = "qwen3") -> SampleBuilder:
    return SampleBuilder(lambda: tokenizer, mask_type)


def token_record(tokenizer: Any, **overrides: Any) -> dict[str, Any]:
    prompt = tokenizer("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    # "hello" as "hel" + "lo": ids the engine may sample but re-tokenizing the text would never give.
    response = tokenizer.convert_tokens_to_ids(["<think>", "Ċ", "</think>", "ĊĊ", "hel", "lo", "<|im_end|>"])
    record = {
        "uid": "run:7:0:1",
        "instance_id": "7",
        "messages": MESSAGES,
        "reward": 0.5,
        "raw_reward": 1.0,
        "extra_info": {"finish_reason": "stop", "epoch": 0, "agent_id": "solver"},
        "status": "completed",
        "tokens": prompt + response,
        "loss_mask": [0] * len(prompt) + [1] * len(response),
        "rollout_log_probs": [-0.25] * len(response),
        "response_length": len(response),
        "weight_versions": ["3", "4"],
    }
    return record | overrides


def test_exact_token_record_is_used_as_is(qwen_tokenizer: Any) -> None:
    rec = token_record(qwen_tokenizer)
    response = rec["tokens"][-7:]
    assert qwen_tokenizer(qwen_tokenizer.decode(response), add_special_tokens=False)["input_ids"] != response
    sample = builder(qwen_tokenizer).build(rec)
    assert isinstance(sample, Sample)
    assert sample.tokens == rec["tokens"]
    assert sample.response_length == rec["response_length"] == 7
    assert sample.loss_mask == [1] * 7
    assert sample.rollout_log_probs == [-0.25] * 7
    assert sample.weight_versions == ["3", "4"]
    assert sample.index == 7 and sample.prompt == "run:7:0:1"
    assert sample.reward == 0.5
    # `rollout_id`: the trajectory's (the record's own uid when it names none), numbered for slime by `take_batch`.
    assert sample.metadata == {"finish_reason": "stop", "epoch": 0, "agent_id": "solver", "raw_reward": 1.0,
                               "rollout_id": "run:7:0:1"}
    assert sample.status == Sample.Status.COMPLETED


def test_response_mask_keeps_tool_tokens_out_of_the_loss(qwen_tokenizer: Any) -> None:
    # A multi-turn response: model tokens, a 3-token tool observation (loss 0), model tokens again.
    rec = token_record(qwen_tokenizer)
    tokens = rec["tokens"] + [100, 101, 102, 200, 201]
    mask = rec["loss_mask"] + [0, 0, 0, 1, 1]
    rec |= {"tokens": tokens, "loss_mask": mask, "response_length": 12, "rollout_log_probs": [-0.1] * 12}
    sample = builder(qwen_tokenizer).build(rec)
    assert sample.loss_mask == [1] * 7 + [0, 0, 0, 1, 1]
    assert len(sample.tokens) - sample.response_length == len(tokens) - 12


def test_response_length_derived_from_full_mask_or_given_alone(qwen_tokenizer: Any) -> None:
    rec = token_record(qwen_tokenizer, response_length=None, rollout_log_probs=None)
    sample = builder(qwen_tokenizer).build(rec)
    assert sample.response_length == 7 and sample.loss_mask == [1] * 7
    tail_only = token_record(qwen_tokenizer, loss_mask=[1, 1, 1, 1, 0, 1, 1])
    assert builder(qwen_tokenizer).build(tail_only).loss_mask == [1, 1, 1, 1, 0, 1, 1]
    no_mask = token_record(qwen_tokenizer, loss_mask=None)
    assert builder(qwen_tokenizer).build(no_mask).loss_mask == [1] * 7


def test_messages_only_record_goes_through_the_mask_generator(qwen_tokenizer: Any) -> None:
    rec = {"uid": "u1", "instance_id": "math-3", "messages": MESSAGES, "reward": 1.0, "extra_info": {}}
    sample = builder(qwen_tokenizer, "qwen3").build(rec)
    ids, mask = LossMaskGenerator(qwen_tokenizer, "qwen3").get_loss_mask(MESSAGES)
    first = mask.index(1)
    assert sample.tokens == ids
    assert sample.response_length == len(ids) - first
    assert sample.loss_mask == mask[first:]
    assert qwen_tokenizer.decode(sample.tokens[-sample.response_length :]) == (
        "<think>\nsmall sum\n</think>\n\n4<|im_end|>\n"
    )
    assert sample.index == "math-3"  # not numeric: kept as the string
    assert sample.metadata == {"raw_reward": 1.0, "rollout_id": "u1"}  # raw_reward defaults to the reward
    assert sample.response == MESSAGES[-1]["content"]


def test_token_records_never_load_a_tokenizer(qwen_tokenizer: Any) -> None:
    def no_tokenizer() -> Any:
        raise AssertionError("exact-token records must not need a tokenizer")

    assert SampleBuilder(no_tokenizer, "qwen3").build(token_record(qwen_tokenizer)).response_length == 7


@pytest.mark.parametrize(
    ("status", "finish_reason", "expected"),
    [
        ("completed", "length", "TRUNCATED"),
        ("truncated", "stop", "TRUNCATED"),
        ("aborted", "abort", "ABORTED"),
        ("failed", None, "FAILED"),
        ("completed", "stop", "COMPLETED"),
    ],
)
def test_status_mapping(qwen_tokenizer: Any, status: str, finish_reason: str | None, expected: str) -> None:
    rec = token_record(qwen_tokenizer, status=status, extra_info={"finish_reason": finish_reason})
    assert builder(qwen_tokenizer).build(rec).status == Sample.Status[expected]


def test_bad_token_records_name_their_uid(qwen_tokenizer: Any) -> None:
    with pytest.raises(RecordError, match="run:7:0:1"):
        builder(qwen_tokenizer).build(token_record(qwen_tokenizer, loss_mask=None, response_length=None))
    with pytest.raises(RecordError, match="rollout_log_probs"):
        builder(qwen_tokenizer).build(token_record(qwen_tokenizer, rollout_log_probs=[-1.0]))


def test_numeric_instance_ids_become_ints() -> None:
    assert sample_index("0042") == 42 and sample_index(5) == 5 and sample_index("q-1") == "q-1"


def test_engine_log_probs_are_dropped_when_the_record_is_retokenized(qwen_tokenizer: Any) -> None:
    rec = {"uid": "u2", "instance_id": "1", "messages": MESSAGES, "reward": 0.0, "extra_info": {},
           "rollout_log_probs": [-0.1, -0.2]}
    assert builder(qwen_tokenizer).build(rec).rollout_log_probs is None


@pytest.mark.parametrize(
    ("messages", "reason"),
    [
        ([{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}], r"messages\[1\] has role 'robot'"),
        ([{"role": "user", "content": "hi"}, {"role": "tool", "content": "391"}],
         r"messages\[1\] is a tool message without a tool call"),
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "no call here"},
          {"role": "tool", "content": "391"}], r"messages\[2\] is a tool message without a tool call"),
        ([], "non-empty list"),
        # Qwen3's template cannot render an assistant message whose content is not text.
        ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "cannot render it"),
    ],
)
def test_unrenderable_messages_fail_the_record_by_uid(qwen_tokenizer: Any, messages: list, reason: str) -> None:
    rec = {"uid": "run:9:0:3", "instance_id": "9", "messages": messages, "reward": 0.0, "extra_info": {}}
    with pytest.raises(RecordError, match=rf"record run:9:0:3: .*{reason}"):
        builder(qwen_tokenizer).build(rec)


def test_tool_messages_answering_hermes_or_structured_calls_render(qwen_tokenizer: Any) -> None:
    structured = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_0", "type": "function", "function": {"name": "calc", "arguments": '{"x": 1}'}}]}
    hermes = {"role": "assistant", "content": '<tool_call>\n{"name": "calc", "arguments": {"x": 1}}\n</tool_call>'}
    for call_turn in (structured, hermes):
        messages = [{"role": "user", "content": "hi"}, call_turn, {"role": "tool", "content": "1"},
                    {"role": "tool", "content": "2"}, {"role": "assistant", "content": "3"}]
        rec = {"uid": "u", "instance_id": "1", "messages": messages, "reward": 0.0, "extra_info": {}}
        assert builder(qwen_tokenizer).build(rec).response_length > 0


def b64(values: list[int]) -> str:
    return base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode()


def test_replayed_side_data_becomes_slimes_sample_fields(qwen_tokenizer: Any) -> None:
    rec = token_record(qwen_tokenizer)
    rows, response = len(rec["tokens"]) - 1, rec["response_length"]
    rec |= {"rollout_routed_experts": b64(list(range(rows * 6))), "teacher_log_probs": [-1.0] * response,
            "rollout_top_p_token_ids": b64(list(range(response))), "rollout_top_p_token_offsets": b64(
                list(range(response + 1))), "rollout_id": "run:7:0"}
    sample = SampleBuilder(lambda: qwen_tokenizer, "qwen3", moe_shape=(3, 2)).build(rec)
    assert sample.rollout_routed_experts.shape == (rows, 3, 2) and sample.rollout_routed_experts.flags.writeable
    assert sample.rollout_top_p_token_offsets.tolist() == list(range(response + 1))
    assert sample.teacher_log_probs == [-1.0] * response and sample.metadata["rollout_id"] == "run:7:0"
    for bad, reason in (({"rollout_routed_experts": b64(list(range(rows * 5)))}, "rollout_routed_experts"),
                        ({"rollout_routed_experts": "???"}, "not base64"),
                        ({"rollout_top_p_token_offsets": b64([0, 1])}, "rollout_top_p_token_offsets"),
                        ({"teacher_log_probs": [-1.0]}, "teacher_log_probs")):
        with pytest.raises(RecordError, match=reason):
            SampleBuilder(lambda: qwen_tokenizer, "qwen3", moe_shape=(3, 2)).build({**rec, **bad})
