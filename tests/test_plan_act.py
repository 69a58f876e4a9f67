"""The plan/act generator end to end (buffer + simulated SGLang engines over real HTTP, real Qwen3 tokenizer,
the slime adapter and the demo on top), and its plan format."""

from __future__ import annotations

import argparse
import re
import statistics
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from demo_cli import run_demo
from masks import spans
from runs import drain_batches, wait_finished
from servers import Server, free_port

from generators.math import math_reward
from generators.plan_act_format import parse_planner_turn, split_reasoning
from generators.plan_act_run import PlanActOptions
from generators.search import exact_match, format_documents
from generators.search_client import hit_documents
from generators.tools.calculator import evaluate, format_value
from rollout_buffer.tools.demo import bundled_dataset
from rollout_sim.policy import reported_value
from slime_adapter import add_arguments, generate_rollout
from slime_adapter.data_buffer import DataBuffer

BOXED_VALUE = re.compile(r"\\boxed\{(.+?)\}")


# ------------------------------------------------------------------ servers and run helpers


def sim_engine(tmp: Path, tokenizer: str, *extra: str) -> Server:
    port = free_port()
    args = ["sim-engine", "--port", str(port), "--tokenizer", tokenizer, "--latency-ms", "1", *extra]
    return Server(args, "/health", port, tmp / f"sim-{port}.log")


def buffer(tmp: Path) -> Server:
    port = free_port()
    return Server(["serve", "--port", str(port), "--data-dir", str(tmp / "data")], "/healthz", port,
                  tmp / "buffer.log")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[tuple[Server, Server]]:
    """Two simulated engines, seeded: the first test to use them sees the same scripted draws every time."""
    tmp = tmp_path_factory.mktemp("sim")
    with (
        sim_engine(tmp, qwen_tokenizer_path, "--correct-rate", "0.7", "--seed", "1").start() as e1,
        sim_engine(tmp, qwen_tokenizer_path, "--correct-rate", "0.7", "--seed", "2").start() as e2,
    ):
        yield e1, e2


@pytest.fixture
def engine(engines: tuple[Server, Server]) -> Server:
    return engines[0]


def demo_rows(*ids: str) -> list[dict[str, Any]]:
    rows = [orjson.loads(line) for line in bundled_dataset("plan_act").read_bytes().splitlines() if line.strip()]
    return [r for r in rows if r["instance_id"] in ids] if ids else rows


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


def run_to_end(url: str, engine: str | list[str], input_file: Path, tokenizer: str | None, **options: Any
               ) -> tuple[dict, list[list[dict]]]:
    """Start a plan_act run, wait until it ends, return (status, the delivered batches of records)."""
    payload = {
        "task_type": "plan_act", "input_file": str(input_file), "num_repeat_per_sample": 4, "num_process": 16,
        "remote_engine_url": engine, "max_tokens": 2048, "tokenizer_path": tokenizer,
        "sampling_params": {"temperature": 1.0}, "tokenization_sanity_check_mode": "ignore_strippable",
        "backoff_s": 0.05, **options,
    }
    resp = httpx.post(f"{url}/start_rollout", json=payload, timeout=30)
    assert resp.status_code == 200, resp.text
    status = wait_finished(url, timeout_s=90)
    return status, drain_batches(url, max_groups=1, wait_s=0.2)


def episodes(records: list[dict]) -> dict[str, tuple[dict, list[dict]]]:
    """episode_id → (planner record, actor records by subtask_index)."""
    planners: dict[str, dict] = {}
    actors: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        info = r["extra_info"]
        if info["agent_id"] == "planner":
            assert info["episode_id"] not in planners, "one planner record per episode"
            planners[info["episode_id"]] = r
        else:
            assert info["agent_id"] == "actor"
            actors[info["episode_id"]].append(r)
    assert set(actors) <= set(planners)
    return {ep: (p, sorted(actors[ep], key=lambda a: a["extra_info"]["subtask_index"])) for ep, p in planners.items()}


