"""What the trainer replays beside the tokens, end to end: a run asking for routed experts (MoE routing replay),
top-p kept ids and a teacher's log-probs gets them on every record, aligned with its tokens as slime aligns them,
on every path (a native run, the chat, Responses and Anthropic session endpoints with the official clients, a
rewritten history's branches, an aborted turn resumed, through sglang-router), and the slime adapter's samples
pass slime's own checks. The simulated engine answers them deterministically per token and position
(`rollout_sim.replay`), so each record is checked value by value; a run that asks for none stores and sends
nothing of them; an engine that does not return what was asked, or a teacher that is down, is what it is."""

from __future__ import annotations

import time
from argparse import Namespace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import pytest
from replay_checks import LAYERS, MOE, TOP_K, assert_replayed
from runs import drain, math_rows, start, wait_finished, write_jsonl
from servers import Server, buffer_server, free_port, running, session_host, sglang_router, sim_engine
from sessions import finish, open_session, record
from slime_src import needs_slime_src, slime_on_path

from slime_adapter.records import SampleBuilder
from slime_adapter.rollout import take_batch

SIGNALS = {"return_routed_experts": True, "sampling_params": {"temperature": 1.0, "top_p": 0.9}}
SIDE = ("rollout_routed_experts", "rollout_top_p_token_ids", "rollout_top_p_token_offsets", "teacher_log_probs")


@pytest.fixture(scope="module")
def moe_engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    """The policy engine: an MoE model's routing and top-p kept ids returned when asked."""
    with sim_engine(tmp_path_factory.mktemp("moe"), qwen_tokenizer_path, *MOE) as srv:
        yield srv


@pytest.fixture(scope="module")
def teacher(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("teacher"), qwen_tokenizer_path) as srv:
        yield srv


@pytest.fixture(scope="module")
def vocab(qwen_tokenizer: Any) -> int:
    return len(qwen_tokenizer)


def test_a_native_run_carries_every_signal_token_by_token(tmp_path: Path, moe_engine: Server, teacher: Server,
                                                          qwen_tokenizer_path: str, vocab: int) -> None:
    with buffer_server(tmp_path) as buffer:
        start(buffer.url, moe_engine.url, write_jsonl(tmp_path / "math.jsonl", math_rows(3)), qwen_tokenizer_path,
              num_repeat_per_sample=2, teacher_engine_url=teacher.url, **SIGNALS)
        status = wait_finished(buffer.url)
        records = drain(buffer.url)
    assert status["run"]["progress"]["failed"] == 0, status
    assert len(records) == 6
    for rec in records:
        assert_replayed(rec, vocab)
        assert rec["rollout_id"] == rec["uid"] and rec["extra_info"]["turns"] == 1


@pytest.mark.parametrize("where", [[], ["--session-workers", "1"]], ids=["in the buffer", "on a session worker"])
def test_the_session_endpoints_ask_for_them_on_every_turn(tmp_path: Path, moe_engine: Server, teacher: Server,
                                                          qwen_tokenizer_path: str, vocab: int, where: list[str]
                                                          ) -> None:
    """The official clients over several turns each (one of them streamed): every turn asks for the rows after
    those its branch holds, and the finished records hold them all, also those a session worker hands over."""
    with session_host(tmp_path, moe_engine.url, qwen_tokenizer_path, *where, teacher_engine_url=teacher.url,
                      **SIGNALS) as buffer:
        uids = [chat_turns(buffer.url), responses_turns(buffer.url), anthropic_turns(buffer.url)]
        records = [record(buffer.url, uid) for group in uids for uid in group]
    assert len(records) == 3
    for rec in records:
        assert_replayed(rec, vocab)
        assert rec["extra_info"]["turns"] >= 2


