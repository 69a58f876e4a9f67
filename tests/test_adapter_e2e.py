"""`generate_rollout` against a live `rollout-buffer serve` subprocess on 127.0.0.1.

Trajectories are written by the tests themselves through `POST /buffer/write`, with exact tokens from the
real Qwen3 tokenizer. Runs the adapter starts use a slime-style generator that produces nothing itself:
it keeps its run open (so written records join it) until the test stops the server.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
from servers import Server, free_port, running

import slime_adapter.rollout as rollout_module
from slime_adapter import add_arguments, generate_rollout
from slime_adapter.client import RolloutBufferError, RolloutBufferUnavailable
from slime_adapter.data_buffer import DataBuffer
from slime_adapter.loss_mask import LossMaskGenerator
from slime_adapter.rollout import held_irregular_groups

GENERATORS = {
    "external_writes.py": '''
"""slime-style generator whose trajectories arrive via /buffer/write; keeps the run open until stopped."""
import time
from pathlib import Path

TASK_TYPE = "external_writes"


def run_rollout(data):
    stop = Path(data["input_file"]).with_suffix(".stop")
    deadline = time.monotonic() + 120
    while not stop.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
''',
    "finishes_at_once.py": '''
"""slime-style generator that produces nothing and ends its run at once."""
TASK_TYPE = "finishes_at_once"


def run_rollout(data):
    return None
''',
    "fails_at_once.py": '''
"""slime-style generator whose run fails at once."""
TASK_TYPE = "fails_at_once"


def run_rollout(data):
    raise RuntimeError("engine unreachable")
''',
}
TOKEN = "s3cret-token"


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    gens = tmp_path / "generators"
    gens.mkdir()
    for name, source in GENERATORS.items():
        (gens / name).write_text(source)
    tasks = "".join(f'{{"instance_id": {i}, "prompt": "task {i}"}}\n' for i in range(8))
    (tmp_path / "tasks.jsonl").write_text(tasks)
    return tmp_path


@pytest.fixture
def serve(workdir: Path) -> Iterator[Callable[..., Server]]:
    """Start `rollout-buffer serve` with the test generators; stops every server it started."""
    started: list[Any] = []

    def start(group_size: int = 4, port: int | None = None, env: dict[str, str] | None = None) -> Server:
        port = port or free_port()
        args = ["serve", "--port", str(port), "--data-dir", str(workdir / f"data-{port}"),
                "--group-size", str(group_size), "--generator-path", str(workdir / "generators")]
        ctx = running(args, "/healthz", port, workdir / f"buffer-{port}.log", env)
        started.append(ctx)
        return ctx.__enter__()

    yield start
    (workdir / "tasks.stop").touch()  # lets a blocked external_writes generator return
    for ctx in reversed(started):
        ctx.__exit__(None, None, None)


def slime_args(
    url: str, workdir: Path, tokenizer_path: str, *extra: str, **overrides: Any
) -> argparse.Namespace:
    """slime's args as the trainer would have them, the adapter's flags parsed by its own parser."""
    cli = [
        *("--agent-rollout-buffer-url", url, "--rollout-task-type", "external_writes"),
        *("--loss-mask-type", "qwen3", "--rollout-buffer-wait-s", "2", "--rollout-buffer-lease-s", "30"),
        *("--fetch-trajectory-retry-times", "3", "--rollout-buffer-backoff-s", "0.05", *extra),
    ]
    args = add_arguments(argparse.ArgumentParser()).parse_args(cli)
    slime = {
        "rollout_batch_size": 2, "n_samples_per_prompt": 4, "prompt_data": str(workdir / "tasks.jsonl"),
        "sglang_router_ip": "127.0.0.1", "sglang_router_port": free_port(), "rollout_max_response_len": 64,
        "rollout_temperature": 0.8, "rollout_top_p": 0.95, "hf_checkpoint": tokenizer_path, "num_epoch": 1,
        "use_wandb": False, "use_tensorboard": False,
    }
    for key, value in {**slime, **overrides}.items():
        setattr(args, key, value)
    return args


def token_record(tokenizer: Any, instance_id: str, k: int, timestamp: float, reward: float,
                 **extra_info: Any) -> dict[str, Any]:
    """A trajectory as a token-mode generator writes it: exact ids, full-length loss mask, log-probs."""
    question = f"What is {instance_id} + {k}?"
    prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                                add_generation_prompt=True)
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    answer = f"It is {k} more than {instance_id}."
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    response = [*tokenizer(answer, add_special_tokens=False)["input_ids"], end]
    return {
        "uid": f"{instance_id}-{k}",
        "instance_id": instance_id,
        "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": answer}],
        "reward": reward,
        "extra_info": {"timestamp": timestamp, "finish_reason": "stop", "epoch": 0, **extra_info},
        "tokens": prompt + response,
        "loss_mask": [0] * len(prompt) + [1] * len(response),
        "rollout_log_probs": [-0.5] * len(response),
        "response_length": len(response),
    }


def write(url: str, records: list[dict[str, Any]], token: str | None = None) -> None:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(base_url=url, headers=headers, timeout=10) as http:
        for record in records:
            resp = http.post("/buffer/write", json=record)
            assert resp.status_code == 200, resp.text


def write_group(url: str, tokenizer: Any, instance_id: str, timestamp: float, size: int = 4,
                token: str | None = None, **extra_info: Any) -> list[dict[str, Any]]:
    records = [token_record(tokenizer, instance_id, k, timestamp, k % 2, **extra_info) for k in range(size)]
    write(url, records, token)
    return records


def wait_for_run(url: str, task_type: str, timeout_s: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        run = httpx.get(f"{url}/status", timeout=5).json()["run"]
        if run and run["task_type"] == task_type and run["state"] == "running":
            return run
        time.sleep(0.05)
    raise TimeoutError(f"no running {task_type} run on {url}")


def test_full_call_starts_once_and_returns_the_newest_groups(
    serve: Callable[..., Server], workdir: Path, qwen_tokenizer: Any, qwen_tokenizer_path: str
) -> None:
    url = serve().url
    args = slime_args(url, workdir, qwen_tokenizer_path)
    data_buffer = DataBuffer(n_samples_per_prompt=4)
    data_buffer.update_metadata({"6": ["3", "4"]})  # a resumed trainer: these tasks were trained on already
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(generate_rollout, args, 7, data_buffer)
        run = wait_for_run(url, "external_writes")  # the first call sent /start_rollout
        assert run["num_repeat_per_sample"] == 4 and run["num_epoch"] == 1
        assert run["config"]["skip_instance_ids"] == ["3", "4"]
        assert run["config"]["sampling_params"] == {"max_tokens": 64, "temperature": 0.8, "top_p": 0.95}
        assert run["config"]["remote_engine_url"] == f"http://127.0.0.1:{args.sglang_router_port}"
        assert run["config"]["tokenizer_path"] == qwen_tokenizer_path
        written = {iid: write_group(url, qwen_tokenizer, iid, ts) for iid, ts in (("10", 1.0), ("11", 3.0))}
        batch = first.result(timeout=60)

    assert [len(g) for g in batch] == [4, 4]
    assert [g[0].index for g in batch] == [11, 10]  # newest first
    for sample, record in zip(batch[0], written["11"], strict=True):
        assert sample.tokens == record["tokens"]
        assert sample.response_length == record["response_length"] == len(sample.loss_mask)
        assert sample.rollout_log_probs == record["rollout_log_probs"]
        assert sample.metadata["raw_reward"] == record["reward"]
        assert sample.status.name == "COMPLETED"
    assert sorted(s.reward for s in batch[0]) == pytest.approx([-1, -1, 1, 1], abs=1e-5)  # GRPO-normalized
    assert all(s.group_index == i for i, g in enumerate(batch) for s in g)

    # Three groups ready before the next call: the two newest are used, the oldest stays for later.
    # One is slime-style (messages only): its tokens come from the qwen3 loss mask algorithm.
    messages = [{"role": "user", "content": "Say hi."}, {"role": "assistant", "content": "hi"}]
    write(url, [{"uid": f"m-{k}", "instance_id": "12", "messages": messages, "reward": float(k % 2),
                 "extra_info": {"timestamp": 2.0}} for k in range(4)])
    write_group(url, qwen_tokenizer, "13", 5.0)
    write_group(url, qwen_tokenizer, "14", 4.0)
    second = generate_rollout(args, 8, data_buffer)
    assert [g[0].index for g in second] == [13, 14]
    assert httpx.get(f"{url}/status", timeout=5).json()["run"]["run_id"] == run["run_id"]  # not restarted
    [kept] = data_buffer.get_samples(1)
    ids, mask = LossMaskGenerator(qwen_tokenizer, "qwen3").get_loss_mask(messages)
    assert [s.index for s in kept] == [12] * 4
    assert all(s.tokens == ids and s.loss_mask == mask[mask.index(1) :] for s in kept)
    assert data_buffer.get_metadata() == {"6": ["3", "4"], "7": ["11", "10"], "8": ["13", "14", "12"]}


class CrashingDataBuffer(DataBuffer):
    def add_samples(self, samples: list[list[Any]]) -> None:
        raise RuntimeError("trainer crashed while storing samples")


def test_crash_between_fetch_and_ack_loses_no_group(
    serve: Callable[..., Server], workdir: Path, qwen_tokenizer: Any, qwen_tokenizer_path: str
) -> None:
    url = serve().url
    uids = {r["uid"] for iid in ("20", "21") for r in write_group(url, qwen_tokenizer, iid, 1.0)}
    args = slime_args(url, workdir, qwen_tokenizer_path, "--rollout-buffer-lease-s", "1")
    with pytest.raises(RuntimeError, match="trainer crashed"):
        generate_rollout(args, 0, CrashingDataBuffer(4))

    began = time.monotonic()
    batch = generate_rollout(args, 0, DataBuffer(4))  # the restarted trainer
    assert {s.prompt for g in batch for s in g} == uids
    assert time.monotonic() - began < 15
    after = httpx.post(f"{url}/get_rollout_data", json={"wait_s": 1.5}, timeout=10).json()
    assert after["success"] is False  # acked this time: not delivered again


def test_a_record_the_mask_generator_cannot_render_drops_its_group_not_the_call(
    serve: Callable[..., Server], workdir: Path, qwen_tokenizer: Any, qwen_tokenizer_path: str,
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch,
) -> None:
    url = serve().url
    logged: list[dict[str, float]] = []
    original = rollout_module.log_raw_info
    monkeypatch.setattr(rollout_module, "log_raw_info",
                        lambda *a, **kw: logged.append(original(*a, **kw)) or logged[-1])
    # Group 30 holds one messages-only record with a tool message that answers no call (it ends with an
    # assistant answer, so the buffer's own validity filter lets the group through).
    bad = [token_record(qwen_tokenizer, "30", k, 1.0, k % 2) for k in range(4)]
    bad[2] = {"uid": "30-bad", "instance_id": "30", "reward": 0.0, "extra_info": {"epoch": 0},
              "messages": [{"role": "user", "content": "q"}, {"role": "tool", "content": "391"},
                           {"role": "assistant", "content": "391"}]}
    args = slime_args(url, workdir, qwen_tokenizer_path)
    with caplog.at_level(logging.ERROR, logger="slime_adapter.rollout"), ThreadPoolExecutor(1) as pool:
        call = pool.submit(generate_rollout, args, 0, DataBuffer(4))
        wait_for_run(url, "external_writes")
        write(url, bad)
        write_group(url, qwen_tokenizer, "31", 2.0)
        # The call has fetched 30 and 31 (and drops 30): then it waits for one more group.
        deadline = time.monotonic() + 60
        while (groups := httpx.get(f"{url}/status", timeout=10).json()["groups"]).get("ready", 0) \
                or sum(groups.values()) < 2:
            assert time.monotonic() < deadline, groups
            time.sleep(0.05)
        write_group(url, qwen_tokenizer, "32", 3.0)
        batch = call.result(timeout=60)
    assert sorted(g[0].index for g in batch) == [31, 32], "the trainer still gets a full batch"
    assert "30-bad" in caplog.text and "tool message without a tool call" in caplog.text
    assert logged[-1]["rollout/adapter/dropped_groups"] == 1 and logged[-1]["rollout/adapter/unusable_records"] == 1
    assert httpx.post(f"{url}/get_rollout_data", json={}, timeout=10).json()["success"] is False  # 30 was acked


def test_retry_limit_is_honoured_when_the_buffer_is_down(workdir: Path, qwen_tokenizer_path: str) -> None:
    args = slime_args(f"http://127.0.0.1:{free_port()}", workdir, qwen_tokenizer_path,
                      "--fetch-trajectory-retry-times", "2")
    began = time.monotonic()
    with pytest.raises(RolloutBufferUnavailable, match="failed 3 times"):
        generate_rollout(args, 0, DataBuffer(4))
    assert time.monotonic() - began < 5


def test_retries_wait_for_a_buffer_that_comes_up_late(
    serve: Callable[..., Server], workdir: Path, qwen_tokenizer: Any, qwen_tokenizer_path: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    port = free_port()
    # 9 retries from 0.05 s doubling: about 25 s of patience, finite so a failure cannot hang the suite.
    args = slime_args(f"http://127.0.0.1:{port}", workdir, qwen_tokenizer_path,
                      "--fetch-trajectory-retry-times", "9", rollout_batch_size=1)
    with caplog.at_level(logging.WARNING, logger="slime_adapter.client"), ThreadPoolExecutor(1) as pool:
        pending = pool.submit(generate_rollout, args, 0, DataBuffer(4))
        deadline = time.monotonic() + 30
        while "retry 2/9" not in caplog.text:  # it has failed twice and goes on
            assert time.monotonic() < deadline and not pending.done(), caplog.text
            time.sleep(0.02)
        url = serve(port=port).url
        wait_for_run(url, "external_writes")
        write_group(url, qwen_tokenizer, "30", 1.0)
        assert [g[0].index for g in pending.result(timeout=60)] == [30]


def test_bearer_token_is_sent_and_a_refusal_is_not_retried(
    serve: Callable[..., Server], workdir: Path, qwen_tokenizer: Any, qwen_tokenizer_path: str
) -> None:
    url = serve(env={"ROLLOUT_BUFFER_AUTH_TOKEN": TOKEN}).url
    write_group(url, qwen_tokenizer, "40", 1.0, token=TOKEN)
    good = slime_args(url, workdir, qwen_tokenizer_path, "--rollout-buffer-token", TOKEN,
                      rollout_batch_size=1)
    assert [g[0].index for g in generate_rollout(good, 0, DataBuffer(4))] == [40]
    bad = slime_args(url, workdir, qwen_tokenizer_path, "--rollout-buffer-token", "wrong",
                     "--fetch-trajectory-retry-times", "9")
    began = time.monotonic()
    with pytest.raises(RolloutBufferError, match="401") as refused:
        generate_rollout(bad, 0, DataBuffer(4))
    assert not isinstance(refused.value, RolloutBufferUnavailable) and time.monotonic() - began < 2


def test_multi_agent_groups_of_another_size_are_returned_whole(
    serve: Callable[..., Server], workdir: Path, qwen_tokenizer: Any, qwen_tokenizer_path: str
) -> None:
    # 3 episodes x (planner, actor) per task: a group is 3 episodes (6 samples) while slime's
    # n_samples_per_prompt is 3. Each episode is written in one call, as the runner does.
    url = serve(group_size=3).url
    for iid in ("50", "51"):
        records = [
            token_record(qwen_tokenizer, iid, k, 1.0, k % 2, agent_id=("planner", "actor")[k % 2],
                         episode_id=f"{iid}-{k // 2}")
            for k in range(6)
        ]
        for episode in (records[0:2], records[2:4], records[4:6]):
            resp = httpx.post(f"{url}/buffer/write", json=episode, timeout=10)
            assert resp.status_code == 200 and resp.json()["written"] == 2, resp.text
    args = slime_args(url, workdir, qwen_tokenizer_path, n_samples_per_prompt=3)
    data_buffer = DataBuffer(3)
    batch = generate_rollout(args, 0, data_buffer)
    assert [len(g) for g in batch] == [6, 6]
    assert {s.metadata["agent_id"] for s in batch[0]} == {"planner", "actor"}
    assert data_buffer.get_buffer_length() == 0 and held_irregular_groups(data_buffer) == []


@pytest.mark.parametrize(
    ("task_type", "message"),
    [
        ("finishes_at_once", "finished and has no more groups"),
        ("fails_at_once", "failed .*engine unreachable"),
    ],
)
def test_an_ended_run_without_data_is_a_clear_error(
    serve: Callable[..., Server], workdir: Path, qwen_tokenizer_path: str, task_type: str, message: str
) -> None:
    url = serve().url
    args = slime_args(url, workdir, qwen_tokenizer_path, "--rollout-task-type", task_type,
                      "--rollout-buffer-wait-s", "0.5")
    with pytest.raises(RolloutBufferError, match=message):
        generate_rollout(args, 0, DataBuffer(4))

