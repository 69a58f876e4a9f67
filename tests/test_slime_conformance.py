"""Conformance with slime's own code, run when `SLIME_SRC` points at a slime checkout (`.ci/run`: ../shared/slime).

- slime's agent client, `slime_plugins/rollout_buffer/rollout_buffer_example.generate_rollout`, unchanged,
  against a live `rollout-buffer serve` and a simulated engine over HTTP, with slime's own data buffer
  (`slime.rollout.data_source.RolloutDataSourceWithBuffer`, the default of `--data-source-path`): two
  rollouts, a restart of the trainer side (the client module imported afresh, the data buffer rebuilt and
  loaded from its own checkpoint), two more; the resumed run skips exactly the instance ids slime stored. The
  engine generates only while the run gains each batch (held in place otherwise): the client takes whatever is
  ready at its polls, and what it takes must not depend on the machine's speed.
- slime's `MultiTurnLossMaskGenerator` against the adapter's `LossMaskGenerator` (qwen, qwen3, distill_qwen,
  real Qwen3 tokenizer) on the conversations below and on chat-mode tool-call records of a live run.

slime's sources import with torch (CPU) and Pillow installed (the `conformance` extra); `wandb` is replaced by a
bare module when it is not installed. Everything slime adds to `sys.path` / `sys.modules` is removed again after
this module (slime_src.py).
"""

from __future__ import annotations

import importlib
import json
import sys
import threading
import time
import types
from argparse import Namespace
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from runs import drain, wait_finished
from servers import free_port, running, sim_engine
from slime_src import needs_slime_src, require, slime_on_path

from slime_adapter.loss_mask import LossMaskGenerator

pytestmark = needs_slime_src

CLIENT = "slime_plugins.rollout_buffer.rollout_buffer_example"
N_SAMPLES, NUM_EPOCH, INSTANCES, BATCH = 2, 2, 8, 2


@pytest.fixture(scope="module")
def slime() -> Iterator[types.SimpleNamespace]:
    """slime's modules, imported from SLIME_SRC; slime leaves sys.path and sys.modules afterwards."""
    require("PIL")  # slime's data source imports Pillow
    with slime_on_path():
        data_source = importlib.import_module("slime.rollout.data_source")
        mask_utils = importlib.import_module("slime.utils.mask_utils")
        slime_types = importlib.import_module("slime.utils.types")
        yield types.SimpleNamespace(DataSource=data_source.RolloutDataSourceWithBuffer,
                                    MaskGenerator=mask_utils.MultiTurnLossMaskGenerator,
                                    Sample=slime_types.Sample)


@pytest.fixture
def slime_eval() -> Iterator[types.SimpleNamespace]:
    """slime's eval path (`call_rollout_fn`, `log_eval_rollout_data`, its eval dataset configs, `Sample`)."""
    with slime_on_path():
        base_types = importlib.import_module("slime.rollout.base_types")
        yield types.SimpleNamespace(
            call_rollout_fn=base_types.call_rollout_fn, RolloutFnEvalOutput=base_types.RolloutFnEvalOutput,
            log_eval_rollout_data=importlib.import_module("slime.observability.rollout_metrics").log_eval_rollout_data,
            build_eval_dataset_configs=importlib.import_module("slime.utils.eval_config").build_eval_dataset_configs,
            Sample=importlib.import_module("slime.utils.types").Sample,
        )


def fresh_client() -> types.ModuleType:
    """slime's client module imported anew: its globals (`START_ROLLOUT`) as a restarted trainer has them."""
    sys.modules.pop(CLIENT, None)
    return importlib.import_module(CLIENT)


# ------------------------------------------------------------------ slime's client against the buffer