def chat_turns(url: str) -> list[str]:
    session = open_session(url, "chat")
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"])
    messages: list[Any] = [{"role": "user", "content": "What is 2 + 2?"}]
    for turn in range(3):
        if turn == 2:  # streamed: the rows come in the last event
            chunks = list(client.chat.completions.create(model="policy", messages=messages, stream=True))
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        else:
            text = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
        messages += [{"role": "assistant", "content": text}, {"role": "user", "content": f"And {turn} more?"}]
    return [str(u) for u in finish(url, session, 1.0)["uids"]]


def responses_turns(url: str) -> list[str]:
    session = open_session(url, "responses")
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"])
    first = client.responses.create(model="policy", input="What is 3 + 4?")
    client.responses.create(model="policy", input="And then?", previous_response_id=first.id)
    return [str(u) for u in finish(url, session, 1.0)["uids"]]


def anthropic_turns(url: str) -> list[str]:
    session = open_session(url, "anthropic")
    client = anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=session["api_key"])
    messages: list[Any] = [{"role": "user", "content": "What is 5 + 6?"}]
    for turn in range(2):
        reply = client.messages.create(model="policy", max_tokens=64, messages=messages)
        messages += [{"role": "assistant", "content": [b.model_dump() for b in reply.content]},
                     {"role": "user", "content": f"And {turn}?"}]
    return [str(u) for u in finish(url, session, 1.0)["uids"]]


def test_a_rewritten_history_gives_each_branch_its_own_rows_and_counters(
        tmp_path: Path, moe_engine: Server, qwen_tokenizer_path: str, vocab: int) -> None:
    """An agent that rewrites its history forks a branch: each branch's record holds the rows and kept ids of its
    own tokens, its own turns, and the trajectory's rollout id."""
    with session_host(tmp_path, moe_engine.url, qwen_tokenizer_path, **SIGNALS) as buffer:
        session = open_session(buffer.url, "fork")
        client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"])
        history: list[Any] = [{"role": "user", "content": "What is 2 + 2?"}]
        first = client.chat.completions.create(model="policy", messages=history).choices[0].message.content
        history.append({"role": "assistant", "content": first})
        for follow_up in ("Add 3.", "Subtract 1 instead."):  # the branch goes on, then its turn 2 is rewritten
            client.chat.completions.create(model="policy", messages=[*history, {"role": "user",
                                                                                "content": follow_up}])
        uids = finish(buffer.url, session, 1.0)["uids"]
        records = [record(buffer.url, uid) for uid in uids]
    assert len(records) == 2
    assert len({r["rollout_id"] for r in records}) == 1 and records[0]["rollout_id"] == session["uid"]
    for rec in records:
        assert_replayed(rec, vocab, teacher=False)
        assert rec["extra_info"]["turns"] == len([m for m in rec["messages"] if m["role"] == "assistant"])


def test_an_aborted_turn_resumes_with_its_rows_and_kept_ids_joined(tmp_path: Path, moe_engine: Server,
                                                                   qwen_tokenizer_path: str, vocab: int) -> None:
    httpx.post(f"{moe_engine.url}/sim/faults", json={"next": ["abort"]}, timeout=10).raise_for_status()
    with buffer_server(tmp_path) as buffer:
        start(buffer.url, moe_engine.url, write_jsonl(tmp_path / "math.jsonl", math_rows(1)), qwen_tokenizer_path,
              num_repeat_per_sample=1, num_process=1, **SIGNALS)
        wait_finished(buffer.url)
        [rec] = drain(buffer.url)
    assert rec["extra_info"]["abort_resumes"] == 1
    assert_replayed(rec, vocab, teacher=False)