def assert_exact_tokens(record: dict, tokenizer: Any) -> None:
    """Loss 1 is exactly the engine's tokens of each assistant turn (never re-tokenized); all else loss 0."""
    tokens, mask, n = record["tokens"], record["loss_mask"], record["response_length"]
    assert len(tokens) == len(mask) and len(record["rollout_log_probs"]) == n
    assert set(mask[: len(mask) - n]) == {0}, "the prompt is loss 0"
    replies = [m["content"] for m in record["messages"] if m["role"] == "assistant"]
    model = spans(mask, 1)
    assert len(model) == len(replies)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    for (a, b), reply in zip(model, replies, strict=True):
        assert tokens[b - 1] == im_end and tokenizer.decode(tokens[a: b - 1]) == reply
    offset = len(tokens) - n
    for (a, b) in model:
        assert all(lp < 0 for lp in record["rollout_log_probs"][a - offset: b - offset])
    # The sequence is the chat template's rendering of the messages (reasoning of earlier turns aside).
    assert "tokenization_mismatch" not in record["extra_info"]


def common_prefix(sequences: list[list[int]]) -> list[int]:
    first = sequences[0]
    n = next((i for i in range(len(first)) if any(len(s) <= i or s[i] != first[i] for s in sequences)), len(first))
    return first[:n]


def planner_turns(planner: dict) -> list[str]:
    return [m["content"] for m in planner["messages"] if m["role"] == "assistant"]


def value_of(reply: str) -> str:
    value = reported_value(split_reasoning(reply)[1])
    assert value is not None, reply
    return value


# ------------------------------------------------------------------ the plan format


def test_plan_format_answer_tags_numbered_steps_inside_or_after_reasoning() -> None:
    tagged = "<think>\nsplit it\n</think>\n<plan>\n<step>Find A.</step>\n<step> Find B. </step>\n</plan>"
    assert parse_planner_turn(tagged).steps == ("Find A.", "Find B.")
    inside = "<think>\nPlan: <step>Look up X.</step>\n</think>\nI will hand it over."
    assert parse_planner_turn(inside).steps == ("Look up X.",)
    numbered = "<think>\nok\n</think>\nPlan:\n1. Compute 2 * 3.\n2) Add 4.\nStep 3: Report it."
    assert parse_planner_turn(numbered).steps == ("Compute 2 * 3.", "Add 4.", "Report it.")
    # Steps after the reasoning win over drafts inside it; the final answer wins over any plan.
    both = "<think>\n<step>draft</step>\n</think>\n<step>final step</step>"
    assert parse_planner_turn(both).steps == ("final step",)
    answered = "<think>\n<answer>not yet</answer>\n</think>\n<step>x</step>\n<answer> 42 </answer>"
    assert parse_planner_turn(answered).answer == "42"
    # An answer only inside the reasoning is not final; a turn without either is neither.
    musing = parse_planner_turn("<think>\nmaybe <answer>7</answer>\n</think>\nHmm.")
    assert musing.answer is None and musing.steps == ()
    assert parse_planner_turn("No reasoning tags: <answer>Paris</answer>").answer == "Paris"


def test_bad_run_options_are_refused_with_their_names() -> None:
    with pytest.raises(ValueError, match="actor_engine_url"):
        PlanActOptions.from_run({"actor_engine_url": "ftp://engine"})
    with pytest.raises(ValueError, match="actor_tools"):
        PlanActOptions.from_run({"actor_tools": ["shell"]})
    assert PlanActOptions.from_run({"max_turns": "3"}).max_turns == 3


# ------------------------------------------------------------------ end to end


