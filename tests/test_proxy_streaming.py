"""Token-by-token streaming, end to end over real HTTP: the simulated engine's `/generate` stream in SGLang's
shape, the engine client's streamed generation (retries, abort resume across a weight update), and the agent
proxy's OpenAI and Anthropic streams followed by the official clients while the engine is still generating.

The engine takes 15 ms per output token, so a turn of some 30-70 tokens takes half a second or more; "the first
delta came before the engine finished" is checked by asking the engine, when the first delta arrives, whether
the request is still running (no timing thresholds)."""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Iterator
from typing import Any

import anthropic
import httpx
import openai
import pytest
from servers import Server, free_port, running, sim_engine
from tokenizers import Tokenizer

from rollout_buffer.engine.client import EngineClient

TOKEN_MS = "15"
QUESTION = "What is 3 * 4?"
PARALLEL_TASK = "Compute 12 * 7 + 3 and 45 - 6 in parallel, using the calculator."
CALC_PARAMETERS = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                                  "parameters": CALC_PARAMETERS}}]
RESULTS = {"12 * 7 + 3": "87", "45 - 6": "39"}
ANTHROPIC_TOOLS = [{"name": "calculator", "description": "Evaluate arithmetic.", "input_schema": CALC_PARAMETERS}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    # Always right: the same prompt gets the same reply, so a streamed and a JSON turn can be compared.
    with sim_engine(tmp_path_factory.mktemp("stream-sim"), qwen_tokenizer_path, "--token-latency-ms", TOKEN_MS,
                    "--correct-rate", "1") as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory, engine: Server, qwen_tokenizer_path: str) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("stream-buffer")
    port = free_port()
    with running(["serve", "--port", str(port), "--data-dir", str(tmp / "data")], "/healthz", port,
                 tmp / "buffer.log") as srv:
        start = httpx.post(f"{srv.url}/start_rollout", timeout=30, json={
            "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
            "num_repeat_per_sample": 1, "max_tokens": 4096})
        assert start.status_code == 200, start.text
        yield srv


@pytest.fixture(scope="module")
def prompt_ids(qwen_tokenizer_path: str) -> list[int]:
    # Qwen3's chat template for one user message, written out: no transformers import for these tests.
    tokenizer = Tokenizer.from_file(os.path.join(qwen_tokenizer_path, "tokenizer.json"))
    text = f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n"
    return tokenizer.encode(text, add_special_tokens=False).ids


