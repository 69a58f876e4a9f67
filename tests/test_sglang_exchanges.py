"""The engine client against recorded SGLang exchanges (tests/fixtures/sglang/*.json).

Each fixture is what a real SGLang engine (or sglang-router) answers, written from its sources, which its `source`
field cites, or (`real_*.json`) recorded from real SGLang on this CPU by `real_sglang/record_exchanges.py`: the
requests the client should send (`expect`: values by dotted path, null for "absent") and the answers, a JSON body
or a list of server-sent events. A scripted server on 127.0.0.1 replays them in order, so these tests hold the
client to SGLang's wire behaviour rather than to the simulator's; when SGLang changes, the fixture changes.
"""

from __future__ import annotations

import asyncio
import base64
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from rollout_buffer.engine.client import EngineClient
from rollout_buffer.engine.limits import EngineLimits, probe_engine
from rollout_buffer.engine.replay import ReplayAsk
from rollout_buffer.engine.results import EngineError, GenerateResult
from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.options import check_engine_options
from rollout_buffer.tokens.conversation import Conversation

FIXTURES = Path(__file__).parent / "fixtures" / "sglang"
FAST = {"backoff_s": 0.01, "max_backoff_s": 0.05}


class Replay:
    """Serves one fixture at a time: GETs from its `engine` map (404 otherwise), POSTs from its `exchanges` in
    order; records what the client sent."""

    def __init__(self, url: str):
        self.url = url
        self.fixture: dict[str, Any] = {"exchanges": []}
        self.received: list[tuple[str, dict[str, Any]]] = []

    def load(self, name: str) -> dict[str, Any]:
        text = (FIXTURES / f"{name}.json").read_text().replace("{self}", self.url)
        self.fixture, self.received = orjson.loads(text), []
        return self.fixture

    async def handle(self, request: Request) -> Response:
        path = request.url.path
        if request.method == "GET":
            answer = self.fixture.get("engine", {}).get(path)
            return _response(answer) if answer else Response(status_code=404)
        self.received.append((path, orjson.loads(await request.body())))
        exchanges = self.fixture["exchanges"]
        if len(self.received) > len(exchanges):
            return Response(b'{"error": "no more recorded exchanges"}', status_code=500)
        return _response(exchanges[len(self.received) - 1]["response"])

    def check_requests(self) -> None:
        """Every recorded exchange was asked for, with what its `expect` says."""
        exchanges = self.fixture["exchanges"]
        assert len(self.received) == len(exchanges), f"{len(self.received)} requests for {len(exchanges)} exchanges"
        for (path, body), exchange in zip(self.received, exchanges, strict=True):
            want = exchange["request"]
            assert path == want["path"]
            for key, value in want.get("expect", {}).items():
                assert _dig(body, key) == value, f"{key}: sent {_dig(body, key)!r}, fixture expects {value!r}"


def _response(answer: dict[str, Any]) -> Response:
    headers = answer.get("headers", {})
    if "events" not in answer:
        return Response(orjson.dumps(answer["body"]), status_code=answer["status"], headers=headers)

    async def events() -> AsyncIterator[bytes]:
        for event in answer["events"]:
            yield b"data: " + (b"[DONE]" if event == "[DONE]" else orjson.dumps(event)) + b"\n\n"

    return StreamingResponse(events(), status_code=answer["status"], headers=headers)


def _dig(body: dict[str, Any], dotted: str) -> Any:
    value: Any = body
    for part in dotted.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