def test_episodes_plan_act_revise_answer_with_shared_reward_over_two_engines(
        tmp_path: Path, engines: tuple[Server, Server], qwen_tokenizer: Any, qwen_tokenizer_path: str) -> None:
    rows = demo_rows("plan-000", "plan-002", "plan-006")
    labels = {r["instance_id"]: r["label"] for r in rows}
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    e1, e2 = engines
    with buffer(tmp_path).start() as srv:
        # One episode at a time keeps the engines' scripted draws, and so the rewards, deterministic.
        status, batches = run_to_end(srv.url, [e1.url, e2.url], inp, qwen_tokenizer_path, num_process=1,
                                     planner_reward_weight=1.0, actor_reward_weight=0.5)
        served = [httpx.get(f"{e.url}/sim/stats").json()["by_endpoint"]["/generate"] for e in (e1, e2)]
    records = [r for batch in batches for r in batch]
    assert status["run"]["progress"]["failed"] == 0 and status["filtered"] == {}
    assert status["run"]["progress"]["done"] == len(records)
    # Grouping: every batch is one whole group of 4 episodes (instance, epoch), each delivered once.
    assert len(batches) == 3
    for batch in batches:
        assert len({(r["instance_id"], r["extra_info"]["epoch"]) for r in batch}) == 1
        assert len({r["extra_info"]["episode_id"] for r in batch}) == 4
    eps = episodes(records)
    assert len(eps) == 12 and min(served) > 0, "both engines were used"
    for planner, actors in eps.values():
        info = planner["extra_info"]
        iid = planner["instance_id"]
        turns = planner_turns(planner)
        # Structure: planner turns alternate with reports (user turns at loss 0), the last turn answers.
        assert [m["role"] for m in planner["messages"]] == ["system", "user"] + ["assistant", "user"] * (
            len(turns) - 1) + ["assistant"]
        assert planner["messages"][0]["content"].startswith("You are the planner.")
        assert "calculator (Evaluate an arithmetic expression" in planner["messages"][0]["content"]
        plans = [parse_planner_turn(t) for t in turns]
        assert info["stop_reason"] == "answer" and plans[-1].answer == info["answer"]
        assert info["planner_turns"] == len(turns) == info["turn"] + 1
        assert [a["extra_info"]["subtask_index"] for a in actors] == list(range(len(actors)))
        for t, plan in enumerate(plans[:-1]):
            mine = [a for a in actors if a["extra_info"]["turn"] == t]
            assert [a["extra_info"]["step"] for a in mine] == list(plan.steps)
            reports = planner["messages"][3 + 2 * t]["content"]
            for a in mine:
                assert f'status="done">\nSub-task: {a["extra_info"]["step"]}\nResult: ' in reports
        # Each sub-task: the actor calls the calculator on its step and reports the value (off when wrong).
        truth_kept = True
        for a in actors:
            ainfo = a["extra_info"]
            assert ainfo["agent_id"] == "actor" and ainfo["subtask_status"] == "done"
            _system, user, _call, tool, report = a["messages"]
            assert user["content"].startswith(f"Task: {planner['messages'][1]['content']}")
            assert user["content"].endswith(f"Your sub-task: {ainfo['step']}")
            expression = ainfo["step"].removeprefix("Compute ").removesuffix(".")
            assert ainfo["tool_calls"] == [{"turn": 1, "name": "calculator", "arguments": {"expression": expression}}]
            assert tool == {"role": "tool", "name": "calculator", "content": format_value(evaluate(expression))}
            truth_kept &= value_of(report["content"]) == tool["content"]
        # Revision: the plan after the first reports computes with the values the actors reported.
        if iid == "plan-000":
            v0, v1 = (value_of(a["messages"][-1]["content"]) for a in actors[:2])
            assert plans[0].steps == ("Compute 12 * 28.", "Compute 9 * 31.")
            assert plans[1].steps == (f"Compute {v0} + {v1}.",)
            assert len(plans) == 3
        assert info["answer"] == value_of(actors[-1]["messages"][-1]["content"])
        # Shared reward: the planner's answer scored by math-verify, right exactly when no actor erred.
        reward = math_reward(info["answer"], labels[iid])
        assert info["episode_reward"] == reward == float(truth_kept)
        assert info["scorer"] == "math" and info["label"] == labels[iid]
        for r, weight in [(planner, 1.0)] + [(a, 0.5) for a in actors]:
            assert r["extra_info"]["episode_reward"] == reward and r["extra_info"]["reward_weight"] == weight
            assert r["raw_reward"] == reward * weight
            assert r["extra_info"]["episode_id"] == info["episode_id"]
            assert r["status"] == "completed"
            assert_exact_tokens(r, qwen_tokenizer)
        # Prefix reuse: every sub-task's conversation opens with the same system prompt, tools and task.
        if len(actors) > 1:
            shared_prefix = qwen_tokenizer.decode(common_prefix([a["tokens"] for a in actors]))
            assert shared_prefix.startswith("<|im_start|>system\nYou are the actor.")
            assert f"Task: {planner['messages'][1]['content']}" in shared_prefix
        # Session affinity: the whole episode ran on one engine.
        assert len({e for r in [planner, *actors] for e in r["extra_info"]["engines"]}) == 1
    # Normalization runs over episode rewards and is scaled by each record's role weight.
    by_group: dict[tuple, dict[str, float]] = defaultdict(dict)
    for r in records:
        by_group[(r["instance_id"], r["extra_info"]["epoch"])][r["extra_info"]["episode_id"]] = r["raw_reward"] / (
            r["extra_info"]["reward_weight"])
    assert {v for g in by_group.values() for v in g.values()} == {0.0, 1.0}, "episodes succeed and fail"
    for r in records:
        group = by_group[(r["instance_id"], r["extra_info"]["epoch"])]
        mean, std = statistics.fmean(group.values()), statistics.pstdev(group.values())
        advantage = 0.0 if std < 1e-8 else (group[r["extra_info"]["episode_id"]] - mean) / (std + 1e-6)
        assert r["reward"] == pytest.approx(advantage * r["extra_info"]["reward_weight"])


