"""Evaluation through the buffer: eval datasets at a trainer version beside a training run, on the simulated
engine over real HTTP — exact counts, pass@k against the unbiased estimator by hand, training's in-flight
budget untouched, no regeneration on repeat, resume after kill -9, export, metrics and the slime adapter."""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from math import comb
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from runs import math_rows, start, write_jsonl
from servers import Server, free_port
from servers import sim_engine as start_sim_engine

from rollout_buffer.delivery.evals import pass_at_k
from slime_adapter import add_arguments, generate_rollout
from slime_adapter.data_buffer import DataBuffer
from slime_adapter.evaluation import eval_version, note_training_rollout


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with start_sim_engine(tmp_path_factory.mktemp("sim"), qwen_tokenizer_path, "--latency-ms", "30",
                          "--correct-rate", "0.5") as srv:
        yield srv


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("eval_data")
    rows = math_rows(40)
    return {"train": write_jsonl(tmp / "train.jsonl", rows), "a": write_jsonl(tmp / "a.jsonl", rows[:6]),
            "b": write_jsonl(tmp / "b.jsonl", rows[10:14]), "c": write_jsonl(tmp / "c.jsonl", rows[20:40])}


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("eval_buffer")
    port = free_port()
    with Server(["serve", "--port", str(port), "--data-dir", str(tmp / "data")], "/healthz", port,
                tmp / "buffer.log").start() as srv:
        yield srv


def data_dir(srv: Server) -> str:
    return srv.args[srv.args.index("--data-dir") + 1]