def open_session(url: str, instance_id: str) -> dict[str, Any]:
    answer = httpx.post(f"{url}/sessions", json={"instance_id": instance_id}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def finish(url: str, session: dict[str, Any]) -> dict[str, Any]:
    """Close the session; its one record."""
    stored = httpx.post(f"{url}/sessions/{session['session_id']}/finish", json={"reward": 1.0}, timeout=60).json()
    assert stored["records"] == 1, stored
    return httpx.get(f"{url}/trajectories/{stored['uids'][0]}", timeout=10).json()


def engine_running(engine: Server) -> int:
    return httpx.get(f"{engine.url}/get_load", timeout=5).json()[0]["num_reqs"]


def assert_engine_tokens(engine: Server, rec: dict[str, Any]) -> None:
    """The record's generated tokens are what the engine answers, unstreamed, for the tokens before them."""
    tokens, mask = rec["tokens"], rec["loss_mask"]
    start = mask.index(1)
    end = start + mask[start:].index(0) if 0 in mask[start:] else len(mask)
    again = httpx.post(f"{engine.url}/generate", timeout=30, json={
        "input_ids": tokens[:start], "sampling_params": {"max_new_tokens": 4096}}).json()
    assert again["output_ids"] == tokens[start:end]


def sse_events(lines: list[str]) -> list[str]:
    return [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]


# ------------------------------------------------------------------ the engine


def test_sim_generate_stream_has_sglang_shape(engine: Server, prompt_ids: list[int]) -> None:
    body = {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 512}, "return_logprob": True}
    whole = httpx.post(f"{engine.url}/generate", json=body, timeout=30).json()
    with httpx.stream("POST", f"{engine.url}/generate", json={**body, "stream": True}, timeout=30) as answer:
        assert answer.headers["content-type"].startswith("text/event-stream")
        raw = answer.read().decode()
    assert raw.endswith("data: [DONE]\n\n") and all(e.startswith("data: ") for e in raw.strip().split("\n\n"))
    data = sse_events(raw.split("\n"))
    assert data[-1] == "[DONE]"
    chunks = [json.loads(d) for d in data[:-1]]
    assert len(chunks) == len(whole["output_ids"]) > 20  # one event per token (stream_interval 1)
    for i, chunk in enumerate(chunks):  # SGLang's default: the output so far in every event
        meta = chunk["meta_info"]
        assert set(chunk) == {"text", "output_ids", "meta_info"} and chunk["output_ids"] == whole["output_ids"][:i + 1]
        assert meta["completion_tokens"] == i + 1 and meta["prompt_tokens"] == len(prompt_ids)
        assert [e[1] for e in meta["output_token_logprobs"]] == chunk["output_ids"]
        assert meta["finish_reason"] is None if i < len(chunks) - 1 else meta["finish_reason"]["type"] == "stop"
        assert whole["text"].startswith(chunk["text"]) and meta["weight_version"] == "default"
    assert chunks[-1]["text"] == whole["text"]
    assert chunks[-1]["meta_info"]["output_token_logprobs"] == whole["meta_info"]["output_token_logprobs"]

    # /abort_request in the middle: the stream ends with finish abort and the tokens streamed so far.
    with httpx.stream("POST", f"{engine.url}/generate", timeout=30,
                      json={**body, "stream": True, "rid": "to-abort"}) as answer:
        lines = answer.iter_lines()
        first = json.loads(next(lines).removeprefix("data: "))
        httpx.post(f"{engine.url}/abort_request", json={"rid": "to-abort"}, timeout=5).raise_for_status()
        rest = sse_events(list(lines))
    last = json.loads(rest[-2])
    assert rest[-1] == "[DONE]" and last["meta_info"]["finish_reason"]["type"] == "abort"
    assert 1 <= len(first["output_ids"]) <= len(last["output_ids"]) < len(whole["output_ids"])
    assert last["output_ids"] == whole["output_ids"][:len(last["output_ids"])]

    # A request SGLang refuses while streaming: an error event, then [DONE].
    bad = httpx.post(f"{engine.url}/generate", timeout=10,
                     json={"input_ids": [10**9], "sampling_params": {}, "stream": True})
    events = sse_events(bad.text.split("\n"))
    assert "error" in json.loads(events[0]) and events[-1] == "[DONE]"


def test_engine_client_stream_retries_and_resumes_across_a_weight_update(engine: Server,
                                                                         prompt_ids: list[int]) -> None:
    async def main() -> None:
        client = EngineClient([engine.url], backoff_s=0.01)
        try:
            whole = await client.generate(prompt_ids, {"max_tokens": 512}, session_id="whole")
            stream = client.generate_stream(prompt_ids, {"max_tokens": 512}, session_id="streamed")
            deltas = []
            async with httpx.AsyncClient() as http:
                await http.post(f"{engine.url}/sim/faults", json={"next": ["http_500", "reset"]})
                async for delta in stream:
                    deltas.append(delta)
                    if len(deltas) == 3:  # a weight update aborts the request mid-stream
                        await http.post(f"{engine.url}/update_weight_version",
                                        json={"new_version": "v2", "abort_all_requests": True})
            result = stream.result
            assert result.attempts == 4 and result.resumed == 1  # 2 failed before any token, 1 resume
            assert [v for _, v in result.segments] == ["default", "v2"] and sum(n for n, _ in result.segments) == \
                len(result.output_ids)
            assert result.output_ids == [t for d in deltas for t in d.output_ids] == whole.output_ids
            assert result.log_probs == [p for d in deltas for p in d.log_probs] == whole.log_probs
            assert result.text == "".join(d.text for d in deltas) == whole.text and result.finish_reason == "stop"
        finally:
            await client.aclose()
            async with httpx.AsyncClient() as http:
                await http.post(f"{engine.url}/update_weight_version", json={"new_version": "default"})

    asyncio.run(main())


# ------------------------------------------------------------------ the proxy