def generate_requests(engine: Server) -> int:
    return httpx.get(f"{engine.url}/sim/stats").json()["by_endpoint"].get("/generate", 0)


def test_failed_subtask_is_reported_and_replanned_on_the_actor_engine(
        tmp_path: Path, engine: Server, qwen_tokenizer: Any, qwen_tokenizer_path: str) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", demo_rows("plan-000"))
    planner_engine, before = engine, generate_requests(engine)
    with (
        sim_engine(tmp_path, qwen_tokenizer_path, "--correct-rate", "1.0").start() as actor_engine,
        buffer(tmp_path).start() as srv,
    ):
        # The actor's first request fails and is not retried: its sub-task fails, the episode goes on.
        httpx.post(f"{actor_engine.url}/sim/faults", json={"next": ["http_500"]}).raise_for_status()
        status, batches = run_to_end(srv.url, planner_engine.url, inp, qwen_tokenizer_path,
                                     actor_engine_url=actor_engine.url, num_repeat_per_sample=1, max_retries=0,
                                     engine_outage_s=0,
                                     max_turns=5, normalize_rewards=False)
        served = {"planner": generate_requests(planner_engine) - before, "actor": generate_requests(actor_engine)}
    assert status["run"]["progress"] == {**status["run"]["progress"], "failed": 0, "done": 4}
    [(planner, actors)] = episodes(batches[0]).values()
    info = planner["extra_info"]
    plans = [parse_planner_turn(t) for t in planner_turns(planner)]
    assert [p.steps for p in plans] == [("Compute 12 * 28.", "Compute 9 * 31."), ("Compute 12 * 28.",),
                                        ("Compute 336 + 279.",), ()]
    assert info["answer"] == "615" and info["episode_reward"] == 1.0 and planner["reward"] == 1.0
    failed, *rest = info["subtasks"]
    assert failed == {"turn": 0, "subtask_index": 0, "step": "Compute 12 * 28.", "status": "failed",
                      "stop_reason": "engine_error", "has_sample": False}
    assert [s["status"] for s in rest] == ["done"] * 3 and all(s["has_sample"] for s in rest)
    first_reports = planner["messages"][3]["content"]
    assert '<report step="1" status="failed">\nSub-task: Compute 12 * 28.\nResult: the actor failed: engine' in (
        first_reports)
    assert "http_5xx" in first_reports and '<report step="2" status="done">' in first_reports
    assert "could not finish 'Compute 12 * 28.'" in planner_turns(planner)[1], "the planner revised its plan"
    # The failed sub-task has no sample; the others carry the shared reward.
    assert [a["extra_info"]["subtask_index"] for a in actors] == [1, 2, 3]
    assert all(a["reward"] == 1.0 and a["extra_info"]["episode_reward"] == 1.0 for a in actors)
    # Each role ran on its own engine: 4 planner turns there, 1 failed + 3 x 2 actor turns here.
    assert served == {"planner": 4, "actor": 7}
    assert info["engines"] == [planner_engine.url] and info["turns"] == 4
    assert all(a["extra_info"]["engines"] == [actor_engine.url] for a in actors)
    for r in (planner, *actors):
        assert_exact_tokens(r, qwen_tokenizer)