def status(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/status", timeout=10).json()


def start_eval(url: str, **body: Any) -> httpx.Response:
    return httpx.post(f"{url}/start_eval", json=body, timeout=30)


def results(url: str, version: int, wait_s: float = 30, **body: Any) -> dict[str, Any]:
    r = httpx.post(f"{url}/eval_results", json={"version": version, "wait_s": wait_s, "records": True, **body},
                   timeout=wait_s + 30)
    assert r.status_code == 200, r.text
    return r.json()


def by_hand(records: list[dict[str, Any]], n: int) -> dict[str, float]:
    """Mean reward, unbiased pass@k (1 - C(n-c, k) / C(n, k), averaged over items), truncation rate and mean
    response length, from the records themselves."""
    correct: dict[str, int] = defaultdict(int)
    for r in records:
        correct[r["instance_id"]] += r["reward"] >= 1.0
    out = {"mean_reward": sum(r["reward"] for r in records) / len(records),
           "truncation_rate": sum(r["status"] == "truncated" for r in records) / len(records),
           "mean_response_length": sum(r["response_length"] for r in records) / len(records)}
    for k in range(1, n + 1):
        out[f"pass@{k}"] = sum(1 - comb(n - c, k) / comb(n, k) for c in correct.values()) / len(correct)
    return out


def test_the_estimator_matches_counting_every_k_subset() -> None:
    # n=4 samples, c=1 correct: of the 6 pairs, 3 hold the correct one.
    assert pass_at_k(4, 1, 2) == pytest.approx(0.5)
    assert pass_at_k(4, 0, 3) == 0.0 and pass_at_k(4, 2, 3) == 1.0 and pass_at_k(3, 3, 1) == 1.0


def test_two_eval_sets_beside_a_training_run(buffer: Server, engine: Server, files: dict[str, Path],
                                             qwen_tokenizer_path: str) -> None:
    url = buffer.url
    start(url, engine.url, files["train"], qwen_tokenizer_path, num_process=4, num_epoch=3)
    deadline = time.monotonic() + 30
    while status(url)["run"]["progress"].get("in_flight") != 4:  # the run's tokenizer has loaded
        assert time.monotonic() < deadline
        time.sleep(0.02)
    r = start_eval(url, eval_datasets={"a": str(files["a"]), "b": {"path": str(files["b"]),
                                                                   "n_samples_per_eval_prompt": 3}},
                   n_samples_per_eval_prompt=4, eval_num_process=2, current_version=5,
                   sampling_params={"temperature": 0.0})
    assert r.status_code == 200, r.text
    assert [(e["dataset"], e["state"], e["num_items"], e["n_samples"]) for e in r.json()["evals"]] == [
        ("a", "running", 6, 4), ("b", "running", 4, 3)]

    seen = []  # (training in flight, eval in flight, training done) while the evals run
    train_done_before = status(url)["run"]["progress"]["done"]
    while True:
        s = status(url)
        if all(j["state"] == "ended" for j in s["evals"]["jobs"]):
            break
        seen.append((s["run"]["progress"]["in_flight"], s["evals"]["in_flight"], s["run"]["progress"]["done"]))
        time.sleep(0.01)
    assert s["run"]["state"] == "running", "the training run outlasted the evals"
    assert max(e for _, e, _ in seen) == 2 and s["evals"]["eval_num_process"] == 2
    train_in_flight = [t for t, _, _ in seen]
    assert max(train_in_flight) == 4 and sum(t == 4 for t in train_in_flight) >= 0.8 * len(seen)
    assert seen[-1][2] > train_done_before, "training kept producing while the evals ran"

    out = results(url, 5)
    assert out["finished"] and set(out["results"]) == {"a", "b"}
    for name, n, items in (("a", 4, 6), ("b", 3, 4)):
        res = out["results"][name]
        records = res["records"]
        assert (res["state"], res["version"], res["samples"], res["expected_samples"], len(records)) == (
            "finished", 5, n * items, n * items, n * items)
        assert sorted((r["instance_id"], r["extra_info"]["eval_sample"]) for r in records) == sorted(
            (iid, k) for iid in {r["instance_id"] for r in records} for k in range(n))
        assert {(r["extra_info"]["eval_dataset"], r["extra_info"]["eval_version"]) for r in records} == {(name, 5)}
        assert len({r["uid"] for r in records}) == n * items
        expected = by_hand(records, n)
        assert set(res["pass_at_k"]) == {f"pass@{k}" for k in range(1, n + 1)}
        for key, value in expected.items():
            got = res["pass_at_k"][key] if key.startswith("pass@") else res[key]
            assert got == pytest.approx(value), key
    # Eval trajectories are not training data: they never enter the trajectory store or its groups.
    assert httpx.get(f"{url}/trajectories/{records[0]['uid']}", timeout=10).status_code == 404

    latest = {e["dataset"]: e for e in status(url)["evals"]["latest"]}
    assert latest["a"]["pass_at_k"] == out["results"]["a"]["pass_at_k"]
    shown = subprocess.run([sys.executable, "-m", "rollout_buffer", "status", "--url", url],
                           capture_output=True, text=True, check=True).stdout
    res_b = out["results"]["b"]
    assert (f"eval b    v5 finished  12/12 samples  reward {res_b['mean_reward']:.3f}  pass@1 "
            f"{res_b['pass_at_k']['pass@1']:.3f}  pass@3 {res_b['pass_at_k']['pass@3']:.3f}") in shown
    scrape = httpx.get(f"{url}/metrics", timeout=10).text
    assert f'rollout_buffer_eval_pass_at_k{{dataset="b",k="3"}} {out["results"]["b"]["pass_at_k"]["pass@3"]}' in scrape
    assert 'rollout_buffer_eval_version{dataset="a"} 5.0' in scrape

    # Asked again at the same version (a restarted trainer): nothing is generated, the results stay.
    again = start_eval(url, eval_datasets={"a": str(files["a"]), "b": {"path": str(files["b"]),
                                                                       "n_samples_per_eval_prompt": 3}},
                       n_samples_per_eval_prompt=4, current_version=5)
    assert [e["state"] for e in again.json()["evals"]] == ["finished", "finished"]
    assert results(url, 5, wait_s=0)["results"]["a"]["records"] == out["results"]["a"]["records"]

    exported = subprocess.run([sys.executable, "-m", "rollout_buffer", "export", "--data-dir",
                               data_dir(buffer), "--out", "-", "--eval"], capture_output=True, check=True)
    lines = [orjson.loads(line) for line in exported.stdout.splitlines()]
    assert [(x["dataset"], x["version"], x["pass_at_k"]) for x in lines] == [
        (name, 5, out["results"][name]["pass_at_k"]) for name in ("a", "b")]
    exported = subprocess.run([sys.executable, "-m", "rollout_buffer", "export", "--data-dir",
                               data_dir(buffer), "--out", "-", "--eval-records", "--dataset", "b"],
                              capture_output=True, check=True)
    assert [orjson.loads(line)["uid"] for line in exported.stdout.splitlines()] == [
        r["uid"] for r in out["results"]["b"]["records"]]


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ({"eval_datasets": {}}, "body.eval_datasets"),
        ({"eval_datasets": {"x": "{a}.missing"}, "task_type": "math", "remote_engine_url": "http://127.0.0.1:9"},
         "eval_datasets.x: path: "),
        ({"eval_datasets": {"x": "{a}"}, "n_samples_per_eval_prompt": 0}, "body.n_samples_per_eval_prompt"),
        ({"eval_datasets": {"x": "{a}"}, "eval_num_process": "many"}, "body.eval_num_process"),
        ({"eval_datasets": {"x": "{a}"}, "task_type": "nope"}, "task_type: unknown 'nope'"),
        ({"eval_datasets": {"x/y": "{a}"}}, "body.eval_datasets"),
    ],
)
def test_bad_eval_requests_name_the_field(buffer: Server, files: dict[str, Path], body: dict[str, Any],
                                          message: str) -> None:
    body = orjson.loads(orjson.dumps(body).replace(b"{a}", str(files["a"]).encode()))
    r = httpx.post(f"{buffer.url}/start_rollout", json={"mode": "eval", **body}, timeout=30)
    assert r.status_code == 422 and message in r.json()["message"], r.text


