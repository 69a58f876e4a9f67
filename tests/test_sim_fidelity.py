"""The simulated engine behaves as real SGLang does (0.5.15.post1 and 0.5.23), over real HTTP on loopback.

Each test names the SGLang source it matches. The engines run in-process (uvicorn in a thread on 127.0.0.1), so a
test can start one with any `SimConfig`; the last test puts the real sglang-router in front of two of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import uvicorn
from servers import free_port, router_health, sglang_router

import rollout_sim
from rollout_sim.contract import FAULT_KINDS, SimConfig
from rollout_sim.engine import SimEngine
from rollout_sim.server import build_parser, create_app

VERSIONS = ("0.5.15", "0.5.23")
CONTEXT = 256
CALCULATOR = {
    "type": "function",
    "function": {
        "name": "calculator",
        "description": "Evaluate an arithmetic expression.",
        "parameters": {"type": "object", "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}
SEARCH_INSTRUCTIONS = (
    "Answer the given question. Call a search engine by <search> query </search> and it will return the top "
    "searched results between <information> and </information>. Give the final answer inside <answer> and "
    "</answer>. Question: who wrote the novel dune?\n"
)
RUNNING_ABORT = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


@dataclass
class Sim:
    """One in-process sim engine."""

    url: str
    engine: SimEngine

    def post(self, path: str, body: Any = None, timeout: float = 30) -> httpx.Response:
        return httpx.post(self.url + path, json=body if body is not None else {}, timeout=timeout)

    def get(self, path: str, timeout: float = 30) -> httpx.Response:
        return httpx.get(self.url + path, timeout=timeout)

    def faults(self, *kinds: str) -> None:
        self.post("/sim/faults", {"next": list(kinds)}).raise_for_status()

    def running(self) -> int:
        return self.get("/get_load").json()[0]["num_reqs"]


@contextlib.contextmanager
def serve(config: SimConfig) -> Iterator[Sim]:
    """A sim engine with `config` served by uvicorn in a thread on 127.0.0.1."""
    app = create_app(config)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=config.port, log_level="warning",
                                           access_log=False, timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "sim engine did not start"
        time.sleep(0.02)
    try:
        yield Sim(f"http://127.0.0.1:{config.port}", app.state.engine)
    finally:
        server.should_exit = True
        thread.join(15)


@pytest.fixture(scope="module")
def sims(qwen_tokenizer_path: str) -> Iterator[Callable[..., Sim]]:
    """Engines by settings, started on first use (correct answers, so a prompt always gets the same reply)."""
    started: dict[tuple[tuple[str, Any], ...], Sim] = {}
    with contextlib.ExitStack() as stack:

        def get(**settings: Any) -> Sim:
            key = tuple(sorted(settings.items()))
            if key not in started:
                config = SimConfig(port=free_port(), tokenizer_path=qwen_tokenizer_path, correct_rate=1.0,
                                   context_length=CONTEXT, **settings)
                started[key] = stack.enter_context(serve(config))
            return started[key]

        yield get


def chat_ids(tokenizer: Any, question: str, tools: list[dict[str, Any]] | None = None) -> list[int]:
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tools=tools,
                                         add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def padded(tokenizer: Any, question: str, length: int) -> list[int]:
    """A math prompt of exactly `length` tokens (filler tokens before the chat)."""
    ids = chat_ids(tokenizer, question)
    filler = tokenizer.encode(" the", add_special_tokens=False)
    return filler * (length - len(ids)) + ids


def stream(sim: Sim, payload: dict[str, Any]) -> list[Any]:
    """The `data:` events of a streamed `/generate`, parsed (the closing `[DONE]` checked and dropped)."""
    events: list[Any] = []
    with httpx.stream("POST", sim.url + "/generate", json={**payload, "stream": True}, timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:] if line == "data: [DONE]" else orjson.loads(line[6:]))
    assert events[-1] == "[DONE]", events
    return events[:-1]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.01)


# ---------------------------------------------------------------------------------------- 1. the context rule


@pytest.mark.parametrize("version", VERSIONS)
def test_context_rule_status_shape_and_wording(sims: Callable[..., Sim], qwen_tokenizer: Any, version: str) -> None:
    """tokenizer_manager._validate_one_request (0.5.15 :948-998, 0.5.23 :1307-1380): input ≥ C and input +
    max_new_tokens > C are ValueErrors → 400 `{"error": {"message"}}` (http_server._create_error_response), or one
    error event in a stream (http_server.generate_request). 0.5.23's contract gate does not change these."""
    sim = sims(sglang_version=version)
    ids = chat_ids(qwen_tokenizer, "What is 17 + 25?")
    n = len(ids)
    too_many = CONTEXT - n + 1
    message = (
        f"Requested token count exceeds the model's maximum context length of {CONTEXT} tokens. You requested a "
        f"total of {CONTEXT + 1} tokens: {n} tokens from the input messages and {too_many} tokens for the "
        "completion. Please reduce the number of tokens in the input messages or the completion to fit within the "
        "limit.")
    payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": too_many}}
    r = sim.post("/generate", payload)
    assert r.status_code == 400 and r.json() == {"error": {"message": message}}
    assert stream(sim, payload) == [{"error": {"message": message, "type": "invalid_request_error", "code": 400,
                                               "retryable": False}}]
    # Exactly C is accepted.
    ok = sim.post("/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": CONTEXT - n}})
    assert ok.status_code == 200 and ok.json()["meta_info"]["finish_reason"]["type"] == "stop"
    # A prompt of C tokens or more.
    r = sim.post("/generate", {"input_ids": padded(qwen_tokenizer, "What is 1 + 1?", CONTEXT)})
    assert r.status_code == 400 and r.json() == {"error": {"message": (
        f"The input ({CONTEXT} tokens) is longer than the model's context length ({CONTEXT} tokens).")}}
    # Chat: the same check, in the OpenAI error shape (serving_chat._handle_non_streaming_request).
    r = sim.post("/v1/chat/completions", {"messages": [{"role": "user", "content": "What is 17 + 25?"}],
                                          "max_tokens": too_many})
    assert r.status_code == 400 and r.json() == {"object": "error", "message": message, "type": "BadRequestError",
                                                 "param": None, "code": 400}