def test_openai_stream_follows_the_engine_and_equals_the_json_answer(buffer: Server, engine: Server) -> None:
    streamed, plain = open_session(buffer.url, "openai-stream"), open_session(buffer.url, "openai-json")
    messages = [{"role": "user", "content": QUESTION}]
    client = openai.OpenAI(base_url=streamed["base_url"], api_key=streamed["api_key"], max_retries=0)
    content, reasoning, running_at_first = [], [], None
    for chunk in client.chat.completions.create(model="m", messages=messages, stream=True, seed=7,
                                                stream_options={"include_usage": True}):
        delta = chunk.choices[0].delta if chunk.choices else None
        piece = delta and (delta.content or (delta.model_extra or {}).get("reasoning_content"))
        if piece and running_at_first is None:
            running_at_first = engine_running(engine)
        if delta and delta.content:
            content.append(delta.content)
        if delta and (delta.model_extra or {}).get("reasoning_content"):
            reasoning.append(delta.model_extra["reasoning_content"])
        if chunk.choices and chunk.choices[0].finish_reason:
            assert chunk.choices[0].finish_reason == "stop"
        if chunk.usage:
            usage = chunk.usage
    assert running_at_first == 1, "the first delta arrived while the engine was still generating the turn"
    assert engine_running(engine) == 0 and len(content) >= 3 and len(reasoning) >= 3

    answer = openai.OpenAI(base_url=plain["base_url"], api_key=plain["api_key"], max_retries=0
                           ).chat.completions.create(model="m", messages=messages, seed=7)
    message = answer.choices[0].message
    assert "".join(content) == message.content and "\\boxed{12}" in message.content
    assert "".join(reasoning) == message.model_extra["reasoning_content"]
    assert (usage.prompt_tokens, usage.completion_tokens) == (answer.usage.prompt_tokens,
                                                              answer.usage.completion_tokens)

    rec_stream, rec_json = finish(buffer.url, streamed), finish(buffer.url, plain)
    for key in ("tokens", "loss_mask", "rollout_log_probs", "response_length", "messages"):
        assert rec_stream[key] == rec_json[key], key
    assert_engine_tokens(engine, rec_stream)


def test_openai_stream_sends_tool_calls_as_tool_call_deltas(buffer: Server) -> None:
    session = open_session(buffer.url, "openai-tools")
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    chunks = list(client.chat.completions.create(model="m", stream=True, tools=OPENAI_TOOLS,
                                                 messages=[{"role": "user", "content": PARALLEL_TASK}]))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    texts = [d.content or "" for d in deltas] + [(d.model_extra or {}).get("reasoning_content") or "" for d in deltas]
    assert not any("tool_call" in t for t in texts), "no hermes block leaks as text"
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert [c.function.name for c in calls if c.id] == ["calculator", "calculator"]
    arguments = {c.index: "" for c in calls}
    for c in calls:
        arguments[c.index] += c.function.arguments or ""
    assert [json.loads(a) for a in arguments.values()] == [{"expression": "12 * 7 + 3"}, {"expression": "45 - 6"}]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [(b["turns"], b["tool_calls"]) for b in httpx.get(
        f"{buffer.url}/sessions/{session['session_id']}", timeout=10).json()["branches"]] == [(1, 2)]
    assert finish(buffer.url, session)["extra_info"]["tool_calls"] == 2


