"""The engine client against real sim engine subprocesses: tokens, resumes, retries, routing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from ops_helpers import math_rows, write_jsonl
from servers import free_port, running, sglang_router
from sim_engine_process import SimEngineProcess, sim_engines

from rollout_buffer.engine.client import EngineClient
from rollout_buffer.engine.limits import EngineLimits
from rollout_buffer.engine.results import EngineError, GenerateResult
from rollout_buffer.engine.sglang_wire import to_sglang_sampling_params
from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_sim.policy import Draw, scripted_reply
from rollout_sim.replies import token_logprob

RIGHT = Draw(correct=True, offset=1, invalid=False)
# Quick backoff, and no waiting out an outage: a failure past the retries is raised (`engine_outage_s` tested apart).
FAST = {"backoff_s": 0.01, "max_backoff_s": 0.05, "engine_outage_s": 0}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SimEngineProcess]]:
    args = ["--correct-rate", "1.0", "--latency-ms", "50"]
    with sim_engines(tmp_path_factory.mktemp("sim"), args, args) as procs:
        yield procs


@pytest.fixture(scope="module")
def im_end(qwen_tokenizer: Any) -> int:
    return qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")


def prompt(tokenizer: Any, question: str) -> list[int]:
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )
    return tokenizer.encode(text, add_special_tokens=False)


def long_prompt(tokenizer: Any, tokens: int) -> list[int]:
    """A chat prompt of exactly `tokens` tokens: "ok" filler (one token a word) before a question."""
    ids = prompt(tokenizer, "What is 2 + 2?")
    ids = prompt(tokenizer, "ok " * (tokens - len(ids)) + "What is 2 + 2?")
    assert len(ids) == tokens
    return ids


def run(coro: Any) -> Any:
    return asyncio.run(coro)


async def with_client(urls: list[str], call: Any, **kwargs: Any) -> Any:
    client = EngineClient(urls, **{**FAST, **kwargs})
    try:
        return await call(client)
    finally:
        await client.aclose()


def test_generate_returns_the_engines_tokens_and_logprobs(
    engines: list[SimEngineProcess], qwen_tokenizer: Any, im_end: int
) -> None:
    ids = prompt(qwen_tokenizer, "What is 17 + 25?")
    _, reply = scripted_reply(qwen_tokenizer.decode(ids), RIGHT)
    result = run(
        with_client([engines[0].url], lambda c: c.generate(ids, {"max_tokens": 256}, session_id="s"))
    )
    want = [*qwen_tokenizer.encode(reply, add_special_tokens=False), im_end]
    assert result.output_ids == want
    assert result.log_probs == [token_logprob(t, i) for i, t in enumerate(want)]
    assert result.text == reply and result.finish_reason == "stop"
    assert result.weight_version == "default" and result.engine_url == engines[0].url
    assert (result.attempts, result.resumed) == (1, 0)


def test_abort_resume_gives_the_uninterrupted_output(
    engines: list[SimEngineProcess], qwen_tokenizer: Any
) -> None:
    engine = engines[0]
    ids = prompt(qwen_tokenizer, "Compute 3 * (4 + 5).")

    async def both(client: EngineClient) -> tuple[Any, Any]:
        whole = await client.generate(ids, {"max_new_tokens": 200}, session_id="whole")
        engine.queue_faults("abort", "abort")
        resumed = await client.generate(ids, {"max_new_tokens": 200}, session_id="resumed")
        return whole, resumed

    whole, resumed = run(with_client([engine.url], both))
    assert resumed.resumed == 2 and resumed.attempts == 3 and resumed.finish_reason == "stop"
    assert resumed.output_ids == whole.output_ids
    assert resumed.log_probs == whole.log_probs
    assert resumed.text == whole.text
    sent = engine.requests()[-3:]
    first_cut = len(whole.output_ids) // 2
    assert [r["finish"] for r in sent] == ["abort", "abort", "stop"]
    assert sent[1]["prompt_tokens"] == len(ids) + first_cut
    assert sent[1]["max_new_tokens"] == 200 - first_cut
    assert sent[2]["prompt_tokens"] - len(ids) == 200 - sent[2]["max_new_tokens"]


def test_abort_is_reported_when_resumes_run_out(engines: list[SimEngineProcess], qwen_tokenizer: Any) -> None:
    engines[0].queue_faults("abort", "abort")

    async def call(client: EngineClient) -> tuple[Any, int]:
        result = await client.generate(prompt(qwen_tokenizer, "What is 8 * 8?"), {}, session_id="a")
        return result, client.stats.aborted_results

    result, aborted = run(with_client([engines[0].url], call, max_abort_resumes=1))
    assert result.finish_reason == "abort" and result.resumed == 1 and aborted == 1
    assert 0 < len(result.output_ids) == len(result.log_probs)


def test_5xx_is_retried_then_raised(engines: list[SimEngineProcess], qwen_tokenizer: Any) -> None:
    engine = engines[0]
    ids = prompt(qwen_tokenizer, "What is 1 + 1?")
    engine.queue_faults("http_500", "http_500")

    async def call(client: EngineClient) -> Any:
        ok = await client.generate(ids, {}, session_id="x")
        return ok, client.stats.snapshot()

    ok, stats = run(with_client([engine.url], call))
    assert ok.attempts == 3 and ok.finish_reason == "stop"
    assert stats["errors"] == {"http_5xx": 2} and stats["retries"] == 2
    engine.queue_faults("http_500", "http_500", "http_500")
    with pytest.raises(EngineError) as info:
        run(with_client([engine.url], lambda c: c.generate(ids, {}, session_id="x"), max_retries=2))
    err = info.value
    assert err.kind == "http_5xx" and err.attempts == 3 and err.status == 500
    assert (
        engine.url in str(err) and "3 attempt" in str(err) and "simulated internal server error" in str(err)
    )


def test_past_its_retries_an_engine_that_is_down_is_waited_for_until_the_outage_budget(
        engines: list[SimEngineProcess], qwen_tokenizer: Any) -> None:
    """An outage: five 500s with two retries wait (no new trajectory starts meanwhile), the sixth attempt answers;
    an engine that never answers fails the request once the outage outlasts its budget."""
    engine = engines[0]
    ids = prompt(qwen_tokenizer, "What is 3 + 3?")
    engine.queue_faults(*["http_500"] * 5)

    async def call(client: EngineClient) -> Any:
        task = asyncio.create_task(client.generate(ids, {}, session_id="o"))
        for _ in range(2000):  # bounded: the outage begins after the third failure, tens of ms in
            if client.outage.active:
                break
            await asyncio.sleep(0.005)
        seen = client.outage.snapshot()
        waiter = asyncio.create_task(client.outage.wait_clear())
        result = await task
        await asyncio.wait_for(waiter, 5)
        return result, seen, client.outage.snapshot()

    result, seen, after = run(with_client([engine.url], call, max_retries=2, engine_outage_s=60))
    assert result.attempts == 6 and result.finish_reason == "stop" and after is None
    assert seen["engines"] == [engine.url] and "http_5xx" in seen["error"] and seen["budget_s"] == 60
    dead = f"http://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(EngineError) as info:
        run(with_client([dead], lambda c: c.generate(ids, {}, session_id="d"), max_retries=1, engine_outage_s=0.3))
    assert info.value.kind == "outage" and "engine_outage_s=0.3" in str(info.value) and dead in str(info.value)
    assert time.monotonic() - start < 10


def test_timeouts_are_retried_then_raised(engines: list[SimEngineProcess], qwen_tokenizer: Any) -> None:
    engine = engines[1]
    ids = prompt(qwen_tokenizer, "What is 2 + 5?")
    engine.queue_faults("hang")
    ok = run(with_client([engine.url], lambda c: c.generate(ids, {}, session_id="t"), timeout_s=0.5))
    assert ok.attempts == 2 and ok.finish_reason == "stop"
    engine.queue_faults("hang", "hang")
    start = time.monotonic()
    with pytest.raises(EngineError) as info:
        run(
            with_client(
                [engine.url], lambda c: c.generate(ids, {}, session_id="t"), timeout_s=0.5, max_retries=1
            )
        )
    assert info.value.kind == "timeout" and info.value.attempts == 2
    assert time.monotonic() - start < 3


def test_reset_connections_and_truncated_json_are_retried(
    engines: list[SimEngineProcess], qwen_tokenizer: Any
) -> None:
    engine = engines[0]
    engine.queue_faults("reset", "truncated_json")

    async def call(client: EngineClient) -> Any:
        result = await client.generate(prompt(qwen_tokenizer, "What is 4 * 4?"), {}, session_id="r")
        return result, client.stats.snapshot()

    result, stats = run(with_client([engine.url], call))
    assert result.attempts == 3 and "\\boxed{16}" in result.text
    assert stats["errors"] == {"connection": 1, "bad_response": 1}


def test_4xx_is_not_retried_and_carries_the_engines_message(
    engines: list[SimEngineProcess], qwen_tokenizer: Any
) -> None:
    before = engines[0].generate_count()
    with pytest.raises(EngineError) as info:
        run(
            with_client(
                [engines[0].url],
                lambda c: c.generate(prompt(qwen_tokenizer, "Hi"), {"temperature": -1}, session_id="bad"),
            )
        )
    assert info.value.kind == "http_4xx" and info.value.attempts == 1 and info.value.status == 400
    assert "temperature" in str(info.value)
    assert engines[0].generate_count() == before + 1


def test_dead_engine_fails_with_connection_and_retries_move_to_a_live_one(
    engines: list[SimEngineProcess], qwen_tokenizer: Any
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    ids = prompt(qwen_tokenizer, "What is 9 - 4?")
    with pytest.raises(EngineError) as info:
        run(with_client([dead], lambda c: c.generate(ids, {}, session_id="d"), max_retries=1))
    assert info.value.kind == "connection" and info.value.attempts == 2 and dead in str(info.value)
    moved = run(with_client([dead, engines[0].url], lambda c: c.generate(ids, {}, session_id="d")))
    assert moved.engine_url == engines[0].url and moved.attempts == 2 and moved.finish_reason == "stop"


def test_least_in_flight_shares_load_and_sessions_stick(
    engines: list[SimEngineProcess], qwen_tokenizer: Any
) -> None:
    a, b = engines
    ids = prompt(qwen_tokenizer, "What is 6 + 6?")
    counts = a.generate_count(), b.generate_count()

    async def call(client: EngineClient) -> tuple[list[str], list[str], str]:
        spread = await asyncio.gather(*(client.generate(ids, {}, session_id=f"s{i}") for i in range(20)))
        sticky = [(await client.generate(ids, {}, session_id="same")).engine_url for _ in range(6)]
        client.release("same")
        after = (await client.generate(ids, {}, session_id="same")).engine_url
        return [r.engine_url for r in spread], sticky, after

    spread, sticky, after = run(with_client([a.url, b.url], call))
    assert spread.count(a.url) == spread.count(b.url) == 10
    assert len(set(sticky)) == 1 and after != sticky[0]
    delta = a.generate_count() - counts[0], b.generate_count() - counts[1]
    assert sorted(delta) == [11, 16]


def test_chat_completions(engines: list[SimEngineProcess]) -> None:
    messages = [{"role": "user", "content": "What is 17 + 25?"}]
    tools = [
        {
            "type": "function",
            "function": {
                "name": "calc",
                "description": "calculator",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]
    result = run(
        with_client(
            [engines[1].url],
            lambda c: c.chat(messages, {"max_tokens": 256, "temperature": 0.7}, session_id="c", tools=tools),
        )
    )
    assert result.text.endswith("\\boxed{42}.") and result.finish_reason == "stop"
    assert result.engine_url == engines[1].url and result.attempts == 1
    assert result.raw["usage"]["completion_tokens"] > 0
    short = run(
        with_client([engines[1].url], lambda c: c.chat(messages, {"max_new_tokens": 3}, session_id="c"))
    )
    assert short.finish_reason == "length"


def test_sampling_params_are_translated_for_sglang(
    engines: list[SimEngineProcess], qwen_tokenizer: Any
) -> None:
    openai_style = {
        "max_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "seed": 3,
        "n": 1,
        "logprobs": True,
        "user": "x",
        "stop": None,
        "include_stop_str_in_output": True,
    }
    assert to_sglang_sampling_params(openai_style) == {
        "max_new_tokens": 9,
        "temperature": 0.7,
        "top_p": 0.9,
        "sampling_seed": 3,
        "no_stop_trim": True,
    }
    assert to_sglang_sampling_params({"max_tokens": 9, "max_new_tokens": 5}) == {"max_new_tokens": 5}
    assert to_sglang_sampling_params({"max_tokens": 9}, max_new_tokens=4) == {"max_new_tokens": 4}
    with pytest.raises(ValueError, match="n must be 1"):
        to_sglang_sampling_params({"n": 4})
    result = run(
        with_client(
            [engines[0].url],
            lambda c: c.generate(prompt(qwen_tokenizer, "What is 3 + 4?"), openai_style, session_id="p"),
        )
    )
    assert result.finish_reason == "length" and len(result.output_ids) == 9


def test_a_thousand_concurrent_generations(engines: list[SimEngineProcess], qwen_tokenizer: Any) -> None:
    ids = prompt(qwen_tokenizer, "What is 7 * 6?")

    async def call(client: EngineClient) -> tuple[list[Any], dict[str, Any]]:
        results = await asyncio.gather(*(client.generate(ids, {}, session_id=f"c{i}") for i in range(1000)))
        return results, client.stats.snapshot()

    start = time.monotonic()
    results, stats = run(with_client([e.url for e in engines], call))
    assert time.monotonic() - start < 15  # 1000 x 50 ms would take 50 s one after another
    assert all(r.finish_reason == "stop" and "\\boxed{42}" in r.text for r in results)
    assert sorted(stats["requests_by_url"].values()) == [500, 500] and stats["in_flight"] == {}


# ---- what real SGLang does (the sim imitates it): context limits, refusal aborts, per-token weight versions

CONTEXT = 320


@pytest.fixture(scope="module")
def fidelity(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[SimEngineProcess]]:
    """A small-context engine, and one that spends 20 ms per output token (to act on requests mid-way)."""
    small = ["--correct-rate", "1.0", "--latency-ms", "5", "--context-length", str(CONTEXT)]
    slow = ["--correct-rate", "1.0", "--token-latency-ms", "20", "--sglang-version", "0.5.23"]
    with sim_engines(tmp_path_factory.mktemp("sim-fidelity"), small, slow) as procs:
        yield procs


def context(client: EngineClient, tokenizer: Any, max_tokens: int) -> RolloutContext:
    resources = RunResources(run_id="r", task_type="math", config={}, engine=client, tokenizer=tokenizer,
                             sampling_params={"max_tokens": max_tokens}, max_tokens=None)
    return RolloutContext(resources, "i", 0, 0, "uid")


@pytest.mark.parametrize("stream", [False, True])
def test_a_growing_multi_turn_prompt_is_clamped_then_truncated(
    fidelity: list[SimEngineProcess], qwen_tokenizer: Any, stream: bool
) -> None:
    engine = fidelity[0]
    before = len(engine.requests())

    async def call(client: EngineClient) -> tuple[list[str], dict[str, Any], dict[str, Any]]:
        ctx = context(client, qwen_tokenizer, 96)
        conv = await ctx.conversation([{"role": "user", "content": "What is 17 + 25?"}])
        finishes = []
        while not finishes or finishes[-1] == "stop":
            finishes.append(await ctx.generate(conv, on_delta=(lambda _: None) if stream else None))
            if finishes[-1] == "stop":
                conv.add_messages([{"role": "user", "content": "Check it again, step by step."}])
        return finishes, await ctx.trajectory(conv, 1.0, finishes[-1]), client.stats.snapshot()

    finishes, record, stats = run(with_client([engine.url], call))
    sent = engine.requests()[before:]
    assert finishes[-1] == "length" and len(finishes) > 2 and record["status"] == "truncated"
    assert all(r["prompt_tokens"] + r["max_new_tokens"] <= CONTEXT for r in sent)  # nothing the engine refuses
    assert sent[-1]["max_new_tokens"] < 96 and stats["clamped"] >= 1  # the last turn was cut to fit
    assert all(r["status_code"] is None for r in sent) and stats["errors"] == {}
    assert len(record["tokens"]) <= CONTEXT


def test_a_prompt_past_the_engines_max_input_is_not_sent(fidelity: list[SimEngineProcess], qwen_tokenizer: Any) -> None:
    engine = fidelity[0]
    before = engine.generate_count()
    # The engine's scheduler refuses prompts of CONTEXT - 6 tokens or more (max_req_input_len).
    ids = long_prompt(qwen_tokenizer, CONTEXT - 6)
    result = run(with_client([engine.url], lambda c: c.generate(ids, {"max_tokens": 16}, session_id="p")))
    assert result.context_full and result.finish_reason == "length" and result.attempts == 0
    assert engine.generate_count() == before


@pytest.mark.parametrize("stream", [False, True])
def test_a_400_refusal_abort_fails_once_with_its_reason(
    fidelity: list[SimEngineProcess], qwen_tokenizer: Any, stream: bool
) -> None:
    engine = fidelity[0]
    before = engine.generate_count()
    engine.queue_faults("refuse_400")

    async def call(client: EngineClient) -> EngineError:
        with pytest.raises(EngineError) as info:
            ids = prompt(qwen_tokenizer, "What is 3 + 3?")
            if stream:
                async for _ in client.generate_stream(ids, {"max_tokens": 64}, session_id="f"):
                    pass
            else:
                await client.generate(ids, {"max_tokens": 64}, session_id="f")
        return info.value

    error = run(with_client([engine.url], call))
    assert engine.generate_count() == before + 1  # not resent, not resumed
    assert (error.kind, error.status, error.attempts) == ("refused" if stream else "http_4xx", 400, 1)
    assert "exceeds the maximum allowed length" in error.reason


@pytest.mark.parametrize("stream", [False, True])
def test_a_503_refusal_is_retried_and_succeeds(
    fidelity: list[SimEngineProcess], qwen_tokenizer: Any, im_end: int, stream: bool
) -> None:
    engine = fidelity[0]
    before = engine.generate_count()
    engine.queue_faults("refuse_503")

    async def call(client: EngineClient) -> tuple[GenerateResult, dict[str, Any]]:
        ids = prompt(qwen_tokenizer, "What is 4 + 4?")
        if stream:
            streamed = client.generate_stream(ids, {"max_tokens": 128}, session_id="q")
            async for _ in streamed:
                pass
            return streamed.result, client.stats.snapshot()
        return await client.generate(ids, {"max_tokens": 128}, session_id="q"), client.stats.snapshot()

    result, stats = run(with_client([engine.url], call))
    assert result.finish_reason == "stop" and result.output_ids[-1] == im_end and "\\boxed{8}" in result.text
    assert (result.attempts, result.resumed) == (2, 0) and engine.generate_count() == before + 2
    assert stats["errors"] == {"http_5xx": 1} and stats["retries"] == 1


@pytest.mark.parametrize("stream", [False, True])
def test_a_weight_update_during_a_held_request_gives_per_token_versions(
    fidelity: list[SimEngineProcess], qwen_tokenizer: Any, stream: bool
) -> None:
    engine = fidelity[1]
    version = f"v{int(stream)}"

    async def call(client: EngineClient) -> GenerateResult:
        ids = prompt(qwen_tokenizer, "Compute 3 * (4 + 5).")
        if stream:
            streamed = client.generate_stream(ids, {"max_tokens": 200}, session_id="w")

            async def drain() -> GenerateResult:
                async for _ in streamed:
                    pass
                return streamed.result

            task = asyncio.create_task(drain())
        else:
            task = asyncio.create_task(client.generate(ids, {"max_tokens": 200}, session_id="w"))
        async with httpx.AsyncClient(base_url=engine.url, timeout=10) as control:
            # Some tokens out, not all: the request is in the engine (however long a busy machine took to send
            # it), then a few tokens' time passes.
            for _ in range(500):
                if (await control.get("/get_load")).json()[0]["num_reqs"]:
                    break
                await asyncio.sleep(0.02)
            else:
                raise AssertionError("the request never reached the engine")
            await asyncio.sleep(0.1)
            (await control.post("/pause_generation", json={"mode": "in_place"})).raise_for_status()
            (await control.post("/update_weight_version",
                                json={"new_version": version, "abort_all_requests": False})).raise_for_status()
            (await control.post("/continue_generation", json={})).raise_for_status()
        return await task

    result = run(with_client([engine.url], call))
    assert result.finish_reason == "stop" and result.resumed == 0 and result.attempts == 1
    (old_n, old), (new_n, new) = result.segments
    assert old != new == version == result.weight_version
    assert old_n > 0 and new_n > 0 and old_n + new_n == len(result.output_ids)


# ---- the same through the real sglang-router (Rust, 0.3.2) in front of two small-context engines


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[SimEngineProcess]]]:
    pytest.importorskip("sglang_router")
    tmp = tmp_path_factory.mktemp("sim-routed")
    small = ["--correct-rate", "1.0", "--latency-ms", "5", "--context-length", str(CONTEXT)]
    with sim_engines(tmp, small, small) as procs, sglang_router([p.url for p in procs], tmp / "router.log") as (url, _):
        yield url, procs


def test_through_the_router_the_context_of_its_workers_is_clamped(
    routed: tuple[str, list[SimEngineProcess]], qwen_tokenizer: Any
) -> None:
    router, procs = routed
    ids = long_prompt(qwen_tokenizer, CONTEXT - 20)  # room for 20 of the ~40 tokens of the reply
    too_long = long_prompt(qwen_tokenizer, CONTEXT - 6)  # the workers' max_req_input_len
    before = sum(p.generate_count() for p in procs)

    async def call(client: EngineClient) -> tuple[GenerateResult, GenerateResult, EngineLimits]:
        clamped = await client.generate(ids, {"max_tokens": 96}, session_id="c")
        full = await client.generate(too_long, {"max_tokens": 96}, session_id="c")
        return clamped, full, await client.limits(router)

    clamped, full, limits = run(with_client([router], call))
    assert limits == EngineLimits(CONTEXT, CONTEXT - 6, router=True, version="0.5.23")  # the router's first worker's
    assert clamped.finish_reason == "length" and clamped.attempts == 1
    assert full.context_full and full.attempts == 0
    sent = [r for p in procs for r in p.requests() if r["prompt_tokens"] == len(ids)]
    assert [r["max_new_tokens"] for r in sent] == [20] and sum(p.generate_count() for p in procs) == before + 1


@pytest.mark.parametrize("stream", [False, True])
def test_through_the_router_a_400_refusal_fails_at_once(
    routed: tuple[str, list[SimEngineProcess]], qwen_tokenizer: Any, stream: bool
) -> None:
    router, procs = routed
    before = sum(p.generate_count() for p in procs)
    for p in procs:  # whichever engine the router picks refuses
        p.queue_faults("refuse_400")

    async def call(client: EngineClient) -> list[EngineError]:
        errors = []
        for _ in procs:  # one request per engine, so that no queued fault is left behind
            with pytest.raises(EngineError) as info:
                ids = prompt(qwen_tokenizer, "What is 5 + 5?")
                if stream:
                    async for _ in client.generate_stream(ids, {"max_tokens": 64}, session_id=f"r{len(errors)}"):
                        pass
                else:
                    await client.generate(ids, {"max_tokens": 64}, session_id=f"r{len(errors)}")
            errors.append(info.value)
        return errors

    errors = run(with_client([router], call))
    assert sum(p.generate_count() for p in procs) == before + 2  # one request each: the router does not retry 400s
    for error in errors:
        assert (error.kind, error.status, error.attempts) == ("refused" if stream else "http_4xx", 400, 1)
        assert "exceeds the maximum allowed length" in error.reason


def test_through_the_router_a_streamed_503_refusal_is_retried(
    routed: tuple[str, list[SimEngineProcess]], qwen_tokenizer: Any
) -> None:
    router, procs = routed
    for p in procs:  # a 503 inside a 200 stream: the router passes it on, the client retries
        p.queue_faults("refuse_503")

    async def call(client: EngineClient) -> tuple[GenerateResult, dict[str, Any]]:
        streamed = client.generate_stream(prompt(qwen_tokenizer, "What is 6 + 6?"), {"max_tokens": 128},
                                          session_id="t")
        async for _ in streamed:
            pass
        return streamed.result, client.stats.snapshot()

    result, stats = run(with_client([router], call))
    assert result.finish_reason == "stop" and "\\boxed{12}" in result.text
    assert result.attempts == 3 and stats["errors"] == {"http_5xx": 2} and stats["retries"] == 2


def test_start_rollout_refuses_what_the_router_would_drop(
    routed: tuple[str, list[SimEngineProcess]], tmp_path: Path, qwen_tokenizer_path: str
) -> None:
    router, _ = routed
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(1))
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    base = {"task_type": "math", "input_file": str(inp), "remote_engine_url": router,
            "tokenizer_path": qwen_tokenizer_path}
    with running(args, "/healthz", port, tmp_path / "buffer.log") as buffer:
        dropped = httpx.post(f"{buffer.url}/start_rollout", timeout=30,
                             json={**base, "sampling_params": {"temperature": 1.0, "stop_regex": "\\n\\n"}})
        too_long = httpx.post(f"{buffer.url}/start_rollout", json={**base, "max_tokens": CONTEXT + 1}, timeout=30)
        fine = httpx.post(f"{buffer.url}/start_rollout", json={**base, "max_tokens": 64}, timeout=30)
    assert dropped.status_code == 422 and "sampling_params.stop_regex" in dropped.text, dropped.text
    assert "sglang-router" in dropped.text
    assert too_long.status_code == 422 and "max_tokens" in too_long.text, too_long.text
    assert fine.status_code == 200, fine.text