def test_through_sglang_router_the_run_asks_its_workers(tmp_path: Path, moe_engine: Server,
                                                        qwen_tokenizer_path: str, vocab: int) -> None:
    """sglang-router drops return_routed_experts and custom_params from /generate: the run generates on the
    workers it lists, and says so when it starts."""
    with sglang_router([moe_engine.url], tmp_path / "router.log") as router, buffer_server(tmp_path) as buffer:
        started = httpx.post(f"{buffer.url}/start_rollout", timeout=30, json={
            "task_type": "math", "input_file": str(write_jsonl(tmp_path / "math.jsonl", math_rows(1))),
            "num_repeat_per_sample": 2, "remote_engine_url": router.url, "tokenizer_path": qwen_tokenizer_path,
            "max_tokens": 64, **SIGNALS})
        assert started.status_code == 200, started.text
        assert "the run generates on its workers directly" in started.json()["warnings"][0]
        wait_finished(buffer.url)
        records = drain(buffer.url)
    assert len(records) == 2
    for rec in records:
        assert_replayed(rec, vocab, teacher=False)


def test_a_run_that_asks_for_none_stores_and_sends_nothing_of_them(tmp_path: Path, moe_engine: Server,
                                                                   qwen_tokenizer_path: str) -> None:
    with buffer_server(tmp_path) as buffer:
        start(buffer.url, moe_engine.url, write_jsonl(tmp_path / "math.jsonl", math_rows(1)), qwen_tokenizer_path,
              num_repeat_per_sample=2)
        wait_finished(buffer.url)
        records = drain(buffer.url)
        requests = httpx.get(f"{moe_engine.url}/sim/requests", timeout=10).json()[-2:]
    assert all(not set(SIDE) & set(r) for r in records) and all(r["rollout_id"] == r["uid"] for r in records)
    assert all(r["prompt_tokens"] for r in requests)


def test_an_engine_that_returns_none_of_them_fails_naming_the_option_and_its_version(
        tmp_path: Path, qwen_tokenizer_path: str) -> None:
    """SGLang without --enable-return-routed-experts (or a dense model), or without top-p replay: each trajectory
    fails with the option and the engine's release, not an empty field."""
    with sim_engine(tmp_path, qwen_tokenizer_path) as plain, buffer_server(tmp_path) as buffer:
        for options, option in (({"return_routed_experts": True}, "return_routed_experts"),
                                ({"sampling_params": {"top_p": 0.8}}, "top_p_replay")):
            run_id = start(buffer.url, plain.url, write_jsonl(tmp_path / "math.jsonl", math_rows(1)),
                           qwen_tokenizer_path, num_repeat_per_sample=1, **options)
            status = wait_finished(buffer.url)
            assert status["run"]["progress"]["failures"] == {"engine_replay_missing": 1}, status
            failed = httpx.get(f"{buffer.url}/ui/api/trajectories", params={"run_id": run_id, "status": "failed"},
                               timeout=10).json()["items"]
            error = record(buffer.url, failed[0]["uid"])["extra_info"]["error"]
            assert f"{option}: engine {plain.url}" in error and "SGLang 0.5.23" in error, error


def test_a_teacher_that_is_down_is_an_outage_and_its_log_probs_come_once_it_is_up(
        tmp_path: Path, moe_engine: Server, qwen_tokenizer_path: str, vocab: int) -> None:
    port = free_port()
    teacher_url = f"http://127.0.0.1:{port}"
    with buffer_server(tmp_path) as buffer:
        start(buffer.url, moe_engine.url, write_jsonl(tmp_path / "math.jsonl", math_rows(1)), qwen_tokenizer_path,
              num_repeat_per_sample=1, teacher_engine_url=teacher_url, max_retries=1, **SIGNALS)
        deadline = time.monotonic() + 60
        while not (outage := (httpx.get(f"{buffer.url}/status").json()["run"]["progress"].get("engine_outage"))):
            assert time.monotonic() < deadline, "no outage was reported"
            time.sleep(0.05)
        assert outage["engines"] == [teacher_url]
        with running(["sim-engine", "--port", str(port), "--tokenizer", qwen_tokenizer_path], "/health", port,
                     tmp_path / "teacher.log"):
            status = wait_finished(buffer.url)
            [rec] = drain(buffer.url)
    assert status["run"]["progress"]["failed"] == 0
    assert_replayed(rec, vocab)