@pytest.fixture(scope="module")
def replay() -> Iterator[Replay]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scripted = Replay(f"http://127.0.0.1:{port}")
    app = Starlette(routes=[Route("/{path:path}", scripted.handle, methods=["GET", "POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline, "replay server did not start"
        time.sleep(0.01)
    yield scripted
    server.should_exit = True
    thread.join(5)


def fixture_value(name: str, *path: str | int) -> Any:
    value: Any = orjson.loads((FIXTURES / f"{name}.json").read_bytes())
    for part in path:
        value = value[part]
    return value


PROMPT: list[int] = fixture_value("generate_logprobs", "exchanges", 0, "request", "expect", "input_ids")
ANSWER: list[int] = fixture_value("generate_logprobs", "exchanges", 0, "response", "body", "output_ids")


async def generate(client: EngineClient, params: dict[str, Any], *, stream: bool = False,
                   prompt: list[int] = PROMPT, return_logprob: bool = True) -> GenerateResult:
    if not stream:
        return await client.generate(prompt, params, session_id="s", return_logprob=return_logprob)
    result = client.generate_stream(prompt, params, session_id="s", return_logprob=return_logprob)
    deltas = [d async for d in result]
    assert [t for d in deltas for t in d.output_ids] == result.result.output_ids
    return result.result


def run(replay: Replay, call: Any, **options: Any) -> Any:
    async def main() -> Any:
        client = EngineClient([replay.url], **{**FAST, **options})
        try:
            return await call(client)
        finally:
            await client.aclose()

    return asyncio.run(main())


def test_every_fixture_cites_its_source() -> None:
    for path in FIXTURES.glob("*.json"):
        fixture = orjson.loads(path.read_bytes())
        assert fixture["source"].startswith(("sglang 0.5.", "sgl-router")), path.name


def test_generate_with_logprobs(replay: Replay) -> None:
    body = replay.load("generate_logprobs")["exchanges"][0]["response"]["body"]
    result = run(replay, lambda c: generate(c, {"max_new_tokens": 64}))
    replay.check_requests()
    assert result.output_ids == ANSWER and result.text == body["text"] and result.finish_reason == "stop"
    assert result.log_probs == [e[0] for e in body["meta_info"]["output_token_logprobs"]]
    assert result.weight_version == "default" and result.segments == [(len(ANSWER), "default")]
    assert (result.attempts, result.resumed, result.context_full) == (1, 0, False)


def test_stream_with_several_tokens_per_event(replay: Replay) -> None:
    events = replay.load("generate_stream")["exchanges"][0]["response"]["events"]
    result = run(replay, lambda c: generate(c, {}, stream=True))
    replay.check_requests()
    assert result.output_ids == ANSWER and result.text == events[-2]["text"] and result.finish_reason == "stop"
    assert len(result.log_probs) == len(ANSWER) and result.attempts == 1


def test_an_abort_by_a_weight_update_is_resumed_and_concatenated(replay: Replay) -> None:
    replay.load("abort_resume")
    result = run(replay, lambda c: generate(c, {"max_new_tokens": 64}))
    replay.check_requests()  # the resume sent prompt + the 3 tokens, with 61 new tokens
    assert result.output_ids == ANSWER and result.text == "The answer is \\boxed{4}." and result.finish_reason == "stop"
    assert (result.resumed, result.attempts) == (1, 2)
    assert result.segments == [(3, "1"), (len(ANSWER) - 3, "2")] and result.weight_version == "2"
    assert result.mid_request == [], "a resume is a new request: its prefix is computed again"


def test_a_streamed_abort_in_the_waiting_queue_is_resumed_from_all_its_tokens(replay: Replay) -> None:
    replay.load("abort_resume_stream")  # its abort event holds the last id only, and the whole text
    result = run(replay, lambda c: generate(c, {"max_new_tokens": 64}, stream=True))
    replay.check_requests()  # resumed from the 5 tokens generated, not the 3 streamed before the abort
    assert result.output_ids == ANSWER and result.text == "The answer is \\boxed{4}." and result.resumed == 1
    assert len(result.log_probs) == len(ANSWER) and result.segments == [(5, "1"), (len(ANSWER) - 5, "2")]


@pytest.mark.parametrize(("name", "stream", "kind"), [("refusal_400_stream", True, "refused"),
                                                       ("refusal_400", False, "http_4xx")])
def test_a_400_refusal_fails_at_once_with_the_engines_message(replay: Replay, name: str, stream: bool,
                                                              kind: str) -> None:
    replay.load(name)

    async def call(client: EngineClient) -> tuple[EngineError, dict[str, Any]]:
        with pytest.raises(EngineError) as info:
            await generate(client, {}, stream=stream)
        return info.value, client.stats.snapshot()

    error, stats = run(replay, call)
    replay.check_requests()  # one request: not resumed, not retried
    assert (error.kind, error.status, error.attempts) == (kind, 400, 1)
    assert "logprob_start_len=40 is higher than the number of input tokens" in error.reason
    assert stats["errors"] == {kind: 1} and stats["retries"] == 0 and stats["aborts_resumed"] == 0


@pytest.mark.parametrize(("name", "stream"), [("refusal_503_stream", True), ("refusal_503", False)])
def test_a_503_refusal_is_retried(replay: Replay, name: str, stream: bool) -> None:
    replay.load(name)

    async def call(client: EngineClient) -> tuple[GenerateResult, dict[str, Any]]:
        return await generate(client, {}, stream=stream), client.stats.snapshot()

    result, stats = run(replay, call)
    replay.check_requests()
    assert result.output_ids == ANSWER and result.finish_reason == "stop"
    assert (result.attempts, result.resumed) == (2, 0)
    assert stats["errors"] == {"http_5xx": 1} and stats["retries"] == 1 and stats["aborts_resumed"] == 0


def test_a_503_refusal_fails_once_retries_run_out(replay: Replay) -> None:
    replay.load("refusal_503_stream")

    async def call(client: EngineClient) -> EngineError:
        with pytest.raises(EngineError) as info:
            await generate(client, {}, stream=True)
        return info.value

    error = run(replay, call, max_retries=0)
    assert (error.kind, error.status) == ("http_5xx", 503) and "The request queue is full." in error.reason
    assert len(replay.received) == 1


def test_a_context_overflow_teaches_the_context_and_is_fitted(replay: Replay) -> None:
    replay.load("context_overflow")

    async def call(client: EngineClient) -> tuple[GenerateResult, EngineLimits, dict[str, Any]]:
        result = await generate(client, {"max_new_tokens": 16}, return_logprob=False)
        return result, await client.limits(replay.url), client.stats.snapshot()

    result, limits, stats = run(replay, call)
    replay.check_requests()  # 16 refused (HTTP 400), then 8: what fits 24
    assert result.output_ids == ANSWER[:8] and result.finish_reason == "length" and not result.context_full
    assert limits.context_length == 24 and stats["errors"] == {"http_4xx": 1}


def test_a_prompt_that_fills_the_context_is_truncated_not_failed(replay: Replay, qwen_tokenizer: Any) -> None:
    replay.load("context_input_too_long_stream")

    async def call(client: EngineClient) -> tuple[GenerateResult, str, dict[str, Any]]:
        result = await generate(client, {"max_new_tokens": 16}, stream=True)
        # The same through a generator's context: the turn ends "length" and the record is truncated.
        ctx = context(client, qwen_tokenizer)
        conv = await ctx.conversation([{"role": "user", "content": "What is 2 + 2?"}])
        assert conv.generation_ids() == PROMPT
        finish = await ctx.generate(conv, on_delta=lambda _: None)
        record = await ctx.trajectory(conv, 0.0, finish)
        assert conv.messages[-1]["role"] == "user"  # no assistant turn was added
        return result, record["status"], client.stats.snapshot()

    result, status, stats = run(replay, call)
    assert len(replay.received) == 1  # the refused stream; the second turn was not sent: the context is known now
    assert result.context_full and result.finish_reason == "length" and result.output_ids == []
    assert status == "truncated" and stats["context_full"] == 2


def test_the_schedulers_input_limit_refusal_is_truncated_not_failed(replay: Replay) -> None:
    replay.load("input_limit_stream")

    async def call(client: EngineClient) -> tuple[GenerateResult, GenerateResult, EngineLimits]:
        first = await generate(client, {"max_new_tokens": 16}, stream=True)
        again = await generate(client, {"max_new_tokens": 16}, stream=True)
        return first, again, await client.limits(replay.url)

    first, again, limits = run(replay, call)
    replay.check_requests()  # the refused stream only
    assert first.context_full and first.finish_reason == "length" and first.output_ids == []
    assert again.context_full and again.attempts == 0 and limits.max_input_tokens == 16


def test_a_reported_context_is_clamped_before_sending(replay: Replay) -> None:
    replay.load("context_reported")

    async def call(client: EngineClient) -> tuple[GenerateResult, GenerateResult, EngineLimits, dict[str, Any]]:
        clamped = await generate(client, {"max_new_tokens": 16}, return_logprob=False)
        # 18 prompt tokens: the engine's max_req_input_len, which its scheduler refuses.
        full = await generate(client, {"max_new_tokens": 16}, prompt=PROMPT + ANSWER[:2], return_logprob=False)
        return clamped, full, await client.limits(replay.url), client.stats.snapshot()

    clamped, full, limits, stats = run(replay, call)
    replay.check_requests()  # one request, with max_new_tokens 8
    assert clamped.output_ids == ANSWER[:8] and clamped.finish_reason == "length"
    assert full.context_full and full.attempts == 0 and full.finish_reason == "length"
    assert limits == EngineLimits(24, 18, version="0.5.15.post1")
    assert stats["clamped"] == 1 and stats["context_full"] == 1


def test_a_run_option_overrides_the_reported_context(replay: Replay) -> None:
    replay.load("context_reported")
    result = run(replay, lambda c: generate(c, {"max_new_tokens": 16}, prompt=PROMPT + ANSWER[:2]),
                 context_length=17)
    assert result.context_full and replay.received == []


@pytest.mark.parametrize("stream", [False, True])
def test_weight_version_spans_become_per_token_versions(replay: Replay, qwen_tokenizer: Any, stream: bool) -> None:
    replay.load("weight_versions_stream" if stream else "weight_versions")

    async def call(client: EngineClient) -> tuple[GenerateResult, dict[str, Any]]:
        result = await generate(client, {}, stream=stream)
        replay.load("weight_versions_stream" if stream else "weight_versions")
        ctx = context(client, qwen_tokenizer, mask_offpolicy=True)
        conv = await ctx.conversation([{"role": "user", "content": "What is 2 + 2?"}])
        finish = await ctx.generate(conv, on_delta=(lambda _: None) if stream else None)
        return result, await ctx.trajectory(conv, 1.0, finish)

    result, record = run(replay, call)
    assert result.output_ids == ANSWER and result.weight_version == "4"
    assert result.segments == [(4, "3"), (len(ANSWER) - 4, "4")] and result.mid_request == [1]
    n = len(PROMPT)
    info = record["extra_info"]
    assert info["weight_version_spans"] == [[n, n + 4, "3"], [n + 4, n + len(ANSWER), "4"]]
    # Version 4's tokens came within the same request, over the KV cache version 3 computed: the record says so.
    assert info["mid_request_update_spans"] == [[n + 4, n + len(ANSWER), "4"]]
    assert (info["weight_version_min"], info["weight_version_max"]) == ("3", "4")
    assert record["weight_versions"] == ["3", "4"]
    # mask_offpolicy: the tokens of version 3 get loss 0, those of version 4 keep it.
    assert record["loss_mask"][n:n + len(ANSWER)] == [0] * 4 + [1] * (len(ANSWER) - 4)


# ---- exchanges recorded from real SGLang (real_sglang/record_exchanges.py), not written from its sources


def real_answer(name: str, k: int = 0) -> dict[str, Any]:
    body: dict[str, Any] = fixture_value(name, "exchanges", k, "response", "body")
    return body


def test_real_a_stop_string_keeps_the_token_that_holds_it(replay: Replay, qwen_tokenizer: Any) -> None:
    """Real SGLang ends the text before the stop string and keeps the token holding it: the turn is those tokens at
    loss 1, closed by the template's end of turn at loss 0 (the engine never generated it)."""
    replay.load("real_stop_string")
    result = run(replay, lambda c: generate(c, {"max_new_tokens": 64, "temperature": 0, "stop": ["e"]}))
    replay.check_requests()
    answer = real_answer("real_stop_string")
    assert result.output_ids == answer["output_ids"] and result.text == answer["text"] == "左右.s"
    assert result.finish_reason == "stop" and qwen_tokenizer.decode(result.output_ids) == "左右.setter"
    conv = Conversation([{"role": "user", "content": "What is 2 + 2?"}], qwen_tokenizer)
    assert conv.generation_ids() == PROMPT
    conv.add_assistant(result.output_ids, result.log_probs, result.text, finish_reason=result.finish_reason)
    closing = qwen_tokenizer.encode("<|im_end|>\n", add_special_tokens=False)
    assert conv.token_ids == PROMPT + result.output_ids + closing and not conv.truncated
    assert conv.loss_mask[len(PROMPT):] == [1] * len(result.output_ids) + [0] * len(closing)


def test_real_an_abort_resume_across_a_weight_update(replay: Replay) -> None:
    """Aborted mid-answer by a pause, checkpoint B loaded, resumed from the partial output: the tokens concatenated,
    each part with its version, and nothing marked as generated over an older cache (the resume is a new request)."""
    replay.load("real_abort_resume")
    result = run(replay, lambda c: generate(c, {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}))
    replay.check_requests()  # the resume sent the prompt + the partial output, for the tokens left
    first, second = real_answer("real_abort_resume", 0), real_answer("real_abort_resume", 1)
    assert result.output_ids == first["output_ids"] + second["output_ids"] and len(result.output_ids) == 160
    assert len(result.log_probs) == 160 and (result.resumed, result.finish_reason) == (1, "length")
    assert result.segments == [(len(first["output_ids"]), "default"), (len(second["output_ids"]), "1")]
    assert result.mid_request == [] and result.weight_version == "1"


def test_real_an_update_under_an_in_place_pause_is_one_answer_of_two_versions(replay: Replay) -> None:
    replay.load("real_in_place_update")
    result = run(replay, lambda c: generate(c, {"max_new_tokens": 160, "temperature": 0, "ignore_eos": True}))
    replay.check_requests()
    spans = real_answer("real_in_place_update")["meta_info"]["weight_versions"]
    assert [s["version"] for s in spans] == ["default", "1"] and result.resumed == 0
    assert result.segments == [(s["end"] - s["start"], s["version"]) for s in spans] and result.mid_request == [1]


def test_a_router_is_told_from_an_engine_and_its_worker_read(replay: Replay) -> None:
    replay.load("router_info")
    # The release the engine reports (behind a router: its worker's), which errors about what it lacks name.
    assert asyncio.run(probe_engine(replay.url)) == EngineLimits(24, 18, router=True, version="0.5.15.post1")
    replay.load("context_reported")
    assert asyncio.run(probe_engine(replay.url)) == EngineLimits(24, 18, version="0.5.15.post1")


@pytest.mark.parametrize(("fixture", "payload", "refused"), [
    ("router_info", {"sampling_params": {"stop_regex": "x+", "temperature": 1.0}}, "sampling_params.stop_regex"),
    ("router_info", {"sampling_params": {"logit_bias": {"5": 1.0}}}, "sampling_params.logit_bias"),
    ("router_info", {"tokenizer_path": None, "sampling_params": {"rid": "x"}}, "sampling_params.rid"),
    ("router_info", {"tokenizer_path": None, "sampling_params": {"stop": list("abcde")}}, "sampling_params.stop"),
    ("router_info", {"max_tokens": 25}, "max_tokens"),
    ("context_reported", {"sampling_params": {"max_new_tokens": 30}}, "sampling_params.max_new_tokens"),
    ("context_reported", {"context_length": 8, "max_tokens": 16}, "max_tokens"),
    ("context_reported", {"context_length": 0}, "context_length"),
    # Refused by nothing: an engine takes these keys; the router's /generate keeps a list of 5 stops.
    ("context_reported", {"max_tokens": 24, "sampling_params": {"stop_regex": "x", "logit_bias": {}}}, None),
    ("router_info", {"max_tokens": 24, "sampling_params": {"stop": list("abcde"), "temperature": 1.0}}, None),
])
def test_start_rollout_refuses_what_the_engines_cannot_serve(
    replay: Replay, fixture: str, payload: dict[str, Any], refused: str | None
) -> None:
    replay.load(fixture)
    full = {"remote_engine_url": replay.url, "tokenizer_path": "/models/Qwen3-4B", **payload}
    if refused is None:
        asyncio.run(check_engine_options(full))
        return
    with pytest.raises(ValueError) as info:
        asyncio.run(check_engine_options(full))
    assert str(info.value).startswith(refused) or f": {refused}: " in str(info.value), str(info.value)


def test_an_unreachable_engine_is_not_judged_at_start() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        dead = f"http://127.0.0.1:{s.getsockname()[1]}"
    asyncio.run(check_engine_options({"remote_engine_url": [dead], "sampling_params": {"stop_regex": "x"}}))
    with pytest.raises(ValueError, match=r"^max_tokens: 9 tokens cannot fit the run's context_length"):
        asyncio.run(check_engine_options({"remote_engine_url": dead, "context_length": 8, "max_tokens": 9}))


def context(client: EngineClient, tokenizer: Any, mask_offpolicy: bool = False) -> RolloutContext:
    run_resources = RunResources(run_id="r", task_type="math", config={}, engine=client, tokenizer=tokenizer,
                                 sampling_params={"max_tokens": 16}, max_tokens=None, mask_offpolicy=mask_offpolicy)
    return RolloutContext(run_resources, "i", 0, 0, "uid")


def int32s(b64: str) -> list[int]:
    return np.frombuffer(base64.b64decode(b64), dtype="<i4").tolist()


def test_routed_experts_and_top_p_ids_are_joined_over_an_abort_resume(replay: Replay) -> None:
    """Each request asks for the rows from those it holds; an aborted first answer's rows are dropped (nothing tells
    their width yet) and its resume asks for them again. Kept ids are joined as slime joins them, whichever key
    names them."""
    fixture = replay.load("replay_abort_resume")
    ask = ReplayAsk(routed_from=0, top_p=True)
    result = run(replay, lambda c: c.generate(PROMPT, {"max_new_tokens": 64}, session_id="s", replay=ask))
    replay.check_requests()
    answers = [e["response"]["body"] for e in fixture["exchanges"]]
    assert result.resumed == 1 and result.output_ids == [t for a in answers for t in a["output_ids"]]
    assert result.replay is not None and result.replay.routed_width == 4
    rows = int32s(answers[1]["meta_info"]["routed_experts"])
    assert np.frombuffer(result.replay.routed, dtype="<i4").tolist() == rows
    assert result.replay.routed_rows == len(PROMPT) + len(result.output_ids) - 1
    first, second = (a["meta_info"] for a in answers)
    kept = int32s(first["top_p_token_ids"]) + int32s(second["top_p_kept_token_ids"])
    assert np.frombuffer(result.replay.top_p_ids, dtype="<i4").tolist() == kept
    offsets = np.frombuffer(result.replay.top_p_offsets, dtype="<i4").tolist()
    assert len(offsets) == len(result.output_ids) + 1 and offsets[-1] == len(kept)


@pytest.mark.parametrize(("fixture", "kind", "reason"), [
    ("replay_missing", "replay_missing", "return_routed_experts: engine"),
    ("replay_not_base64", "bad_replay", "routed_experts: not base64"),
    ("replay_wrong_rows", "bad_replay", "24 rows expected"),
])
def test_routed_experts_missing_or_malformed_fail_the_generation(replay: Replay, fixture: str, kind: str,
                                                                 reason: str) -> None:
    replay.load(fixture)
    with pytest.raises(EngineError) as failed:
        run(replay, lambda c: c.generate(PROMPT, {"max_new_tokens": 64}, session_id="s",
                                         replay=ReplayAsk(routed_from=0)))
    assert failed.value.kind == kind and reason in failed.value.reason, failed.value.reason
    assert "SGLang 0.5.23" in failed.value.reason  # the engine's own release, asked of it