def test_tight_token_budget_ends_episodes_on_a_planner_reply(tmp_path: Path, engine: Server,
                                                             qwen_tokenizer_path: str) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", demo_rows("plan-006"))
    with buffer(tmp_path).start() as srv:
        status, batches = run_to_end(srv.url, engine.url, inp, qwen_tokenizer_path, max_tokens=240)
    records = [r for batch in batches for r in batch]
    assert status["filtered"] == {} and len(batches) == 1, "no group is dropped for a record without a reply"
    for planner, _actors in episodes(records).values():
        assert planner["messages"][-1]["role"] == "assistant"
        assert planner["extra_info"]["stop_reason"] == "max_tokens" and planner["extra_info"]["answer"] is None
        assert planner["raw_reward"] == 0.0 and planner["response_length"] <= 240


def test_chat_mode_without_tokenizer(tmp_path: Path, engine: Server) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", demo_rows("plan-001"))
    with buffer(tmp_path).start() as srv:
        status, batches = run_to_end(srv.url, engine.url, inp, None, num_repeat_per_sample=2)
    check_chat_episodes(status, batches)


def test_chat_mode_with_a_tool_call_parser(tmp_path: Path, qwen_tokenizer_path: str) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", demo_rows("plan-001"))
    with sim_engine(tmp_path, qwen_tokenizer_path, "--tool-call-parser", "qwen").start() as parsing, \
            buffer(tmp_path).start() as srv:
        status, batches = run_to_end(srv.url, parsing.url, inp, None, num_repeat_per_sample=2)
    for _planner, actors in check_chat_episodes(status, batches).values():
        for actor in actors:
            call_turn, tool = actor["messages"][2:4]
            [call] = call_turn["tool_calls"]
            assert "<tool_call>" not in call_turn["content"] and call["function"]["name"] == "calculator"
            assert tool["tool_call_id"] == call["id"] and actor["tools"][0]["function"]["name"] == "calculator"


def check_chat_episodes(status: dict, batches: list[list[dict]]) -> dict[str, tuple[dict, list[dict]]]:
    """Two answered episodes of plan-001 in chat mode, each actor computing its step with the calculator."""
    eps = episodes(batches[0])
    assert len(eps) == 2 and status["run"]["progress"]["failed"] == 0
    for planner, actors in eps.values():
        assert planner["tokens"] is None and planner["extra_info"]["stop_reason"] == "answer"
        first, second = actors
        reported = value_of(first["messages"][-1]["content"])
        assert [a["extra_info"]["step"] for a in actors] == ["Compute 24 * 36.", f"Compute {reported} - 785."]
        assert first["messages"][3]["content"] == "864"
        assert second["messages"][3]["content"] == str(int(reported) - 785)
    return eps