def test_what_cannot_be_asked_is_refused_at_the_start_naming_it(tmp_path: Path, moe_engine: Server,
                                                                qwen_tokenizer_path: str) -> None:
    inp = str(write_jsonl(tmp_path / "math.jsonl", math_rows(1)))
    base = {"task_type": "math", "input_file": inp, "remote_engine_url": moe_engine.url}
    with buffer_server(tmp_path, "--engine-host", "127.0.0.1") as buffer:
        for extra, status, field in (
                ({"return_routed_experts": True}, 422, "return_routed_experts: needs the run's exact tokens"),
                ({"return_routed_experts": "yes"}, 422, "return_routed_experts"),
                ({"teacher_engine_url": "ftp://teacher", "tokenizer_path": qwen_tokenizer_path}, 422,
                 "teacher_engine_url"),
                ({"teacher_engine_url": "http://10.9.9.9:1", "tokenizer_path": qwen_tokenizer_path}, 403,
                 "teacher_engine_url")):
            answer = httpx.post(f"{buffer.url}/start_rollout", json={**base, **extra}, timeout=30)
            assert answer.status_code == status and field in answer.json()["message"], answer.text


@needs_slime_src
def test_the_adapters_samples_pass_slimes_own_checks(tmp_path: Path, moe_engine: Server, teacher: Server,
                                                     qwen_tokenizer_path: str) -> None:
    """The adapter's samples from a session's records: routed experts shaped by slime's --num-layers and
    --moe-router-topk, top-p offsets one more than the response, teacher log-probs one per response token, and the
    branches of one session under one `rollout_id`; slime's validators (the pinned copy) accept them."""
    with session_host(tmp_path, moe_engine.url, qwen_tokenizer_path, teacher_engine_url=teacher.url,
                      **SIGNALS) as buffer:
        records = [record(buffer.url, uid) for uid in chat_turns(buffer.url) + chat_turns(buffer.url)]
    builder = SampleBuilder(lambda: None, "qwen", moe_shape=(LAYERS, TOP_K))
    samples = [builder.build(r) for r in records]
    batch = take_batch(_Buffer([samples]), 1)
    assert [s.rollout_routed_experts.shape for s in samples] == [(len(r["tokens"]) - 1, LAYERS, TOP_K)
                                                                 for r in records]
    assert all(len(s.rollout_top_p_token_offsets) == s.response_length + 1 for s in samples)
    assert all(len(s.teacher_log_probs) == s.response_length for s in samples)
    assert [s.rollout_id for s in batch[0]] == [0, 1]  # two sessions, one rollout each
    check_with_slime(samples)


class _Buffer:
    """slime's data buffer, as far as `take_batch` asks it."""

    def __init__(self, groups: list[list[Any]]):
        self.groups = groups

    def get_buffer_length(self) -> int:
        return len(self.groups)

    def get_samples(self, n: int) -> list[list[Any]]:
        taken, self.groups = self.groups[:n], self.groups[n:]
        return taken


def check_with_slime(samples: list[Any]) -> None:
    with slime_on_path():
        from slime.observability.rollout_data_utils import validate_rollout_routed_experts_for_replay
        from slime.utils.types import Sample

        args = Namespace(num_layers=LAYERS, moe_router_topk=TOP_K, moe_layer_freq=None)
        validate_rollout_routed_experts_for_replay([s.rollout_routed_experts for s in samples], args)
        for s in samples:
            fields = {k: getattr(s, k) for k in ("tokens", "response_length", "loss_mask", "rollout_log_probs",
                                                 "rollout_top_p_token_ids", "rollout_top_p_token_offsets",
                                                 "rollout_routed_experts", "teacher_log_probs", "rollout_id")}
            Sample(**fields)._validate_response_metadata_lengths()