def slime_args(tmp_path: Path, data: Path, buffer_url: str, engine_url: str, tokenizer: str) -> Namespace:
    """The slime arguments the client and the data buffer read."""
    host, port = engine_url.removeprefix("http://").split(":")
    return Namespace(
        # rollout_buffer_example.py
        rollout_buffer_url=buffer_url, sglang_router_ip=host, sglang_router_port=int(port),
        rollout_task_type="math", prompt_data=str(data), n_samples_per_prompt=N_SAMPLES, num_epoch=NUM_EPOCH,
        rollout_num_process=4, rollout_max_response_len=256, rollout_temperature=1.0, rollout_top_p=1.0,
        hf_checkpoint=tokenizer, rollout_batch_size=BATCH, fetch_trajectory_retry_times=3,
        loss_mask_type="qwen3", use_wandb=False,
        # slime.rollout.data_source, with its checkpoint (`save` / `load`) in tmp_path
        rollout_global_dataset=True, dump_details=None, rollout_max_prompt_len=None, input_key="prompt",
        multimodal_keys=None, label_key="label", metadata_key="metadata", tool_key=None,
        apply_chat_template=False, apply_chat_template_kwargs=None, rollout_seed=42, rollout_shuffle=False,
        buffer_filter_path=None, save=str(tmp_path / "ckpt"), load=str(tmp_path / "ckpt"),
    )


def groups_of(url: str, run_id: str) -> list[dict[str, Any]]:
    return httpx.get(f"{url}/groups", params={"run_id": run_id, "limit": 1000}, timeout=10).json()["groups"]


def check_batch(slime: types.SimpleNamespace, batch: list[list[Any]]) -> list[str]:
    """A batch as slime's trainer gets it: `BATCH` groups of `N_SAMPLES` samples of one instance each."""
    assert len(batch) == BATCH
    for group in batch:
        assert len(group) == N_SAMPLES and len({s.index for s in group}) == 1
        for sample in group:
            assert isinstance(sample, slime.Sample)
            assert sample.status == slime.Sample.Status.COMPLETED
            assert len(sample.loss_mask) == sample.response_length > 0 and len(sample.tokens) > sample.response_length
            assert isinstance(sample.reward, float) and "finish_reason" in sample.metadata
    return [str(group[0].index) for group in batch]


def deliverable(url: str, run_id: str) -> int:
    """How many of the run's groups are ready for, or were handed to, a trainer."""
    return sum(g["state"] in ("ready", "leased", "delivered") for g in groups_of(url, run_id))


