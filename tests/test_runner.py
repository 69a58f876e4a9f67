"""The runner end to end: buffer + simulated SGLang engines over real HTTP, real Qwen3 tokenizer."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from runs import drain, math_rows, start, wait_finished, write_jsonl
from servers import Server, free_port, running
from servers import sim_engine as start_sim_engine

from generators.math import math_reward

PLUGINS = Path(__file__).parent / "plugins"


@pytest.fixture(scope="module")
def sim_engine(tmp_path_factory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with start_sim_engine(tmp_path_factory.mktemp("sim"), qwen_tokenizer_path, "--correct-rate", "0.5",
                    "--latency-ms", "5") as srv:
        yield srv


def buffer(tmp_path: Path, *extra: str) -> Server:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"),
            "--generator-path", str(PLUGINS / "two_turn.py"), "--generator-path", str(PLUGINS / "flaky.py"),
            "--generator-path", str(PLUGINS / "slime_style.py"), "--generator-path", str(PLUGINS / "duo.py"), *extra]
    return Server(args, "/healthz", port, tmp_path / "buffer.log")


def test_math_run_token_mode_delivers_every_group_once(tmp_path, sim_engine, qwen_tokenizer, qwen_tokenizer_path):
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(5))
    with buffer(tmp_path).start() as srv:
        start(srv.url, sim_engine.url, inp, qwen_tokenizer_path, num_epoch=2)
        status = wait_finished(srv.url)
        records = drain(srv.url)
    assert status["run"]["progress"]["done"] == 40 and status["run"]["progress"]["failed"] == 0
    uids = [r["uid"] for r in records]
    assert len(uids) == len(set(uids)) == 40
    groups = Counter((r["instance_id"], r["extra_info"]["epoch"]) for r in records)
    assert groups == {(f"m{i}", e): 4 for i in range(5) for e in range(2)}
    label = {f"m{i}": str(3 * i + 3) for i in range(5)}
    im_end = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    for r in records:
        tokens, mask, n = r["tokens"], r["loss_mask"], r["response_length"]
        assert len(tokens) == len(mask)
        assert len(r["rollout_log_probs"]) == n
        response_mask = mask[-n:]
        assert response_mask[0] == 1 and all(m == 0 for m in mask[:-n])
        generated = [t for t, m in zip(tokens[-n:], response_mask, strict=True) if m == 1]
        assert generated[-1] == im_end
        assert all(lp < 0 for lp, m in zip(r["rollout_log_probs"], response_mask, strict=True) if m == 1)
        answer = r["messages"][-1]["content"]
        assert qwen_tokenizer.decode(generated[:-1]) == answer, "exact engine ids, never re-tokenized"
        assert r["raw_reward"] == math_reward(answer, label[r["instance_id"]])
        assert r["extra_info"]["finish_reason"] == "stop" and r["status"] == "completed"
    assert {r["raw_reward"] for r in records} == {0.0, 1.0}, "sim engine answers right and wrong"


def test_chat_mode_without_tokenizer(tmp_path, sim_engine):
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(2))
    with buffer(tmp_path).start() as srv:
        start(srv.url, sim_engine.url, inp, None)
        wait_finished(srv.url)
        records = drain(srv.url)
    assert len(records) == 8
    for r in records:
        assert r["tokens"] is None and r["messages"][-1]["role"] == "assistant"
        assert "boxed" in r["messages"][-1]["content"]


def test_multi_turn_tokens_match_template(tmp_path, sim_engine, qwen_tokenizer, qwen_tokenizer_path):
    inp = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "What is 2 + 5?"}, {"prompt": "What is 4 * 4?"}])
    with buffer(tmp_path).start() as srv:
        start(srv.url, sim_engine.url, inp, qwen_tokenizer_path, task_type="two_turn",
              tokenization_sanity_check_mode="ignore_strippable")
        wait_finished(srv.url)
        records = drain(srv.url)
    assert len(records) == 8
    for r in records:
        assert r["extra_info"]["turns"] == 2
        assert "tokenization_mismatch" not in r["extra_info"]
        assert [m["role"] for m in r["messages"]] == ["user", "assistant", "tool", "assistant"]
        text = qwen_tokenizer.decode(r["tokens"])
        # The final sequence is the template's rendering of the conversation with the model's own texts.
        expected = qwen_tokenizer.apply_chat_template(r["messages"], tokenize=False)
        strip = lambda s: "".join(s.split())  # noqa: E731
        import re

        no_think = lambda s: re.sub(r"<think>.*?</think>", "", s, flags=re.S)  # noqa: E731
        assert strip(no_think(text)) == strip(no_think(expected))
        # The tool observation is loss 0; both assistant turns are loss 1.
        obs = qwen_tokenizer.encode("observation: the tool says 7", add_special_tokens=False)
        pos = next(i for i in range(len(r["tokens"])) if r["tokens"][i:i + len(obs)] == obs)
        assert set(r["loss_mask"][pos:pos + len(obs)]) == {0}
        assert sum(r["loss_mask"]) > 0


def test_abort_resumes_and_concatenates(tmp_path, qwen_tokenizer, qwen_tokenizer_path):
    port = free_port()
    args = ["sim-engine", "--port", str(port), "--tokenizer", qwen_tokenizer_path, "--abort-rate", "0.5",
            "--correct-rate", "1.0", "--seed", "3"]
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(4))
    with running(args, "/health", port, tmp_path / "sim.log") as eng, buffer(tmp_path).start() as srv:
        start(srv.url, eng.url, inp, qwen_tokenizer_path, max_abort_resumes=20)
        wait_finished(srv.url)
        records = drain(srv.url)
    assert len(records) == 16
    assert sum(r["extra_info"]["abort_resumes"] for r in records) > 0, "some generations were aborted"
    for r in records:
        assert r["status"] == "completed" and r["raw_reward"] == 1.0
        generated = [t for t, m in zip(r["tokens"], r["loss_mask"], strict=True) if m == 1]
        assert qwen_tokenizer.decode(generated[:-1]) == r["messages"][-1]["content"]


def test_engine_errors_are_retried_then_recorded(tmp_path, qwen_tokenizer_path):
    port = free_port()
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(3))
    args = ["sim-engine", "--port", str(port), "--tokenizer", qwen_tokenizer_path, "--error-rate", "1.0",
            "--error-kinds", "http_500"]
    with running(args, "/health", port, tmp_path / "sim.log") as eng, buffer(tmp_path).start() as srv:
        start(srv.url, eng.url, inp, qwen_tokenizer_path, max_retries=2, engine_outage_s=0)
        status = wait_finished(srv.url)
        served = httpx.get(f"{eng.url}/sim/stats").json()
        rec = httpx.get(f"{srv.url}/trajectories/{status['run']['run_id']}:m0:0:0").json()
    progress = status["run"]["progress"]
    assert progress["failed"] == 12 and progress["done"] == 0
    assert progress["failures"] == {"engine_http_5xx": 12}
    assert status["records"] == {"failed": 12}
    assert served["by_endpoint"]["/generate"] == 12 * 3, "each trajectory tried 1 + max_retries times"
    assert rec["status"] == "failed" and "http_5xx" in rec["extra_info"]["error"]


def test_engine_errors_at_a_rate_are_absorbed_by_retries(tmp_path, qwen_tokenizer_path):
    port = free_port()
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(4))
    args = ["sim-engine", "--port", str(port), "--tokenizer", qwen_tokenizer_path, "--error-rate", "0.3",
            "--error-kinds", "http_500,truncated_json,reset", "--seed", "1"]
    with running(args, "/health", port, tmp_path / "sim.log") as eng, buffer(tmp_path).start() as srv:
        start(srv.url, eng.url, inp, qwen_tokenizer_path, max_retries=8)
        status = wait_finished(srv.url)
        faults = httpx.get(f"{eng.url}/sim/stats").json()["faults"]
    assert sum(faults.values()) > 0
    assert status["run"]["progress"]["done"] == 16 and status["run"]["progress"]["failed"] == 0


def test_two_engines_share_load_with_affinity(tmp_path, qwen_tokenizer_path):
    p1, p2 = free_port(), free_port()
    base = ["--tokenizer", qwen_tokenizer_path, "--latency-ms", "20"]
    inp = write_jsonl(tmp_path / "t.jsonl", [{"prompt": f"What is {i} + 1?"} for i in range(8)])
    with (
        running(["sim-engine", "--port", str(p1), *base], "/health", p1, tmp_path / "e1.log") as e1,
        running(["sim-engine", "--port", str(p2), *base], "/health", p2, tmp_path / "e2.log") as e2,
        buffer(tmp_path).start() as srv,
    ):
        start(srv.url, [e1.url, e2.url], inp, qwen_tokenizer_path, task_type="two_turn", num_process=8)
        wait_finished(srv.url)
        records = drain(srv.url)
        served = [httpx.get(f"{e.url}/sim/stats").json()["by_endpoint"]["/generate"] for e in (e1, e2)]
    assert len(records) == 32 and sum(served) == 64
    assert min(served) >= 16, f"least-in-flight should spread the load: {served}"
    for r in records:
        assert len(r["extra_info"]["engines"]) == 1, "both turns of a trajectory go to the same engine"


def test_failing_generator_is_recorded_and_run_goes_on(tmp_path, sim_engine, qwen_tokenizer_path):
    inp = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "What is 1 + 1?"}, {"prompt": "What is 2 + 2?"}])
    with buffer(tmp_path).start() as srv:
        start(srv.url, sim_engine.url, inp, qwen_tokenizer_path, task_type="flaky")
        status = wait_finished(srv.url)
        rid = status["run"]["run_id"]
        rec = httpx.get(f"{srv.url}/trajectories/{rid}:0:0:1").json()
        assert drain(srv.url) == []
    assert status["run"]["state"] == "finished"
    assert status["run"]["progress"]["failures"] == {"generator_error": 4}
    assert status["records"] == {"completed": 4, "failed": 4}
    assert status["filtered"] == {"failed_trajectory": 2}
    assert rec["status"] == "failed" and "tool exploded on repeat 1" in rec["extra_info"]["error"]


def test_skip_instance_ids_skips_one_group_each(tmp_path, sim_engine, qwen_tokenizer_path):
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(3))
    with buffer(tmp_path).start() as srv:
        start(srv.url, sim_engine.url, inp, qwen_tokenizer_path, num_epoch=2,
              skip_instance_ids=["m0", "m0", "m1"])
        wait_finished(srv.url)
        groups = Counter((r["instance_id"], r["extra_info"]["epoch"]) for r in drain(srv.url))
    assert {k[0] for k in groups} == {"m1", "m2"}
    assert sum(1 for k in groups if k[0] == "m1") == 1 and sum(1 for k in groups if k[0] == "m2") == 2


def test_slime_style_generator_posts_through_http(tmp_path, sim_engine):
    inp = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    with buffer(tmp_path).start() as srv:
        start(srv.url, sim_engine.url, inp, None, task_type="slime_style")
        status = wait_finished(srv.url)
        records = drain(srv.url)
    assert status["run"]["state"] == "finished"
    assert Counter(r["instance_id"] for r in records) == {"0": 4, "1": 4}


def test_restart_resumes_without_regenerating_complete_groups(tmp_path, qwen_tokenizer_path):
    port = free_port()
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(24))
    args = ["sim-engine", "--port", str(port), "--tokenizer", qwen_tokenizer_path, "--latency-ms", "150"]
    with running(args, "/health", port, tmp_path / "sim.log") as eng:
        srv = buffer(tmp_path).start()
        start(srv.url, eng.url, inp, qwen_tokenizer_path, num_process=8)
        deadline = time.monotonic() + 30
        while httpx.get(f"{srv.url}/status").json()["groups"].get("ready", 0) < 4:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        srv.kill9()
        before = httpx.get(f"{eng.url}/sim/stats").json()["by_endpoint"]["/generate"]
        srv = buffer(tmp_path).start()
        try:
            status = wait_finished(srv.url, timeout_s=90)
            records = drain(srv.url)
        finally:
            srv.stop()
        after = httpx.get(f"{eng.url}/sim/stats").json()["by_endpoint"]["/generate"]
    assert status["run"]["state"] == "finished"
    assert len(records) == 96 and len({r["uid"] for r in records}) == 96
    # Only trajectories that were not stored before the crash were generated again: at most num_process
    # generating and num_process finished ones waiting for their commit.
    assert after - 96 <= 16, f"{after - 96} extra generations: complete groups were regenerated"
    assert before >= 16


def test_multi_agent_episodes_are_the_unit_of_a_group(tmp_path, sim_engine):
    inp = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    with buffer(tmp_path).start() as srv:
        start(srv.url, sim_engine.url, inp, None, task_type="duo")
        wait_finished(srv.url)
        out = httpx.post(f"{srv.url}/get_rollout_data", json={"max_groups": 1}).json()["data"]
    records = out["data"]
    assert out["meta_info"]["num_groups"] == 1 and len(records) == 12, "4 episodes x 3 records, delivered together"
    assert len({r["extra_info"]["episode_id"] for r in records}) == 4
    adv = 0.5 / (0.5 + 1e-6)
    for r in records:
        sign = 1 if r["extra_info"]["episode_reward"] == 1.0 else -1
        assert r["reward"] == pytest.approx(sign * adv * r["extra_info"]["reward_weight"])


def test_num_process_bounds_the_requests_at_the_engine(tmp_path, qwen_tokenizer_path):
    port = free_port()
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(8))
    args = ["sim-engine", "--port", str(port), "--tokenizer", qwen_tokenizer_path, "--latency-ms", "40"]
    with running(args, "/health", port, tmp_path / "sim.log") as eng, buffer(tmp_path).start() as srv:
        start(srv.url, eng.url, inp, qwen_tokenizer_path, num_process=4)
        status = wait_finished(srv.url, timeout_s=60)
        records = drain(srv.url)
        stats = httpx.get(f"{eng.url}/sim/stats").json()
    assert status["run"]["state"] == "finished" and len(records) == 32
    # Trajectories hand their slot on when generation ends, so the engine sees exactly num_process at once.
    assert stats["max_in_flight"] == 4


def test_a_run_whose_trajectories_keep_failing_fails_with_the_reason(tmp_path, sim_engine, qwen_tokenizer_path):
    """Every trajectory of a generator that cannot work fails: the run fails (instead of ending `finished` with
    nothing to deliver), and the trainer's poll says why."""
    inp = write_jsonl(tmp_path / "t.jsonl", math_rows(20))
    with buffer(tmp_path, "--generator-path", str(PLUGINS / "broken.py")).start() as srv:
        start(srv.url, sim_engine.url, inp, qwen_tokenizer_path, task_type="broken", failure_window=8,
              num_process=4)
        status = wait_finished(srv.url)
        answer = httpx.post(f"{srv.url}/get_rollout_data", json={"wait_s": 0}).json()
        with pytest.raises(httpx.HTTPStatusError):  # a bad setting is refused at the start
            httpx.post(f"{srv.url}/start_rollout", timeout=30, json={
                "task_type": "broken", "input_file": str(inp), "remote_engine_url": sim_engine.url,
                "max_failure_rate": 0}).raise_for_status()
    run = status["run"]
    assert run["state"] == "failed" and run["error"].startswith("the last 8 trajectories all failed"), run
    assert "generator_error ×8" in run["error"] and "needs a key" in run["error"]
    assert run["progress"]["failed"] < 80, "it stopped early, not after failing every item"
    assert answer["success"] is False and f"run {run['run_id']} failed: the last 8" in answer["message"]