@pytest.mark.parametrize("version", VERSIONS)
def test_max_req_input_len_and_the_default_max_new_tokens(sims: Callable[..., Sim], qwen_tokenizer: Any,
                                                          version: str) -> None:
    """tp_worker.get_worker_info: max_req_len = C - 1, max_req_input_len = max_req_len - 5; a longer prompt passes
    the tokenizer manager (no max_new_tokens) and is aborted by the scheduler (managers/utils.validate_input_length,
    Req.set_finish_with_abort: 400, a 1-token stand-in prompt). Without max_new_tokens nothing checks the total
    (SamplingParams' 128 is not in the request dict); Scheduler.init_req_max_new_tokens caps generation at
    max_req_len - input - 1."""
    sim = sims(sglang_version=version)
    info = sim.get("/server_info").json()
    assert (info["context_length"], info["max_req_input_len"]) == (CONTEXT, CONTEXT - 6)
    assert sim.get("/v1/models").json()["data"][0]["max_model_len"] == CONTEXT
    long = padded(qwen_tokenizer, "What is 17 + 25?", CONTEXT - 6)
    message = (f"Input length ({CONTEXT - 6} tokens) exceeds the maximum allowed length ({CONTEXT - 6} tokens). "
               "Use a shorter input or enable --allow-auto-truncate.")
    r = sim.post("/generate", {"input_ids": long})
    assert r.status_code == 400 and r.json() == {"error": {"message": message}}
    (event,) = stream(sim, {"input_ids": long, "return_logprob": True})
    meta = event["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": message, "status_code": 400,
                                     "err_type": "BadRequestError"}
    assert (meta["prompt_tokens"], meta["completion_tokens"], len(event["output_ids"])) == (1, 1, 1)
    # 7 tokens under C, no max_new_tokens: accepted, cut at C - 2 - input = 5 tokens.
    near = padded(qwen_tokenizer, "What is 17 + 25?", CONTEXT - 7)
    for params in ({}, {"max_new_tokens": None}):
        body = sim.post("/generate", {"input_ids": near, "sampling_params": params}).json()
        assert body["meta_info"]["finish_reason"] == {"type": "length", "length": 5} and len(body["output_ids"]) == 5
    # Chat without max_tokens: no limit but the context.
    question = "What is 17 + 25?" + " please" * (CONTEXT - 7 - len(chat_ids(qwen_tokenizer, "What is 17 + 25?")))
    assert len(chat_ids(qwen_tokenizer, question)) == CONTEXT - 7
    chat = sim.post("/v1/chat/completions", {"messages": [{"role": "user", "content": question}]}).json()
    assert chat["choices"][0]["finish_reason"] == "length" and chat["usage"]["completion_tokens"] == 5