def test_question_answered_through_the_search_tool_scored_by_exact_match(
        tmp_path: Path, engine: Server, qwen_tokenizer: Any, qwen_tokenizer_path: str, retriever: Server) -> None:
    lines = bundled_dataset("search").read_bytes().splitlines()
    rows = [orjson.loads(line) for line in lines[:3]]
    inp = write_jsonl(tmp_path / "in.jsonl", rows)
    with buffer(tmp_path).start() as srv:
        status, batches = run_to_end(srv.url, engine.url, inp, qwen_tokenizer_path, actor_tools=["search"],
                                     search_url=retriever.url)
    golden = {str(i): r["golden_answers"] for i, r in enumerate(rows)}
    records = [r for batch in batches for r in batch]
    assert status["run"]["progress"]["failed"] == 0 and len(batches) == 3
    for planner, actors in episodes(records).values():
        question = planner["messages"][1]["content"]
        [actor] = actors
        _system, user, _call, tool, report = actor["messages"]
        assert user["content"].endswith(f"Your sub-task: Find out: {question}")
        assert actor["extra_info"]["tool_calls"][0]["arguments"] == {"query": question}
        docs = httpx.post(f"{retriever.url}/retrieve", json={"queries": [question], "topk": 3}).json()["result"][0]
        assert tool == {"role": "tool", "name": "search", "content": format_documents(hit_documents(docs))}
        answer = planner["extra_info"]["answer"]
        assert answer == value_of(report["content"])
        reward = float(exact_match(answer, golden[planner["instance_id"]]))
        assert planner["extra_info"]["scorer"] == "em" and planner["raw_reward"] == actor["raw_reward"] == reward
        assert_exact_tokens(actor, qwen_tokenizer)


# ------------------------------------------------------------------ slime adapter and demo


def test_slime_adapter_returns_each_group_whole_with_its_episodes(
        tmp_path: Path, engine: Server, qwen_tokenizer_path: str) -> None:
    inp = write_jsonl(tmp_path / "in.jsonl", demo_rows("plan-000", "plan-004"))
    with buffer(tmp_path).start() as srv:
        cli = ["--agent-rollout-buffer-url", srv.url, "--rollout-task-type", "plan_act", "--rollout-buffer-wait-s",
               "2", "--rollout-buffer-lease-s", "60", "--fetch-trajectory-retry-times", "3"]
        args = add_arguments(argparse.ArgumentParser()).parse_args(cli)
        host, port = engine.url.removeprefix("http://").rsplit(":", 1)
        slime = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "prompt_data": str(inp),
                 "sglang_router_ip": host, "sglang_router_port": int(port), "rollout_max_response_len": 1024,
                 "rollout_temperature": 1.0, "rollout_top_p": 1.0, "hf_checkpoint": qwen_tokenizer_path,
                 "num_epoch": 1, "use_wandb": False, "use_tensorboard": False}
        for key, value in slime.items():
            setattr(args, key, value)
        batch = generate_rollout(args, 0, DataBuffer(2))
    assert len(batch) == 2
    assert {g[0].index for g in batch} == {"plan-000", "plan-004"}
    for group_index, group in enumerate(batch):
        # One inner list per group: both episodes, planner and actor samples, more than n_samples_per_prompt.
        assert len(group) > 2 and len({s.index for s in group}) == 1
        by_episode: dict[str, list[Any]] = defaultdict(list)
        for s in group:
            assert s.group_index == group_index
            by_episode[s.metadata["episode_id"]].append(s)
        assert len(by_episode) == 2
        for samples in by_episode.values():
            roles = [s.metadata["agent_id"] for s in samples]
            assert roles.count("planner") == 1 and roles.count("actor") >= 1
            assert len({s.metadata["episode_reward"] for s in samples}) == 1
        for s in group:
            assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs) and sum(s.loss_mask) > 0
            assert s.metadata["raw_reward"] == s.metadata["episode_reward"] * s.metadata["reward_weight"]
        rewards = {ep: samples[0].metadata["episode_reward"] for ep, samples in by_episode.items()}
        for s in group:
            if len(set(rewards.values())) == 1:
                assert s.reward == 0.0
            else:
                mean = statistics.fmean(rewards.values())
                expected = (rewards[s.metadata["episode_id"]] - mean) / (statistics.pstdev(rewards.values()) + 1e-6)
                assert s.reward == pytest.approx(expected)


def test_demo_runs_plan_act(tmp_path: Path) -> None:
    rows = run_demo("--task", "plan_act", "--num-repeat", "2", "--batch-groups", "8", "--latency-ms", "1",
                    cwd=tmp_path)
    assert rows["groups delivered"] == "8" and rows["failed trajectories"] == "0"
    assert int(rows["samples"]) > 16, "an episode is a planner sample and actor samples"
    assert 0.0 < float(rows["mean reward (raw)"]) < 1.0