def current_run(url: str, other_than: str | None = None, timeout_s: float = 60) -> str:
    """The id of the buffer's run, once it is not `other_than`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = httpx.get(f"{url}/status", timeout=10).json()["run"]
        if run and run["run_id"] != other_than:
            return str(run["run_id"])
        time.sleep(0.05)
    raise TimeoutError(f"no run other than {other_than}")


def gated_rollout(slime: types.SimpleNamespace, rollout: Callable[[], list[list[Any]]], engine_url: str,
                  buffer_url: str, run_id: str | None = None) -> list[str]:
    """One of slime's rollouts, with the engine held (`/pause_generation` in place) except while the run gains
    `BATCH` deliverable groups. slime's client takes every group ready at its poll and drops what it does not
    need, so how many it takes must not depend on how fast the machine generates between its polls.
    `run_id`: the run to watch; None for the run this rollout starts (the one after the buffer's current run)."""
    result: list[list[list[Any]]] = []
    thread = threading.Thread(target=lambda: result.append(rollout()), daemon=True)
    before = httpx.get(f"{buffer_url}/status", timeout=10).json()["run"]
    thread.start()
    if run_id is None:
        run_id = current_run(buffer_url, other_than=before and before["run_id"])
    target = deliverable(buffer_url, run_id) + BATCH
    httpx.post(f"{engine_url}/continue_generation", timeout=10).raise_for_status()
    deadline = time.monotonic() + 120
    while deliverable(buffer_url, run_id) < target and time.monotonic() < deadline:
        time.sleep(0.05)
    httpx.post(f"{engine_url}/pause_generation", json={"mode": "in_place"}, timeout=10).raise_for_status()
    thread.join(120)
    assert result, f"slime's rollout did not return with {deliverable(buffer_url, run_id)} groups deliverable"
    return check_batch(slime, result[0])


def test_slimes_client_runs_unchanged_and_a_restarted_trainer_skips_the_finished_ids(
    slime: types.SimpleNamespace, tmp_path: Path, qwen_tokenizer_path: str
) -> None:
    data = tmp_path / "math.jsonl"
    data.write_text("".join(json.dumps({"instance_id": i, "prompt": f"What is {i} + {i + 5}? Box it.",
                                        "label": str(2 * i + 5)}) + "\n" for i in range(INSTANCES)))
    port = free_port()
    with sim_engine(tmp_path, qwen_tokenizer_path, "--latency-ms", "1000", "--correct-rate", "0.5") as engine, \
            running(["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")], "/healthz", port,
                    tmp_path / "buffer.log") as buffer:
        httpx.post(f"{engine.url}/pause_generation", json={"mode": "in_place"}, timeout=10).raise_for_status()
        args = slime_args(tmp_path, data, buffer.url, engine.url, qwen_tokenizer_path)
        client, data_buffer = fresh_client(), slime.DataSource(args)
        delivered = gated_rollout(slime, lambda: client.generate_rollout(args, 0, data_buffer), engine.url,
                                  buffer.url)
        data_buffer.save(0)
        first_run = current_run(buffer.url)
        delivered += gated_rollout(slime, lambda: client.generate_rollout(args, 1, data_buffer), engine.url,
                                   buffer.url, first_run)
        data_buffer.save(1)
        stored = data_buffer.get_metadata()

        # The trainer restarts: slime's client starts afresh and its data buffer comes back from the checkpoint.
        client, data_buffer = fresh_client(), slime.DataSource(args)
        data_buffer.load(1)
        assert data_buffer.get_metadata() == stored
        gated_rollout(slime, lambda: client.generate_rollout(args, 2, data_buffer), engine.url, buffer.url)
        new_run = current_run(buffer.url)
        gated_rollout(slime, lambda: client.generate_rollout(args, 3, data_buffer), engine.url, buffer.url,
                      new_run)
        httpx.post(f"{engine.url}/continue_generation", timeout=10).raise_for_status()
        status = wait_finished(buffer.url, timeout_s=120)
        old_groups, new_groups = groups_of(buffer.url, first_run), groups_of(buffer.url, status["run"]["run_id"])

    # slime stored, per rollout, the instance ids of the groups finished since its last read (strings, one per
    # group): every group it trained on is among them, and each one is a group the first run completed.
    assert set(stored) == {"0", "1"} and all(isinstance(i, str) for ids in stored.values() for i in ids)
    finished = Counter(i for ids in stored.values() for i in ids)
    assert not Counter(delivered) - finished
    assert not finished - Counter(g["instance_id"] for g in old_groups if g["state"] in ("ready", "delivered"))
    total = INSTANCES * NUM_EPOCH
    assert 0 < finished.total() < total, "the restart must come while the first run still has work"
    # The restarted client sent them as skip_instance_ids: the new run skipped exactly one group per id (the
    # earliest epochs of each instance, as slime's generator does) and generated every other group.
    run = status["run"]
    assert run["state"] == "finished" and run["run_id"] != first_run
    assert Counter(run["config"]["skip_instance_ids"]) == finished
    assert run["progress"]["skipped"] == N_SAMPLES * finished.total()
    expected = {(str(i), e) for i in range(INSTANCES) for e in range(NUM_EPOCH) if e >= finished[str(i)]}
    assert {(g["instance_id"], g["epoch"]) for g in new_groups} == expected
    assert len(new_groups) == total - finished.total()


# ------------------------------------------------------------------ slime's eval path on the adapter's eval output


