"""The engine client against real sim engine subprocesses: tokens, resumes, retries, routing."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from typing import Any

import pytest
from servers import free_port
from sim_engine_process import SimEngineProcess, sim_engines

from rollout_buffer.generation.engine import EngineClient, EngineError, to_sglang_sampling_params
from rollout_buffer.sim.engine import token_logprob
from rollout_buffer.sim.policy import Draw, scripted_reply

RIGHT = Draw(correct=True, offset=1, invalid=False)
FAST = {"backoff_s": 0.01, "max_backoff_s": 0.05}


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
