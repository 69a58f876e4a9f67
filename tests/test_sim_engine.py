"""The simulated SGLang engine over real HTTP: SGLang's shapes, scripted replies, limits and faults."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import httpx
import pytest
from servers import sglang_router
from sim_engine_process import SimEngineProcess, sim_engines

from rollout_sim.contract import Sampling, SimConfig
from rollout_sim.policy import Draw, scripted_reply
from rollout_sim.replies import token_logprob
from rollout_sim.server import build_parser
from rollout_sim.turns import TurnPlanner

RIGHT = Draw(correct=True, offset=1, invalid=False)
SEARCH_INSTRUCTIONS = (
    "Answer the given question. Call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. Give the final answer inside <answer> and "
    "</answer>. Question: who wrote the novel dune?\n"
)


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, SimEngineProcess]]:
    log_dir = tmp_path_factory.mktemp("sim")
    with sim_engines(
        log_dir,
        ["--correct-rate", "1.0", "--seed", "1"],
        ["--correct-rate", "0.0", "--seed", "2"],
        ["--correct-rate", "1.0", "--latency-ms", "1000"],
    ) as (right, wrong, slow):
        yield {"right": right, "wrong": wrong, "slow": slow}


@pytest.fixture(scope="module")
def right(engines: dict[str, SimEngineProcess]) -> SimEngineProcess:
    return engines["right"]


@pytest.fixture(scope="module")
def im_end(qwen_tokenizer: Any) -> int:
    return qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")


def prompt_ids(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def expected_ids(tokenizer: Any, ids: list[int], im_end: int) -> tuple[str, list[int]]:
    """The scripted right reply for a prompt, and its ids closed by <|im_end|>."""
    _, reply = scripted_reply(tokenizer.decode(ids), RIGHT)
    return reply, [*tokenizer.encode(reply, add_special_tokens=False), im_end]


def generate(engine: SimEngineProcess, ids: list[int], **fields: Any) -> httpx.Response:
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 256}, **fields}
    return httpx.post(engine.url + "/generate", json=payload, timeout=10)


def test_generate_answers_the_scripted_reply_in_sglang_shape(
    right: SimEngineProcess, qwen_tokenizer: Any, im_end: int
) -> None:
    ids = prompt_ids(qwen_tokenizer, "What is 17 + 25?")
    reply, want = expected_ids(qwen_tokenizer, ids, im_end)
    body = generate(right, ids, return_logprob=True).json()
    meta = body["meta_info"]
    assert body["output_ids"] == want and want[-1] == im_end
    assert qwen_tokenizer.decode(body["output_ids"]) == reply + "<|im_end|>"
    assert body["text"] == reply and reply.endswith("\\boxed{42}.")
    assert meta["finish_reason"] == {"type": "stop", "matched": im_end}
    assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(want)
    # SGLang's meta_info has no model name (the sim once added one); 0.5.23 adds the version spans.
    assert meta["weight_version"] == "default" and "model" not in meta
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": len(want)}]
    logprobs = meta["output_token_logprobs"]
    assert [e[1] for e in logprobs] == want
    assert all(isinstance(e[0], float) and e[0] < 0 and e[2] is None for e in logprobs)
    again = generate(right, ids, return_logprob=True).json()
    assert again["meta_info"]["output_token_logprobs"] == logprobs


def test_text_input_and_no_logprobs(right: SimEngineProcess, qwen_tokenizer: Any, im_end: int) -> None:
    ids = prompt_ids(qwen_tokenizer, "What is 9 * 9?")
    body = httpx.post(right.url + "/generate", json={"text": qwen_tokenizer.decode(ids)}, timeout=10).json()
    assert body["output_ids"] == expected_ids(qwen_tokenizer, ids, im_end)[1]
    assert "output_token_logprobs" not in body["meta_info"]


def test_max_new_tokens_cuts_with_finish_length(
    right: SimEngineProcess, qwen_tokenizer: Any, im_end: int
) -> None:
    ids = prompt_ids(qwen_tokenizer, "What is 12 - 5?")
    _, want = expected_ids(qwen_tokenizer, ids, im_end)
    body = generate(right, ids, sampling_params={"max_new_tokens": 7}, return_logprob=True).json()
    assert body["output_ids"] == want[:7]
    assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 7}
    assert body["text"] == qwen_tokenizer.decode(want[:7])
    assert len(body["meta_info"]["output_token_logprobs"]) == 7


def test_stop_strings_end_the_output_and_are_trimmed_from_text(
    right: SimEngineProcess, qwen_tokenizer: Any
) -> None:
    ids = prompt_ids(qwen_tokenizer, SEARCH_INSTRUCTIONS)
    params = {"max_new_tokens": 256, "stop": ["</search>", "</answer>"]}
    body = generate(right, ids, sampling_params=params).json()
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": "</search>"}
    assert qwen_tokenizer.decode(body["output_ids"]).endswith("</search>")
    assert body["text"].endswith("<search> who wrote the novel dune ")
    kept = generate(right, ids, sampling_params={**params, "no_stop_trim": True}).json()
    assert kept["text"].endswith("</search>")


def test_search_policy_searches_then_answers_from_information(
    right: SimEngineProcess, qwen_tokenizer: Any
) -> None:
    ids = prompt_ids(qwen_tokenizer, SEARCH_INSTRUCTIONS)
    first = generate(right, ids, sampling_params={"stop": ["</search>"], "no_stop_trim": True}).json()
    observation = '\n\n<information>Doc 1(Title: "Frank Herbert") Author of Dune.</information>\n\n'
    ids2 = ids + first["output_ids"] + qwen_tokenizer.encode(observation, add_special_tokens=False)
    second = generate(right, ids2).json()
    assert "<answer> Frank Herbert </answer>" in second["text"]


def test_wrong_engine_answers_wrong(engines: dict[str, SimEngineProcess], qwen_tokenizer: Any) -> None:
    for question, value in [
        ("What is 17 + 25?", "42"),
        ("Compute 3 * (4 + 5).", "27"),
        ("What is 8 - 3?", "5"),
    ]:
        text = generate(engines["wrong"], prompt_ids(qwen_tokenizer, question)).json()["text"]
        assert "\\boxed{" in text and f"\\boxed{{{value}}}" not in text


def test_sglang_refusals_are_4xx(right: SimEngineProcess, qwen_tokenizer: Any) -> None:
    ids = prompt_ids(qwen_tokenizer, "What is 1 + 2?")
    # 0.5.23's JSON contract refuses an unknown sampling parameter with a plain string error.
    r = generate(right, ids, sampling_params={"max_tokens": 5})
    assert r.status_code == 400 and r.json()["error"].startswith("unknown field `max_tokens`, expected one of")
    for params, words in [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"n": 2}, "n must be 1"),
    ]:
        r = generate(right, ids, sampling_params=params)
        assert r.status_code == 400 and words in r.json()["error"]["message"]
    assert httpx.post(right.url + "/generate", json={"sampling_params": {}}, timeout=5).status_code == 400
    assert generate(right, [10**7]).status_code == 400
    # A continued conversation: only what follows its earlier, checked request is checked, and it is.
    assert generate(right, ids).status_code == 200
    for bad in (10**7, -1):
        r = generate(right, [*ids, bad])
        assert r.status_code == 400 and "outside [0," in r.json()["error"]["message"], r.text
    assert generate(right, [*ids, 42]).status_code == 200


def test_chat_completions_openai_shape(right: SimEngineProcess, qwen_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": "Compute 3 * (4 + 5)."}]
    r = httpx.post(
        right.url + "/v1/chat/completions", json={"model": "any", "messages": messages}, timeout=10
    )
    body = r.json()
    choice = body["choices"][0]
    assert body["object"] == "chat.completion" and "simulated" in body["model"]
    assert choice["message"]["role"] == "assistant" and choice["message"]["content"].endswith("\\boxed{27}.")
    assert choice["finish_reason"] == "stop"
    rendered = qwen_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    n_prompt = len(qwen_tokenizer.encode(rendered, add_special_tokens=False))
    n_reply = len(qwen_tokenizer.encode(choice["message"]["content"], add_special_tokens=False)) + 1
    assert body["usage"] == {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_reply,
        "total_tokens": n_prompt + n_reply,
    }
    short = httpx.post(
        right.url + "/v1/chat/completions",
        json={"messages": messages, "max_tokens": 4, "logprobs": True},
        timeout=10,
    ).json()
    assert short["choices"][0]["finish_reason"] == "length" and short["usage"]["completion_tokens"] == 4
    assert len(short["choices"][0]["logprobs"]["content"]) == 4


def test_info_endpoints_report_a_local_model_path(right: SimEngineProcess, qwen_tokenizer_path: str) -> None:
    local = os.path.abspath(qwen_tokenizer_path)
    for path in ("/health", "/health_generate"):
        assert httpx.get(right.url + path, timeout=5).status_code == 200
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(right.url + path, timeout=5).json()
        assert (
            info["model_path"] == local and info["tokenizer_path"] == local and info["is_generation"] is True
        )
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(right.url + path, timeout=5).json()
        assert info["model_path"] == local and "simulated" in info["served_model_name"]
    models = httpx.get(right.url + "/v1/models", timeout=5).json()
    assert "simulated" in models["data"][0]["id"]
    assert httpx.get(right.url + "/get_load", timeout=5).json()[0]["num_reqs"] == 0


def test_abort_fault_returns_partial_output_that_resumes_to_the_full_reply(
    right: SimEngineProcess, qwen_tokenizer: Any, im_end: int
) -> None:
    ids = prompt_ids(qwen_tokenizer, "What is 31 + 11?")
    full = generate(right, ids, return_logprob=True).json()
    right.queue_faults("abort")
    cut = generate(right, ids, return_logprob=True).json()
    n = len(full["output_ids"]) // 2
    assert cut["meta_info"]["finish_reason"]["type"] == "abort"
    assert cut["output_ids"] == full["output_ids"][:n]
    assert cut["meta_info"]["output_token_logprobs"] == full["meta_info"]["output_token_logprobs"][:n]
    rest = generate(
        right, ids + cut["output_ids"], sampling_params={"max_new_tokens": 256 - n}, return_logprob=True
    ).json()
    assert cut["output_ids"] + rest["output_ids"] == full["output_ids"]
    lps = [
        e[0] for e in cut["meta_info"]["output_token_logprobs"] + rest["meta_info"]["output_token_logprobs"]
    ]
    assert lps == [token_logprob(t, i) for i, t in enumerate(full["output_ids"])]


def test_error_faults(right: SimEngineProcess, qwen_tokenizer: Any) -> None:
    ids = prompt_ids(qwen_tokenizer, "What is 2 + 2?")
    right.queue_faults("http_500", "truncated_json", "reset")
    r = generate(right, ids)
    assert r.status_code == 500 and "simulated" in r.json()["error"]["message"]
    r = generate(right, ids)
    assert r.status_code == 200
    with pytest.raises(ValueError):
        r.json()
    with pytest.raises((httpx.ReadError, httpx.RemoteProtocolError)):
        generate(right, ids)
    assert generate(right, ids).status_code == 200
    faults = right.stats()["faults"]
    assert faults["http_500"] >= 1 and faults["truncated_json"] >= 1 and faults["reset"] >= 1


def test_hang_fault_outlasts_the_client_timeout(right: SimEngineProcess, qwen_tokenizer: Any) -> None:
    right.queue_faults("hang")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            right.url + "/generate",
            json={"input_ids": prompt_ids(qwen_tokenizer, "What is 1 + 1?")},
            timeout=0.5,
        )


def test_unknown_fault_kind_is_refused(right: SimEngineProcess) -> None:
    r = httpx.post(right.url + "/sim/faults", json={"next": ["explode"]}, timeout=5)
    assert r.status_code == 400 and "explode" in r.json()["error"]["message"]


def test_abort_request_cuts_running_requests(
    engines: dict[str, SimEngineProcess], qwen_tokenizer: Any, im_end: int
) -> None:
    slow = engines["slow"]
    ids = prompt_ids(qwen_tokenizer, "What is 40 + 2?")
    full = len(expected_ids(qwen_tokenizer, ids, im_end)[1])

    async def run() -> list[dict[str, Any]]:
        async with httpx.AsyncClient(timeout=10) as client:
            pending = [
                asyncio.create_task(client.post(slow.url + "/generate", json={"input_ids": ids}))
                for _ in range(3)
            ]
            for _ in range(100):  # until the three are running (bounded: 100 x 10 ms)
                load = (await client.get(slow.url + "/get_load")).json()[0]
                if load["num_reqs"] == 3:
                    break
                await asyncio.sleep(0.01)
            await client.post(slow.url + "/abort_request", json={"abort_all": True})
            return [(await t).json() for t in pending]

    for body in asyncio.run(run()):
        assert body["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(body["output_ids"]) < full


def test_update_weight_version(engines: dict[str, SimEngineProcess], qwen_tokenizer: Any) -> None:
    engine = engines["wrong"]
    r = httpx.post(engine.url + "/update_weight_version", json={"new_version": "step-7"}, timeout=5)
    assert r.json()["success"] is True
    body = generate(engine, prompt_ids(qwen_tokenizer, "What is 3 + 3?")).json()
    assert body["meta_info"]["weight_version"] == "step-7"
    assert httpx.get(engine.url + "/model_info", timeout=5).json()["weight_version"] == "step-7"


def test_pause_generation_aborts_or_holds_and_new_requests_wait(
    engines: dict[str, SimEngineProcess], qwen_tokenizer: Any
) -> None:
    """SGLang's /pause_generation modes and /continue_generation on the 1 s engine, in SGLang's answer shapes."""
    slow = engines["slow"]
    ids = prompt_ids(qwen_tokenizer, "What is 6 + 7?")

    async def running(client: httpx.AsyncClient, n: int) -> None:
        for _ in range(200):  # bounded: 200 x 10 ms
            if (await client.get(slow.url + "/get_load")).json()[0]["num_reqs"] == n:
                return
            await asyncio.sleep(0.01)
        raise AssertionError(f"{n} requests never ran")

    async def control(client: httpx.AsyncClient, path: str, body: dict | None = None) -> dict:
        r = await client.post(slow.url + path, json=body or {})
        assert r.status_code == 200, r.text
        return r.json()

    async def run() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            post = lambda: asyncio.create_task(client.post(slow.url + "/generate", json={"input_ids": ids}))  # noqa: E731
            try:
                # abort: the running request answers at once with its partial output and the old version.
                first = post()
                await running(client, 1)
                await asyncio.sleep(0.3)
                assert await control(client, "/pause_generation", {"mode": "abort"}) == {
                    "message": "Generation paused successfully.", "status": "ok"}
                aborted = (await first).json()
                assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
                assert 0 < len(aborted["output_ids"]) and aborted["meta_info"]["weight_version"] == "default"
                # A request sent while paused waits; it runs with the weights set before generation continues.
                waiting = post()
                await asyncio.sleep(0.3)
                assert not waiting.done()
                await control(client, "/update_weight_version", {"new_version": "9"})
                assert (await control(client, "/continue_generation")) == {
                    "message": "Generation continued successfully.", "status": "ok"}
                done = (await waiting).json()
                assert done["meta_info"]["finish_reason"]["type"] == "stop"
                assert done["meta_info"]["weight_version"] == "9"
                # in_place: the running request is held (its time stands still) and finishes after continue.
                held = post()
                await running(client, 1)
                await control(client, "/pause_generation", {"mode": "in_place"})
                await asyncio.sleep(1.2)  # longer than the engine's 1 s latency
                assert not held.done()
                await control(client, "/continue_generation")
                assert (await held).json()["meta_info"]["finish_reason"]["type"] == "stop"
                bad = await client.post(slow.url + "/pause_generation", json={"mode": "sideways"})
                assert bad.status_code == 400 and "mode" in bad.json()["message"]
            finally:
                await client.post(slow.url + "/continue_generation", json={})

    asyncio.run(run())


def test_stats_count_requests_by_endpoint(engines: dict[str, SimEngineProcess], qwen_tokenizer: Any) -> None:
    engine = engines["wrong"]
    before = engine.stats()
    generate(engine, prompt_ids(qwen_tokenizer, "What is 5 + 5?"))
    httpx.post(
        engine.url + "/v1/chat/completions",
        json={"messages": [{"role": "user", "content": "Hi"}]},
        timeout=10,
    )
    after = engine.stats()
    assert after["requests"] - before["requests"] == 2
    assert after["by_endpoint"]["/generate"] - before["by_endpoint"]["/generate"] == 1
    assert (
        after["by_endpoint"]["/v1/chat/completions"] - before["by_endpoint"].get("/v1/chat/completions", 0)
        == 1
    )
    last = engine.requests()[-1]
    assert last["endpoint"] == "/v1/chat/completions" and last["finish"] == "stop"


def test_a_thousand_concurrent_requests_overlap(
    engines: dict[str, SimEngineProcess], qwen_tokenizer: Any
) -> None:
    slow = engines["slow"]
    payload = {"input_ids": prompt_ids(qwen_tokenizer, "What is 6 * 7?")}

    async def run() -> list[int]:
        # aiohttp: httpx's pool costs milliseconds per request at this concurrency and would be measured.
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1000)) as session:

            async def one() -> int:
                async with session.post(slow.url + "/generate", json=payload) as r:
                    await r.read()
                    return r.status

            return await asyncio.gather(*(one() for _ in range(1000)))

    assert asyncio.run(run()) == [200] * 1000
    # Overlapped, not serialized: counted by the engine, not timed (a busy machine sends them more slowly).
    assert slow.stats()["max_in_flight"] >= 100



def test_real_sglang_router_in_front_of_two_sim_engines(
    engines: dict[str, SimEngineProcess], qwen_tokenizer: Any, tmp_path: Path
) -> None:
    pytest.importorskip("sglang_router")
    right, wrong = engines["right"], engines["wrong"]
    ids = prompt_ids(qwen_tokenizer, "What is 17 + 25?")
    before = right.generate_count(), wrong.generate_count()
    with sglang_router([right.url, wrong.url], tmp_path / "router.log") as (url, _):
        bodies = [
            httpx.post(url + "/generate", json={"input_ids": ids, "return_logprob": True}, timeout=10).json()
            for _ in range(4)
        ]
        chat = httpx.post(
            url + "/v1/chat/completions",
            json={"model": "sim-engine (simulated)", "messages": [{"role": "user", "content": "Hi"}]},
            timeout=10,
        )
    assert (right.generate_count() - before[0], wrong.generate_count() - before[1]) == (2, 2)
    assert all(len(b["meta_info"]["output_token_logprobs"]) == len(b["output_ids"]) for b in bodies)
    assert chat.status_code == 200 and "simulated" in chat.json()["model"]


def test_a_growing_conversation_is_planned_as_from_scratch(qwen_tokenizer: Any, qwen_tokenizer_path: str) -> None:
    # The engine decodes and keys a conversation's prompt from where its previous request left off; each turn
    # plans what an engine seeing the prompt for the first time plans, and a continued turn goes on with its reply.
    def engine() -> TurnPlanner:
        return TurnPlanner(SimConfig(tokenizer_path=qwen_tokenizer_path, correct_rate=1.0), qwen_tokenizer)

    grown, sampling = engine(), Sampling(max_new_tokens=512)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You compute. 日本語 ✓"},
                                      {"role": "user", "content": "What is (12 - 4) * 3?"}]
    for turn in range(4):
        ids = qwen_tokenizer.encode(qwen_tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                                      tokenize=False), add_special_tokens=False)
        planned = grown.plan_turn(ids, sampling, 512, grown.prefixes.find(ids))
        fresh = engine().plan_turn(ids, sampling, 512, None)
        assert (planned.policy, planned.output_ids) == (fresh.policy, fresh.output_ids)
        assert planned.policy == "math" and "\\boxed{24}" in qwen_tokenizer.decode(planned.output_ids)
        continued = grown.plan_turn(ids + planned.output_ids[:5], sampling, 512,
                                    grown.prefixes.find(ids + planned.output_ids[:5]))
        assert continued.output_ids == planned.output_ids[5:]
        assert grown.prompt_text(ids, grown.prefixes.find(ids)) == qwen_tokenizer.decode(ids)
        reply = qwen_tokenizer.decode(planned.output_ids, skip_special_tokens=True)
        # A tool's output with no arithmetic (emoji and a split multi-byte character's neighbours), so the
        # expression is found in the first user turn, through the remembered text.
        messages += [{"role": "assistant", "content": reply},
                     {"role": "user", "content": f"Output {turn}: 🎉 naïve café — Ω≈ç √ {'x' * 50 * turn}"}]


def test_cli_rejects_rates_outside_0_1() -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--port", "1", "--abort-rate", "1.5"])
    args = build_parser().parse_args(["--port", "1", "--error-kinds", "http_500,reset"])
    assert args.error_kinds == ("http_500", "reset")