# ------------------------------------------------------------------ 2. /update_weight_version aborts by default


@pytest.mark.parametrize("version", VERSIONS)
def test_update_weight_version_aborts_by_default_and_the_caller_resumes(
        sims: Callable[..., Sim], qwen_tokenizer: Any, version: str) -> None:
    """io_struct.UpdateWeightVersionReqInput.abort_all_requests = True (0.5.15 :1686, 0.5.23 :2159);
    http_server.update_weight_version aborts, then sets the version. A running request ends with FINISH_ABORT()
    (schedule_batch :202) and its output so far. 0.5.15 labels the answer with the server's version when it is
    built (the new one); 0.5.23 records the change per request (scheduler.record_weight_version_change) and
    reports spans (utils/weight_versions.py)."""
    sim = sims(sglang_version=version, token_latency_ms=40)
    ids = chat_ids(qwen_tokenizer, "What is 123 + 456?")
    full = sim.post("/generate", {"input_ids": ids, "return_logprob": True}).json()
    n = len(full["output_ids"])

    async def bump(body: dict[str, Any], wait_tokens: int) -> dict[str, Any]:
        async with httpx.AsyncClient(timeout=30) as client:
            task = asyncio.create_task(client.post(sim.url + "/generate", json={"input_ids": ids,
                                                                               "return_logprob": True}))
            await asyncio.sleep(0.04 * wait_tokens)
            assert (await client.post(sim.url + "/update_weight_version", json=body)).json()["success"] is True
            return (await task).json()

    before = sim.engine.weight_version
    cut = asyncio.run(bump({"new_version": f"{version}-a"}, n // 2))
    meta = cut["meta_info"]
    k = len(cut["output_ids"])
    assert meta["finish_reason"] == RUNNING_ABORT and 0 < k < n and meta["completion_tokens"] == k
    assert cut["output_ids"] == full["output_ids"][:k]
    if version == "0.5.15":
        assert meta["weight_version"] == f"{version}-a" and "weight_versions" not in meta
    else:
        assert meta["weight_version"] == before
        assert meta["weight_versions"] == [{"version": before, "start": 0, "end": k}]
    # The caller resumes from the partial output: together the reply is the uninterrupted one.
    rest = sim.post("/generate", {"input_ids": ids + cut["output_ids"], "return_logprob": True}).json()
    assert cut["output_ids"] + rest["output_ids"] == full["output_ids"]
    assert rest["meta_info"]["weight_version"] == f"{version}-a"
    # abort_all_requests false: the request goes on across the change.
    across = asyncio.run(bump({"new_version": f"{version}-b", "abort_all_requests": False}, n // 2))
    meta = across["meta_info"]
    assert meta["finish_reason"]["type"] == "stop" and across["output_ids"] == full["output_ids"]
    assert meta["weight_version"] == f"{version}-b"
    if version == "0.5.23":
        (old, new) = meta["weight_versions"]
        assert (old["version"], old["start"], new["version"], new["end"]) == (f"{version}-a", 0, f"{version}-b", n)
        assert 0 < old["end"] == new["start"] < n


@pytest.mark.parametrize("version", VERSIONS)
def test_pause_modes_and_aborts_of_held_and_retracted_requests(
        sims: Callable[..., Sim], qwen_tokenizer: Any, version: str) -> None:
    """in_place keeps requests in the running batch: an abort (here the version bump's) is answered when
    generation continues (scheduler.event_loop_normal skips batches while paused). retract moves them to the
    waiting queue: an abort answers at once in tokenizer_manager._handle_abort_req's shape ("Abort in waiting
    queue", no prompt_tokens; streamed, 0.5.15 :2738-2741 sends output_ids=[last], 0.5.23 :3627-3630 only when
    incremental) with the cumulative log-probs of what was sent."""
    sim = sims(sglang_version=version, token_latency_ms=40)
    ids = chat_ids(qwen_tokenizer, "What is 321 + 654?")

    async def held_in_place() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            task = asyncio.create_task(client.post(sim.url + "/generate", json={"input_ids": ids}))
            await asyncio.sleep(0.3)
            try:
                await client.post(sim.url + "/pause_generation", json={"mode": "in_place"})
                await client.post(sim.url + "/update_weight_version", json={"new_version": f"{version}-p"})
                await asyncio.sleep(0.5)
                assert not task.done(), "held in place until generation continues"
            finally:
                await client.post(sim.url + "/continue_generation", json={})
            body = (await task).json()
            assert body["meta_info"]["finish_reason"] == RUNNING_ABORT and len(body["output_ids"]) > 0

    async def retracted_stream() -> None:
        payload = {"input_ids": ids, "stream": True, "return_logprob": True}
        events: list[dict[str, Any]] = []
        async with httpx.AsyncClient(timeout=30) as client, \
                client.stream("POST", sim.url + "/generate", json=payload) as r:
            try:
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    events.append(orjson.loads(line[6:]))
                    if len(events) == 4:
                        await client.post(sim.url + "/pause_generation", json={"mode": "retract"})
                        assert sim.get("/get_load").json()[0]["num_waiting_reqs"] == 1
                        await client.post(sim.url + "/abort_request", json={"abort_all": True})
            finally:
                await client.post(sim.url + "/continue_generation", json={})
        last, final = events[-2], events[-1]
        meta, sent = final["meta_info"], last["output_ids"]
        assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
        assert "prompt_tokens" not in meta and meta["completion_tokens"] == len(sent) >= 4
        assert final["text"] == last["text"]
        assert [e[1] for e in meta["output_token_logprobs"]] == sent  # cumulative
        assert final["output_ids"] == (sent[-1:] if version == "0.5.15" else sent)

    asyncio.run(held_in_place())
    asyncio.run(retracted_stream())
    # Requests sent during a pause wait before any check, and no abort reaches them.
    async def waits() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            await client.post(sim.url + "/pause_generation", json={"mode": "abort"})
            try:
                task = asyncio.create_task(client.post(sim.url + "/generate", json={"input_ids": ids}))
                await asyncio.sleep(0.2)
                await client.post(sim.url + "/update_weight_version", json={"new_version": f"{version}-w"})
                await client.post(sim.url + "/abort_request", json={"abort_all": True})
                assert not task.done()
            finally:
                await client.post(sim.url + "/continue_generation", json={})
            body = (await task).json()
            assert body["meta_info"]["finish_reason"]["type"] == "stop"
            assert body["meta_info"]["weight_version"] == f"{version}-w"

    asyncio.run(waits())


# ------------------------------------------------------------------------------- 3. refusals as abort events


@pytest.mark.parametrize("version", VERSIONS)
def test_refusal_faults_in_sglangs_shapes(sims: Callable[..., Sim], qwen_tokenizer: Any, version: str) -> None:
    """refuse_400: Req.set_finish_with_abort (schedule_batch; 400, "BadRequestError"), through the normal output
    path: non-streamed a ValueError → 400 `{"error": {"message"}}`. refuse_503: scheduler._abort_on_queued_limit's
    AbortReq (503, "The request queue is full."), answered by _handle_abort_req: non-streamed an HTTPException →
    503 in ErrorResponse's shape (http_server's HTTPException handler); streamed, both are an ordinary last event
    (_handle_abort_finish_reason), then [DONE]."""
    sim = sims(sglang_version=version)
    ids = chat_ids(qwen_tokenizer, "What is 2 + 2?")
    too_long = (f"Input length ({len(ids)} tokens) exceeds the maximum allowed length ({CONTEXT - 6} tokens). "
                "Use a shorter input or enable --allow-auto-truncate.")
    sim.faults("refuse_400", "refuse_503")
    r = sim.post("/generate", {"input_ids": ids})
    assert r.status_code == 400 and r.json() == {"error": {"message": too_long}}
    r = sim.post("/generate", {"input_ids": ids})
    assert r.status_code == 503 and r.json() == {"object": "error", "message": "The request queue is full.",
                                                 "type": "503", "param": None, "code": 503}
    sim.faults("refuse_400", "refuse_503")
    (e400,) = stream(sim, {"input_ids": ids})
    assert e400["meta_info"]["finish_reason"] == {"type": "abort", "message": too_long, "status_code": 400,
                                                  "err_type": "BadRequestError"}
    (e503,) = stream(sim, {"input_ids": ids, "return_logprob": True})
    meta = e503["meta_info"]
    assert (e503["text"], e503["output_ids"]) == ("", [])
    assert meta["finish_reason"] == {"type": "abort", "status_code": 503, "message": "The request queue is full."}
    assert "prompt_tokens" not in meta and meta["completion_tokens"] == 0 and meta["output_token_logprobs"] == []
    if version == "0.5.23":  # _make_abort_req carries the spans
        assert meta["weight_versions"] == [{"version": meta["weight_version"], "start": 0, "end": 0}]
    # Chat: ValueError → create_error_response; HTTPException → serving_base.handle_request's ErrorResponse.
    messages = [{"role": "user", "content": "What is 2 + 2?"}]
    sim.faults("refuse_400", "refuse_503")
    r = sim.post("/v1/chat/completions", {"messages": messages})
    assert r.status_code == 400 and r.json()["type"] == "BadRequestError" and r.json()["message"] == too_long
    r = sim.post("/v1/chat/completions", {"messages": messages})
    assert r.status_code == 503 and r.json()["type"] == "503"
    assert sim.get("/sim/stats").json()["faults"]["refuse_503"] >= 3


def test_refusals_from_the_seeded_fault_config(sims: Callable[..., Sim], qwen_tokenizer: Any) -> None:
    """`--error-kinds refuse_400,refuse_503` with `--error-rate`: the same refusals, drawn from the seed."""
    args = build_parser().parse_args(["--port", "1", "--error-kinds", "refuse_400,refuse_503", "--error-rate", "1",
                                      "--sglang-version", "0.5.15", "--stream-interval", "4"])
    assert (args.error_kinds, args.sglang_version, args.stream_interval) == (("refuse_400", "refuse_503"), "0.5.15", 4)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--port", "1", "--sglang-version", "0.5.99"])
    sim = sims(error_rate=1.0, error_kinds=("refuse_400", "refuse_503"), seed=3)
    ids = chat_ids(qwen_tokenizer, "What is 3 + 3?")
    statuses = {sim.post("/generate", {"input_ids": ids}).status_code for _ in range(12)}
    assert statuses == {400, 503}


# ------------------------------------------------------------------------- 4. several tokens per streamed event


def _counts(events: list[dict[str, Any]]) -> list[int]:
    return [e["meta_info"]["completion_tokens"] for e in events]


@pytest.mark.parametrize("version", VERSIONS)
def test_stream_interval_groups_tokens_per_event(sims: Callable[..., Sim], qwen_tokenizer: Any,
                                                 version: str) -> None:
    """output_streamer.accept: 0.5.15 (:330-342) sends at len(output_ids) % N == 1, 0.5.23 (:453-468) the first token
    at once then whenever N are unsent; the last event always. Events hold the output so far (tokenizer_manager
    _handle_batch_output, incremental_streaming_output off)."""
    sim = sims(sglang_version=version, stream_interval=4)
    ids = chat_ids(qwen_tokenizer, "What is 17 + 25?")
    events = stream(sim, {"input_ids": ids, "return_logprob": True})
    counts, n = _counts(events), len(events[-1]["output_ids"])
    assert counts[-1] == n and counts[:-1] == list(range(1, n, 4))
    for before, after in itertools.pairwise(events):
        assert after["output_ids"][: len(before["output_ids"])] == before["output_ids"]
        assert after["text"].startswith(before["text"])
    assert [e[1] for e in events[-1]["meta_info"]["output_token_logprobs"]] == events[-1]["output_ids"]
    # Per request `sampling_params.stream_interval` overrides the server's.
    assert _counts(stream(sim, {"input_ids": ids, "sampling_params": {"stream_interval": 1}}))[:-1] == \
        list(range(1, n))


@pytest.mark.parametrize("version", VERSIONS)
def test_stop_string_prefixes_are_held_back(sims: Callable[..., Sim], qwen_tokenizer: Any, version: str) -> None:
    """Req.check_match_stop_str_prefix (schedule_batch): an event whose tail could start a stop string is not sent;
    its tokens go out with the next one. 0.5.15 then waits for the next `% N == 1` step, 0.5.23 sends as soon as
    the tail is clear (N or more unsent)."""
    ids = chat_ids(qwen_tokenizer, SEARCH_INSTRUCTIONS)
    stop = "</search>"
    for interval in (1, 4):
        sim = sims(sglang_version=version, stream_interval=interval)
        events = stream(sim, {"input_ids": ids, "sampling_params": {"stop": [stop]}})
        final = events[-1]
        assert final["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        for event in events[:-1]:
            tail = qwen_tokenizer.decode(event["output_ids"][-4:])
            assert not any(tail.endswith(stop[:i]) for i in range(1, len(stop) + 1)), event["text"]
        counts = _counts(events)
        # "</search>" is three tokens ("</", "search", ">"): all three come with the last event.
        assert counts[-1] - counts[-2] >= 3
        if version == "0.5.15" and interval > 1:
            assert all(c % interval == 1 for c in counts[:-1])
        assert final["text"].endswith("<search> who wrote the novel dune ")
    # A held event at a send step: the reply's 17th token is "\n", a prefix of the stop "\nX" (never completed).
    # 0.5.15 skips to the next `% 4 == 1` step (21); 0.5.23 sends at 18, N unsent and the tail clear.
    sim = sims(sglang_version=version, stream_interval=4)
    counts = _counts(stream(sim, {"input_ids": ids, "sampling_params": {"stop": ["\nX"]}}))[:-1]
    assert counts[:4] == [1, 5, 9, 13] and 17 not in counts
    assert counts[4:6] == ([21, 25] if version == "0.5.15" else [18, 22])


@pytest.mark.parametrize("version", VERSIONS)
def test_incremental_streaming_output(sims: Callable[..., Sim], qwen_tokenizer: Any, version: str) -> None:
    """--incremental-streaming-output: each event holds only its new text, ids and log-probs
    (_slice_streaming_output_meta_info); completion_tokens stays cumulative."""
    sim = sims(sglang_version=version, incremental_streaming_output=True, stream_interval=3)
    plain = sims(sglang_version=version)
    ids = chat_ids(qwen_tokenizer, "What is 17 + 25?")
    whole = plain.post("/generate", {"input_ids": ids, "return_logprob": True}).json()
    events = stream(sim, {"input_ids": ids, "return_logprob": True})
    assert list(itertools.chain.from_iterable(e["output_ids"] for e in events)) == whole["output_ids"]
    assert "".join(e["text"] for e in events) == whole["text"]
    assert list(itertools.chain.from_iterable(e["meta_info"]["output_token_logprobs"] for e in events)) == \
        whole["meta_info"]["output_token_logprobs"]
    assert _counts(events)[-1] == len(whole["output_ids"]) and len(events[1]["output_ids"]) == 3


# --------------------------------------------------------------------------------------- 5. stop-token text


@pytest.mark.parametrize("version", VERSIONS)
def test_stop_token_text_is_trimmed_but_the_id_kept(sims: Callable[..., Sim], qwen_tokenizer: Any,
                                                    version: str) -> None:
    """Req._check_token_based_finish: finished_len includes the stop token, so output_ids end with it
    (output_ids_through_stop); DetokenizerManager.trim_matched_stop drops it from the text unless no_stop_trim —
    also a non-special token such as Qwen3's </tool_call>."""
    sim = sims(sglang_version=version)
    end_call = qwen_tokenizer.convert_tokens_to_ids("</tool_call>")
    ids = chat_ids(qwen_tokenizer, "What is 12 * 34?", tools=[CALCULATOR])
    params = {"stop_token_ids": [end_call]}
    body = sim.post("/generate", {"input_ids": ids, "sampling_params": params}).json()
    assert body["output_ids"][-1] == end_call
    assert body["meta_info"]["finish_reason"] == {"type": "stop", "matched": end_call}
    assert "</tool_call>" not in body["text"] and body["text"] == qwen_tokenizer.decode(body["output_ids"][:-1])
    kept = sim.post("/generate", {"input_ids": ids, "sampling_params": {**params, "no_stop_trim": True}}).json()
    assert kept["output_ids"] == body["output_ids"] and kept["text"].endswith("</tool_call>")
    assert stream(sim, {"input_ids": ids, "sampling_params": params})[-1]["text"] == body["text"]
    # The end-of-turn id too, visible with skip_special_tokens off.
    raw = sim.post("/generate", {"input_ids": chat_ids(qwen_tokenizer, "What is 1 + 1?"),
                                 "sampling_params": {"skip_special_tokens": False}}).json()
    assert raw["output_ids"][-1] == qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert not raw["text"].endswith("<|im_end|>")


# ---------------------------------------------------------------------- 6. /health, /flush_cache, weight version


@pytest.mark.parametrize("version", VERSIONS)
def test_health_runs_a_generation_and_fails_after_a_long_pause(sims: Callable[..., Sim], version: str) -> None:
    """http_server.health_generate: a 1-token generation; 200 once anything arrived from the scheduler after the
    check began (tokenizer_manager.last_receive_tstamp), 503 after HEALTH_CHECK_TIMEOUT (SGLANG_HEALTH_CHECK_TIMEOUT,
    20 s; 2 s here) without."""
    sim = sims(sglang_version=version, health_check_timeout_s=2.0)
    assert sim.get("/health").status_code == 200 and sim.get("/health_generate").status_code == 200
    sim.post("/pause_generation", {"mode": "in_place"}).raise_for_status()
    try:
        start = time.monotonic()
        assert sim.get("/health").status_code == 503
        assert 2.0 <= time.monotonic() - start < 4.0

        async def continued_meanwhile() -> int:
            async with httpx.AsyncClient(timeout=30) as client:
                check = asyncio.create_task(client.get(sim.url + "/health_generate"))
                await asyncio.sleep(0.5)
                await client.post(sim.url + "/continue_generation", json={})
                return (await check).status_code

        assert asyncio.run(continued_meanwhile()) == 200
    finally:
        sim.post("/continue_generation")
    assert sim.get("/health").status_code == 200


@pytest.mark.parametrize("version", VERSIONS)
def test_flush_cache_and_the_weight_version_endpoint(sims: Callable[..., Sim], qwen_tokenizer: Any,
                                                     version: str) -> None:
    """http_server.flush_cache: GET or POST; 400 while requests are running or waiting (Scheduler.flush_cache;
    0.5.23 ignores the waiting queue while paused), `?timeout=` waits for idle (SchedulerFlushWrapper).
    /get_weight_version: 0.5.15 raises a 404 HTTPException (ErrorResponse shape), 0.5.23 has no route."""
    sim = sims(sglang_version=version, token_latency_ms=40)
    flushed = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
               "requests, the operation will not be performed.)\n")
    assert sim.get("/flush_cache").text == flushed and sim.post("/flush_cache").status_code == 200
    ids = chat_ids(qwen_tokenizer, "What is 99 + 1?")

    async def busy() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            task = asyncio.create_task(client.post(sim.url + "/generate", json={"input_ids": ids}))
            await asyncio.sleep(0.2)
            r = await client.post(sim.url + "/flush_cache")
            assert (r.status_code, r.text) == (400, "Flush cache failed.\n")
            r = await client.get(sim.url + "/flush_cache", params={"timeout": 10})
            assert r.status_code == 200 and (await task).status_code == 200
            task = asyncio.create_task(client.post(sim.url + "/generate", json={"input_ids": ids}))
            await asyncio.sleep(0.2)
            await client.post(sim.url + "/pause_generation", json={"mode": "retract"})
            try:
                r = await client.post(sim.url + "/flush_cache")
                assert r.status_code == (200 if version == "0.5.23" else 400)
            finally:
                await client.post(sim.url + "/continue_generation", json={})
            await task

    asyncio.run(busy())
    r = sim.get("/get_weight_version")
    if version == "0.5.15":
        assert r.status_code == 404 and r.json() == {
            "object": "error", "type": "404", "param": None, "code": 404,
            "message": "Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use '/model_info' "
                       "instead."}
    else:
        assert r.status_code == 404 and r.json() == {"detail": "Not Found"}
    info = sim.get("/model_info").json()
    assert info["weight_version"] == sim.engine.weight_version
    assert ("served_model_name" in info) == (version == "0.5.23")
    assert sim.get("/server_info").json()["version"] == {"0.5.15": "0.5.15.post1", "0.5.23": "0.5.23"}[version]


def test_a_weight_load_answers_as_sglangs_and_fails_while_requests_are_held(
        sims: Callable[..., Sim], qwen_tokenizer: Any, tmp_path: Path) -> None:
    """/update_weights_from_disk as real SGLang 0.5.23 answered it on this CPU (tests/test_real_sglang.py): a
    missing folder fails the load; with a request held by an in-place pause the cache flush after the load fails
    and the version stays; once nothing is held the load succeeds and sets the version."""
    sim = sims(token_latency_ms=40)
    missing = sim.post("/update_weights_from_disk", {"model_path": "/nonexistent", "weight_version": "9"})
    assert missing.status_code == 400 and missing.json()["success"] is False
    assert missing.json()["message"].startswith("Failed to get weights iterator: ")
    before = sim.engine.weight_version
    ids = chat_ids(qwen_tokenizer, "What is 99 + 1?")

    async def held() -> None:
        async with httpx.AsyncClient(timeout=30) as client:
            task = asyncio.create_task(client.post(sim.url + "/generate", json={"input_ids": ids}))
            await asyncio.to_thread(wait_until, lambda: sim.running() == 1)
            await client.post(sim.url + "/pause_generation", json={"mode": "in_place"})
            try:
                r = await client.post(sim.url + "/update_weights_from_disk",
                                      json={"model_path": str(tmp_path), "weight_version": "7"})
                assert r.status_code == 400 and r.json()["success"] is False
                assert r.json()["message"].startswith("Weights were updated, but the cache was not flushed")
                assert sim.engine.weight_version == before
            finally:
                await client.post(sim.url + "/continue_generation", json={})
            assert (await task).status_code == 200

    asyncio.run(held())
    loaded = sim.post("/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "7"})
    assert loaded.status_code == 200 and loaded.json() == {
        "success": True, "message": "Succeeded to update model weights. Weight version updated to 7.",
        "num_paused_requests": 0}
    assert sim.get("/model_info").json()["weight_version"] == "7"


@pytest.mark.parametrize("version", VERSIONS)
def test_unknown_sampling_params(sims: Callable[..., Sim], qwen_tokenizer: Any, version: str) -> None:
    """0.5.23: http_server.generate_request's contract gate (entrypoints/api_contract.py) answers 400 with the
    schema's text. 0.5.15: SamplingParams(**params) raises TypeError, which no handler catches: 500."""
    sim = sims(sglang_version=version)
    payload = {"input_ids": chat_ids(qwen_tokenizer, "Hi"), "sampling_params": {"max_tokens": 3}}
    r = sim.post("/generate", payload)
    if version == "0.5.23":
        assert r.status_code == 400 and r.json()["error"].startswith(
            "unknown field `max_tokens`, expected one of `max_new_tokens`, `stop`, ")
        assert httpx.post(sim.url + "/generate", json={**payload, "stream": True}).json() == r.json()
    else:
        assert (r.status_code, r.text) == (500, "Internal Server Error")
        with pytest.raises(httpx.RemoteProtocolError):  # the exception escapes the stream: a broken response
            stream(sim, payload)


# ------------------------------------------------------------------------------------ 7. the package docstring


def test_the_docstring_says_what_is_and_is_not_imitated() -> None:
    doc = rollout_sim.__doc__ or ""
    assert "Imitated" in doc and "Not imitated:" in doc
    for kind in FAULT_KINDS:
        assert f"`{kind}`" in doc, kind


# --------------------------------------------------------------------------------- the real router in front

# One failed health check takes a worker out, one good one brings it back.
FAIL_FAST = ("--health-check-timeout-secs", "5", "--health-failure-threshold", "1", "--health-success-threshold", "1")


def test_health_and_context_refusal_through_the_real_router(qwen_tokenizer_path: str, qwen_tokenizer: Any,
                                                            tmp_path: Path) -> None:
    """The router turns a paused worker's 503 /health into an unhealthy worker and sends the traffic to the other;
    a context refusal comes back as real SGLang's: 400 with its body, or the error event of a stream."""
    pytest.importorskip("sglang_router")
    configs = [SimConfig(port=free_port(), tokenizer_path=qwen_tokenizer_path, context_length=CONTEXT,
                         health_check_timeout_s=2.0, correct_rate=1.0) for _ in range(2)]
    with serve(configs[0]) as a, serve(configs[1]) as b, \
            sglang_router([a.url, b.url], tmp_path / "router.log", *FAIL_FAST) as (router, _):
        ids = chat_ids(qwen_tokenizer, "What is 17 + 25?")
        payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": CONTEXT}}
        direct = a.post("/generate", payload)
        via = httpx.post(router + "/generate", json=payload, timeout=30)
        assert (via.status_code, via.json()) == (400, direct.json())
        with httpx.stream("POST", router + "/generate", json={**payload, "stream": True}, timeout=30) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]"
        assert orjson.loads(lines[0][6:])["error"]["code"] == 400
        # A long pause: /health answers 503, the router takes the worker out, the other serves everything.
        a.post("/pause_generation", {"mode": "in_place"}).raise_for_status()
        try:
            wait_until(lambda: router_health(router) == {a.url: False, b.url: True}, timeout_s=20)
            before = a.engine.stats.by_endpoint["/generate"], b.engine.stats.by_endpoint["/generate"]
            for _ in range(4):
                ok = httpx.post(router + "/generate", json={"input_ids": ids}, timeout=30)
                assert ok.status_code == 200
            after = a.engine.stats.by_endpoint["/generate"], b.engine.stats.by_endpoint["/generate"]
            assert (after[0] - before[0], after[1] - before[1]) == (0, 4)
        finally:
            a.post("/continue_generation")
        wait_until(lambda: router_health(router) == {a.url: True, b.url: True}, timeout_s=20)