def test_slimes_eval_path_takes_and_logs_the_adapters_eval_output(
    slime_eval: types.SimpleNamespace, tmp_path: Path, qwen_tokenizer_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """slime's `call_rollout_fn(..., evaluation=True)` and `log_eval_rollout_data` (its `--eval-interval` path)
    on `generate_rollout(evaluation=True)`, with eval datasets resolved by slime's own `build_eval_dataset_configs`
    from `--eval-prompt-data`-style pairs and the eval flags."""
    import slime_adapter.records as records
    import slime_adapter.sample as sample_module
    from slime_adapter import generate_rollout

    # A trainer process imports the adapter with slime importable: its samples are slime's class.
    slime = slime_eval
    for module in (sample_module, records):
        monkeypatch.setattr(module, "Sample", slime.Sample)
    sample_module.sample_fields.cache_clear()
    sample_module.status_member.cache_clear()
    data = tmp_path / "eval.jsonl"
    data.write_text("".join(json.dumps({"instance_id": i, "prompt": f"What is {i} + 4?", "label": str(i + 4)})
                            + "\n" for i in range(3)))
    port = free_port()
    try:
        with sim_engine(tmp_path, qwen_tokenizer_path, "--latency-ms", "10", "--correct-rate", "0.5") as engine, \
                running(["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")], "/healthz", port,
                        tmp_path / "buffer.log") as buffer:
            host, engine_port = engine.url.removeprefix("http://").split(":")
            args = Namespace(
                agent_rollout_buffer_url=buffer.url, rollout_task_type="math", loss_mask_type="qwen3",
                hf_checkpoint=qwen_tokenizer_path, sglang_router_ip=host, sglang_router_port=int(engine_port),
                n_samples_per_prompt=4, n_samples_per_eval_prompt=4, eval_temperature=0.7, eval_top_p=None,
                eval_top_k=None, rollout_temperature=1.0, rollout_top_p=1.0, rollout_top_k=-1,
                eval_max_response_len=48, rollout_max_response_len=256, eval_min_new_tokens=None,
                rollout_stop=None, rollout_stop_token_ids=None, update_weights_interval=1,
                # slime.observability: what log_eval_rollout_data and its sample metrics read
                custom_eval_rollout_log_function_path=None, log_passrate=True, advantage_estimator="grpo",
                log_reward_category=None, use_wandb=False, use_tensorboard=False, rollout_batch_size=2,
                global_batch_size=8, wandb_always_use_train_step=False, reward_key=None, eval_reward_key=None,
            )
            args.eval_datasets = slime.build_eval_dataset_configs(args, [{"name": "sums", "path": str(data)}], {})
            result = slime.call_rollout_fn(generate_rollout, args, 2, None, evaluation=True)
            assert isinstance(result, slime.RolloutFnEvalOutput)
            logged = slime.log_eval_rollout_data(2, args, result.data, result.metrics)
    finally:
        sample_module.sample_fields.cache_clear()
        sample_module.status_member.cache_clear()
    rewards = result.data["sums"]["rewards"]
    assert len(rewards) == len(result.data["sums"]["samples"]) == 12
    assert all(isinstance(s, slime.Sample) for s in result.data["sums"]["samples"])
    # slime's own estimator (--log-passrate, pass@1/2/4) agrees with the buffer's.
    for k in (1, 2, 4):
        assert logged[f"eval/sums-pass@{k}"] == pytest.approx(logged[f"eval/sums/pass@{k}"])
    assert logged["eval/sums"] == pytest.approx(logged["eval/sums/mean_reward"])
    assert logged["eval/sums-truncated_ratio"] == pytest.approx(logged["eval/sums/truncation_rate"])
    assert {"eval/sums/pass@3", "eval/sums/mean_response_length", "eval/sums/response_len/mean"} <= set(logged)


# ------------------------------------------------------------------ loss masks: slime's class against the adapter's