def slime_eval_args(url: str, engine: Server, files: dict[str, Path], tokenizer: str) -> argparse.Namespace:
    args = add_arguments(argparse.ArgumentParser()).parse_args(
        ["--agent-rollout-buffer-url", url, "--rollout-task-type", "math", "--loss-mask-type", "qwen3",
         "--rollout-buffer-wait-s", "5", "--eval-num-process", "3"])
    host, port = engine.url.removeprefix("http://").split(":")
    slime = {"eval_prompt_data": ["small", str(files["a"]), "tiny", str(files["b"])],
             "n_samples_per_eval_prompt": 2, "eval_temperature": 0.0, "eval_max_response_len": 3,
             "rollout_temperature": 1.0, "rollout_max_response_len": 256, "hf_checkpoint": tokenizer,
             "sglang_router_ip": host, "sglang_router_port": int(port), "rollout_batch_size": 2,
             "n_samples_per_prompt": 4, "update_weights_interval": 1}
    for key, value in slime.items():
        setattr(args, key, value)
    return args


def test_the_adapter_evaluates_with_slimes_eval_flags(buffer: Server, engine: Server, files: dict[str, Path],
                                                      qwen_tokenizer_path: str) -> None:
    args = slime_eval_args(buffer.url, engine, files, qwen_tokenizer_path)
    output = generate_rollout(args, 7, DataBuffer(4), evaluation=True)
    assert set(output.data) == {"small", "tiny"}
    for name, items in (("small", 6), ("tiny", 4)):
        data = output.data[name]
        # --n-samples-per-eval-prompt 2, --eval-max-response-len 3: every sample is cut at 3 tokens.
        assert len(data["rewards"]) == len(data["truncated"]) == len(data["samples"]) == 2 * items
        assert all(data["truncated"]) and {s.response_length for s in data["samples"]} == {3}
        assert [s.reward for s in data["samples"]] == data["rewards"]
    assert set(output.metrics) == {f"eval/{name}/{key}" for name in ("small", "tiny") for key in
                                   ("mean_reward", "pass@1", "pass@2", "truncation_rate", "mean_response_length")}
    assert output.metrics["eval/small/truncation_rate"] == 1.0
    assert output.metrics["eval/tiny/mean_response_length"] == 3.0
    # No training rollout fetched here: an eval before training stands for rollout 7's version.
    stored = {e["dataset"]: e for e in status(buffer.url)["evals"]["latest"]}
    assert stored["small"]["version"] == 7 and stored["small"]["samples"] == 12
    # --eval-temperature and --eval-max-response-len win over the rollout flags.
    assert (stored["tiny"]["sampling_params"], stored["tiny"]["max_tokens"]) == ({"temperature": 0.0}, 3)
    assert generate_rollout(args, 7, DataBuffer(4), evaluation=True).data["tiny"]["rewards"] == \
        output.data["tiny"]["rewards"]


def test_an_eval_after_training_stands_for_the_updated_weights() -> None:
    args = argparse.Namespace(update_weights_interval=1)
    url = "http://127.0.0.1:9/versions"
    assert eval_version(args, 3, url) == 3
    note_training_rollout(url, 3)
    assert eval_version(args, 3, url) == 4


def test_an_eval_resumes_after_kill_9_without_regenerating(tmp_path: Path, engine: Server,
                                                           files: dict[str, Path]) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    with Server(args, "/healthz", port, tmp_path / "buffer.log").start() as srv:
        # No training run to inherit from: the eval names its generator and engine itself (chat mode: no
        # tokenizer), and arrives as slime's start payload with mode "eval".
        r = httpx.post(f"{srv.url}/start_rollout", timeout=30, json={
            "mode": "eval", "eval_datasets": {"c": str(files["c"])}, "n_samples_per_eval_prompt": 2,
            "eval_num_process": 1, "current_version": 3, "task_type": "math", "remote_engine_url": engine.url,
            "max_tokens": 64})
        assert r.status_code == 200, r.text
        deadline = time.monotonic() + 30
        while (before := results(srv.url, 3, wait_s=0)["results"]["c"])["samples"] < 4:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        srv.kill9()
        assert before["state"] == "running"
    with Server(args, "/healthz", port, tmp_path / "buffer2.log").start() as srv:
        after = results(srv.url, 3)["results"]["c"]
        job = status(srv.url)["evals"]["jobs"][0]
    assert (after["state"], after["samples"], len(after["records"])) == ("finished", 40, 40)
    assert sorted((r["instance_id"], r["extra_info"]["eval_sample"]) for r in after["records"]) == sorted(
        (f"m{i}", k) for i in range(20, 40) for k in range(2))
    stored_after = {r["uid"]: r for r in after["records"]}
    assert all(stored_after[r["uid"]] == r for r in before["records"]), "samples stored before the kill are kept"
    assert job["skipped"] >= len(before["records"]) and job["skipped"] + job["done"] + job["failed"] == 40
