"""When the adapter starts the buffer's run, and with what payload (slime's flag names → slime's keys)."""

from __future__ import annotations

import argparse
from typing import Any

import pytest

from slime_adapter import add_arguments
from slime_adapter.flags import AdapterSettings
from slime_adapter.run_control import consumed_instance_ids, reason_to_start, start_payload, trainer_version


def args(**overrides: Any) -> argparse.Namespace:
    cli = ["--rollout-buffer-url", "http://buf:8889", "--rollout-task-type", "search"]
    cli += ["--rollout-num-process", "64"]
    ns = add_arguments(argparse.ArgumentParser()).parse_args(cli)
    slime = {"prompt_data": "/data/tasks.jsonl", "n_samples_per_prompt": 8, "num_epoch": None,
             "sglang_router_ip": "10.0.0.2", "sglang_router_port": 30000, "rollout_max_response_len": 4096,
             "rollout_temperature": 1.0, "rollout_top_p": None, "hf_checkpoint": "/models/qwen3"}
    for key, value in {**slime, **overrides}.items():
        setattr(ns, key, value)
    return ns


def test_payload_uses_slimes_keys_and_values() -> None:
    a = args()
    payload = start_payload(a, AdapterSettings.from_args(a), ["3"])
    assert payload == {
        "task_type": "search",
        "input_file": "/data/tasks.jsonl",
        "num_repeat_per_sample": 8,
        "num_epoch": 3,  # slime's original default when --num-epoch is unset
        "num_process": 64,
        "remote_engine_url": "http://10.0.0.2:30000",
        "remote_buffer_url": "http://buf:8889",
        "max_tokens": 4096,
        "sampling_params": {"max_tokens": 4096, "temperature": 1.0},  # unset top_p is left to the engine
        "tokenizer_path": "/models/qwen3",
        "skip_instance_ids": ["3"],
    }


def test_staleness_flags_and_the_trainers_version_go_into_the_payload() -> None:
    cli = ["--rollout-buffer-url", "http://buf:8889", "--rollout-max-staleness", "2", "--rollout-regenerate-stale",
           "--rollout-max-ready-groups", "64", "--mask-offpolicy-in-partial-rollout"]
    a = add_arguments(argparse.ArgumentParser()).parse_args(cli)
    for key, value in {"prompt_data": "/d.jsonl", "n_samples_per_prompt": 4, "rollout_batch_size": 8,
                       "update_weights_interval": 2, "sglang_router_ip": "h", "sglang_router_port": 1}.items():
        setattr(a, key, value)
    payload = start_payload(a, AdapterSettings.from_args(a), [], current_version=5)
    assert {k: payload[k] for k in ("max_staleness", "rollout_batch_size", "max_ready_groups", "regenerate_stale",
                                    "mask_offpolicy_in_partial_rollout", "current_version")} == {
        # rollout_batch_size: 8 groups × 2 steps per weight version
        "max_staleness": 2, "rollout_batch_size": 16, "max_ready_groups": 64, "regenerate_stale": True,
        "mask_offpolicy_in_partial_rollout": True, "current_version": 5}
    with pytest.raises(ValueError, match="--rollout-max-staleness"):
        AdapterSettings.from_args(add_arguments(argparse.ArgumentParser()).parse_args(
            ["--rollout-buffer-url", "http://b", "--rollout-max-staleness", "-1"]))


def test_slimes_replay_and_distillation_flags_ask_the_run_for_them() -> None:
    """--use-rollout-routing-replay asks for routed experts; on-policy distillation on SGLang (--use-opd
    --opd-type sglang) names its teacher by --rm-url, which slime posts the teacher's prefill to; top-p kept ids
    follow --rollout-top-p below 1, as slime asks them."""
    a = args(use_rollout_routing_replay=True, use_opd=True, opd_type="sglang", rm_url="http://teacher:30001/generate",
             rollout_top_p=0.9)
    payload = start_payload(a, AdapterSettings.from_args(a), [])
    assert (payload["return_routed_experts"], payload["teacher_engine_url"]) == (True, "http://teacher:30001")
    assert payload["sampling_params"]["top_p"] == 0.9 and "top_p_replay" not in payload
    plain = start_payload(args(use_opd=True, opd_type="megatron", rm_url="http://rm"), AdapterSettings.from_args(a),
                          [])
    assert not {"return_routed_experts", "teacher_engine_url"} & set(plain)


@pytest.mark.parametrize(("interval", "versions"), [(1, [0, 1, 2, 3, 4]), (2, [0, 1, 1, 2, 2])])
def test_trainer_version_is_the_weight_version_slime_pushed_when_it_asks(interval: int, versions: list[int]) -> None:
    # train_async.py: the initial push is version 1; rollout R is asked for while 1 + (R - 1) // k is on the engines.
    a = argparse.Namespace(update_weights_interval=interval)
    assert [trainer_version(a, r) for r in range(5)] == versions


def test_resumed_training_skips_one_group_per_consumed_id_like_slimes_client() -> None:
    # Instance 2 was trained on in two epochs: both of its groups are skipped, as slime's client asks.
    metadata = {"0": ["1", "2"], "1": [2, "3"], "note": "not a list"}
    assert consumed_instance_ids(metadata) == ["1", "2", "2", "3"]


TASKS = "/data/tasks.jsonl"
PAYLOAD = {"task_type": "search", "input_file": TASKS}


@pytest.mark.parametrize(
    ("state", "task_type", "input_file", "starts"),
    [
        (None, None, None, True),  # no run at all
        ("running", "search", TASKS, False),
        ("finished", "search", TASKS, False),
        ("running", None, None, False),  # fed through /buffer/write by generators slime does not drive
        ("failed", "search", TASKS, True),
        ("running", "math", TASKS, True),
        ("running", "search", "/data/other.jsonl", True),
    ],
)
def test_the_buffers_run_state_decides_whether_to_start(
    state: str | None, task_type: str | None, input_file: str | None, starts: bool
) -> None:
    run = {"run_id": "r", "state": state, "task_type": task_type, "input_file": input_file}
    assert (reason_to_start(None if state is None else run, PAYLOAD) is not None) == starts