def test_anthropic_stream_follows_the_engine_with_tool_use_blocks(buffer: Server, engine: Server) -> None:
    streamed, plain = open_session(buffer.url, "anthropic-stream"), open_session(buffer.url, "anthropic-json")
    request: dict[str, Any] = {"model": "claude-x", "max_tokens": 1024, "tools": ANTHROPIC_TOOLS,
                               "messages": [{"role": "user", "content": PARALLEL_TASK}]}
    client = anthropic.Anthropic(base_url=streamed["anthropic_base_url"], api_key=streamed["api_key"], max_retries=0)
    kinds, thinking, running_at_first = [], [], None
    with client.messages.stream(**request) as events:
        for event in events:
            kinds.append(event.type)
            if event.type == "content_block_delta" and event.delta.type == "thinking_delta":
                thinking.append(event.delta.thinking)
                if running_at_first is None:
                    running_at_first = engine_running(engine)
            if event.type == "content_block_delta" and event.delta.type == "text_delta":
                assert "tool_call" not in event.delta.text
        final = events.get_final_message()
    assert running_at_first == 1 and len(thinking) >= 3
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert [b.type for b in final.content] == ["thinking", "tool_use", "tool_use"]
    assert final.stop_reason == "tool_use" and final.usage.output_tokens > 0

    whole = anthropic.Anthropic(base_url=plain["anthropic_base_url"], api_key=plain["api_key"], max_retries=0
                                ).messages.create(**request)
    assert [(b.type, getattr(b, "thinking", None), getattr(b, "input", None)) for b in final.content] == \
        [(b.type, getattr(b, "thinking", None), getattr(b, "input", None)) for b in whole.content]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (whole.usage.input_tokens,
                                                                      whole.usage.output_tokens)
    rec_json = finish(buffer.url, plain)

    # The tool results go back; the answer comes as several text deltas.
    request["messages"] += [
        {"role": "assistant", "content": [b.model_dump() for b in final.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": b.id,
                                      "content": RESULTS[b.input["expression"]]}
                                     for b in final.content if b.type == "tool_use"]}]
    with client.messages.stream(**request) as events:
        texts = [e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"]
        answer = events.get_final_message()
    assert len(texts) >= 3 and "".join(texts) == answer.content[-1].text
    assert answer.content[-1].text == "The results are: 12 * 7 + 3 = 87, 45 - 6 = 39."
    rec_stream = finish(buffer.url, streamed)
    # The streamed first turn is in the session exactly as the JSON one: the same tokens and log-probs.
    assert rec_stream["tokens"][:len(rec_json["tokens"])] == rec_json["tokens"]
    assert rec_stream["rollout_log_probs"][:len(rec_json["rollout_log_probs"])] == rec_json["rollout_log_probs"]


def test_a_client_that_leaves_mid_stream_leaves_no_turn_and_aborts_the_engine(buffer: Server, engine: Server
                                                                             ) -> None:
    session = open_session(buffer.url, "leaves")
    messages = [{"role": "user", "content": QUESTION}]
    with httpx.stream("POST", f"{session['base_url']}/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {session['api_key']}"},
                      json={"model": "m", "messages": messages, "stream": True}) as answer:
        for line in answer.iter_lines():
            if '"reasoning_content"' in line or '"content"' in line:
                break  # a delta came: hang up in the middle of the turn
    for _ in range(100):  # the buffer notices, cancels the turn and closes the engine request
        last = httpx.get(f"{engine.url}/sim/requests", timeout=5).json()[-1]
        if last["finish"] == "abort" and engine_running(engine) == 0:
            break
        time.sleep(0.05)
    assert last["finish"] == "abort" and 0 < last["output_tokens"] and engine_running(engine) == 0
    state = httpx.get(f"{buffer.url}/sessions/{session['session_id']}", timeout=10).json()
    assert state["state"] == "open" and state["branches"] == []  # not recorded at all

    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        model="m", messages=messages, stream=True) if c.choices)
    follow_up = [*messages, {"role": "assistant", "content": text}, {"role": "user", "content": "And 8 * 8?"}]
    client.chat.completions.create(model="m", messages=follow_up)
    state = httpx.get(f"{buffer.url}/sessions/{session['session_id']}", timeout=10).json()
    assert [(b["turns"], b["messages"]) for b in state["branches"]] == [(2, 4)]  # the streamed turn was continued
    assert_engine_tokens(engine, finish(buffer.url, session))


def test_a_template_that_opens_think_in_its_prompt_gives_the_reasoning_up_to_think_end(
        qwen_tokenizer_path: str) -> None:
    """Thinking models' templates (e.g. Qwen3 *-Thinking-2507) write `<think>` into the generation prompt: the
    output holds only the reasoning's end tag, and what precedes it is still the reasoning, streamed or not."""
    from transformers import AutoTokenizer

    from rollout_buffer.proxy.replies import ReplyParser
    from rollout_buffer.tokens.conversation import Conversation

    tokenizer = AutoTokenizer.from_pretrained(qwen_tokenizer_path)
    prompt = "{{- '<|im_start|>assistant\\n' }}"
    assert tokenizer.chat_template.count(prompt) == 1
    tokenizer.chat_template = tokenizer.chat_template.replace(prompt, "{{- '<|im_start|>assistant\\n<think>\\n' }}")
    messages = [{"role": "user", "content": "What is 3 + 4?"}]
    assert Conversation(messages, tokenizer).prompt_opens_reasoning
    plain = AutoTokenizer.from_pretrained(qwen_tokenizer_path)
    assert not Conversation(messages, plain).prompt_opens_reasoning
    assert not Conversation(messages, plain, chat_template_kwargs={"enable_thinking": False}).prompt_opens_reasoning

    output = "3 plus 4 is 7.\n</think>\n\nThe answer is 7."
    whole = ReplyParser(False, reasoning_open=True)
    whole.feed(output)
    whole.close()
    streamed = ReplyParser(False, reasoning_open=True)
    for i in range(0, len(output), 3):
        streamed.feed(output[i:i + 3])
    streamed.close()
    for parser in (whole, streamed):
        assert (parser.reasoning, parser.text) == ("3 plus 4 is 7.", "The answer is 7.")
    closed_in_prompt = ReplyParser(False)
    closed_in_prompt.feed("The answer is 7.")
    closed_in_prompt.close()
    assert (closed_in_prompt.reasoning, closed_in_prompt.text) == ("", "The answer is 7.")