TOOL = {"type": "function", "function": {
    "name": "calculator", "description": "Evaluate an arithmetic expression.",
    "parameters": {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web.",
    "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}}


def call(name: str, arguments: dict[str, Any], k: int, as_string: bool = True) -> dict[str, Any]:
    args: Any = json.dumps(arguments, ensure_ascii=False) if as_string else arguments
    return {"id": f"call_{k}", "type": "function", "function": {"name": name, "arguments": args}}


def hermes(name: str, arguments: dict[str, Any]) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"


def conversations() -> list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]]:
    """(name, messages, tools): plain, reasoning, empty and unicode turns; hermes and structured tool calls,
    single, parallel and consecutive; separated reasoning; masked steps."""
    sys_msg = {"role": "system", "content": "You are a careful assistant."}
    user = {"role": "user", "content": "What is 17 * 23?"}
    think = "<think>\nI should multiply.\n</think>\n\n"
    out: list[tuple[str, list[dict[str, Any]], list[dict[str, Any]] | None]] = []
    for flavour, answer in (("plain", "391"), ("reasoning", think + "17 * 23 = 391."), ("empty", ""),
                            ("empty_think", "<think>\n\n</think>\n\n391"),
                            ("unicode", "答案是 391 ✓ — naïve façade 🚀 مرحبا")):
        out.append((f"single_{flavour}", [user, {"role": "assistant", "content": answer}], None))
        out.append((f"system_{flavour}", [sys_msg, user, {"role": "assistant", "content": answer}], None))
        out.append((f"follow_up_{flavour}", [user, {"role": "assistant", "content": answer},
                                             {"role": "user", "content": "And plus 9?"},
                                             {"role": "assistant", "content": think + "400"}], None))
    unicode_user = {"role": "user", "content": "计算 2×3，然后 🚀 再 ÷ 2 ?"}
    out.append(("unicode_user", [sys_msg, unicode_user, {"role": "assistant", "content": "答案：3"}], None))
    out.append(("separated_reasoning", [user, {"role": "assistant", "content": "391",
                                               "reasoning_content": "Multiply 17 by 23."}], None))
    out.append(("step_loss_mask", [user, {"role": "assistant", "content": "draft", "step_loss_mask": 0},
                                   {"role": "user", "content": "Again."},
                                   {"role": "assistant", "content": "391"}], None))

    expr = {"expression": "17 * 23"}
    final = {"role": "assistant", "content": "<think>\nThe tool says 391.\n</think>\n\nThe answer is 391."}
    for as_string in (True, False):
        kind = "string" if as_string else "object"
        out.append((f"structured_call_{kind}", [sys_msg, user, {
            "role": "assistant", "content": "", "tool_calls": [call("calculator", expr, 0, as_string)]},
            {"role": "tool", "tool_call_id": "call_0", "name": "calculator", "content": "391"}, final], [TOOL]))
        out.append((f"structured_parallel_{kind}", [user, {
            "role": "assistant", "content": think.rstrip("\n"),
            "tool_calls": [call("calculator", expr, 0, as_string), call("search", {"query": "17×23"}, 1, as_string)]},
            {"role": "tool", "tool_call_id": "call_0", "content": "391"},
            {"role": "tool", "tool_call_id": "call_1", "content": "Résultat : 391 ✓"}, final], [TOOL, SEARCH]))
    out.append(("hermes_call", [user, {"role": "assistant", "content": think + hermes("calculator", expr)},
                                {"role": "tool", "content": "391"}, final], [TOOL]))
    out.append(("hermes_parallel_three", [sys_msg, user, {
        "role": "assistant", "content": "Three at once.\n" + "\n".join(
            hermes("calculator", {"expression": e}) for e in ("1 + 1", "2 * 3", "10 / 4"))},
        {"role": "tool", "content": "2"}, {"role": "tool", "content": "6"}, {"role": "tool", "content": "2.5"},
        final], [TOOL]))
    out.append(("consecutive_calls", [sys_msg, user,
                                      {"role": "assistant", "content": "", "tool_calls": [call("calculator", expr, 0)]},
                                      {"role": "tool", "tool_call_id": "call_0", "content": "391"},
                                      {"role": "assistant", "content": think.rstrip("\n"),
                                       "tool_calls": [call("calculator", {"expression": "391 + 9"}, 1)]},
                                      {"role": "tool", "tool_call_id": "call_1", "content": "400"}, final], [TOOL]))
    out.append(("parallel_then_user", [user, {"role": "assistant", "content": "",
                                              "tool_calls": [call("calculator", expr, 0), call("calculator", expr, 1)]},
                                       {"role": "tool", "content": "391"}, {"role": "tool", "content": "391"},
                                       {"role": "user", "content": "Both agree?"},
                                       {"role": "assistant", "content": "Yes."}], [TOOL]))
    out.append(("ends_on_tools", [user, {"role": "assistant", "content": hermes("calculator", expr)},
                                  {"role": "tool", "content": "391"}, {"role": "tool", "content": "多 行\n结果"}],
                [TOOL]))
    out.append(("structured_unicode_arguments", [user, {
        "role": "assistant", "content": "", "tool_calls": [call("search", {"query": "北京 天气 ☀ «quote»"}, 0)]},
        {"role": "tool", "tool_call_id": "call_0", "content": "晴，25°C"}, final], [SEARCH]))
    out.append(("empty_tool_response", [user, {"role": "assistant", "content": hermes("calculator", expr)},
                                        {"role": "tool", "content": ""}, final], [TOOL]))
    out.append(("long_multiline", [sys_msg, {"role": "user", "content": "Write code.\n\n```py\nx = 1\n```"},
                                   {"role": "assistant", "content": think + "```python\n" + "\n".join(
                                       f"print({k})  # line {k}" for k in range(40)) + "\n```\n\nDone."}], None))
    out.append(("system_in_the_middle", [user, {"role": "assistant", "content": "391"},
                                         {"role": "system", "content": "Be brief."},
                                         {"role": "user", "content": "Again?"},
                                         {"role": "assistant", "content": "391"}], None))
    out.append(("whitespace_edges", [{"role": "user", "content": "  spaced  \n"},
                                     {"role": "assistant", "content": "\n\n  answer with edges \n"}], None))
    out.append(("tool_response_user", [user, {"role": "assistant", "content": "Let me see."},
                                       {"role": "user", "content": "<tool_response>\n391\n</tool_response>"},
                                       {"role": "assistant", "content": "391"}], None))
    return out


CONVERSATIONS = conversations()


@pytest.fixture(scope="module")
def mask_generators(slime: types.SimpleNamespace, qwen_tokenizer: Any) -> dict[str, tuple[Any, Any]]:
    return {t: (slime.MaskGenerator(qwen_tokenizer, tokenizer_type=t), LossMaskGenerator(qwen_tokenizer, t))
            for t in ("qwen", "qwen3", "distill_qwen")}


def test_the_corpus_is_large_enough() -> None:
    assert len(CONVERSATIONS) >= 30 and len({name for name, _, _ in CONVERSATIONS}) == len(CONVERSATIONS)


@pytest.mark.parametrize("mask_type", ["qwen", "qwen3", "distill_qwen"])
@pytest.mark.parametrize(("name", "messages", "tools"), CONVERSATIONS, ids=[c[0] for c in CONVERSATIONS])
def test_loss_masks_equal_slimes(mask_generators: dict[str, tuple[Any, Any]], mask_type: str, name: str,
                                 messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> None:
    theirs, ours = mask_generators[mask_type]
    expected = theirs.get_loss_mask(json.loads(json.dumps(messages)), tools=tools)
    assert ours.get_loss_mask(messages, tools=tools) == tuple(expected)


def test_chat_mode_tool_call_records_mask_as_slime_masks_them(
    mask_generators: dict[str, tuple[Any, Any]], tmp_path: Path, qwen_tokenizer_path: str
) -> None:
    rows = [{"instance_id": f"p{i}", "prompt": f"Compute {a} * {b} and {a} + {b} with the calculator.",
             "label": str(a + b)} for i, (a, b) in enumerate(((17, 23), (120, 7), (9, 99)))]
    data = tmp_path / "calls.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    port = free_port()
    with sim_engine(tmp_path, qwen_tokenizer_path, "--tool-call-parser", "qwen") as engine, \
            running(["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")], "/healthz", port,
                    tmp_path / "buffer.log") as buffer:
        start = {"task_type": "tool_call", "input_file": str(data), "num_repeat_per_sample": 2,
                 "remote_engine_url": engine.url, "max_tokens": 1024, "max_parallel_calls": 2}
        httpx.post(f"{buffer.url}/start_rollout", json=start, timeout=30).raise_for_status()
        wait_finished(buffer.url, timeout_s=60)
        records = drain(buffer.url)
    assert len(records) == 6
    for record in records:
        assert [m["role"] for m in record["messages"]] == ["user", "assistant", "tool", "tool", "assistant"]
        assert len(record["messages"][1]["tool_calls"]) == 2
        for mask_type, (theirs, ours) in mask_generators.items():
            expected = theirs.get_loss_mask(record["messages"], tools=record["tools"])
            assert ours.get_loss_mask(record["messages"], tools=record["tools"]) == tuple(expected), mask_type
