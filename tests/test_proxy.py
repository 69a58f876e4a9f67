"""The agent proxy over real HTTP: the official `openai` and `anthropic` clients (sync and async, streaming and
not) against a buffer whose agent run hosts sessions, generating on the simulated engine with the real Qwen3
tokenizer. Exact tokens, branches of a rewritten history, protocol-shaped errors, a client that hangs up, 256
sessions at once."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import anthropic
import httpx
import openai
import pytest
from masks import spans
from runs import drain
from servers import Server, free_port, running, session_host, sim_engine
from sessions import (
    ANTHROPIC_TOOLS,
    OPENAI_TOOLS,
    PARALLEL_TASK,
    RESULTS,
    assert_engine_tokens,
    decode_tail,
    finish,
    key_of,
    open_session,
    record,
    tool_results,
    view,
)

from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.proxy.anthropic_messages import AnthropicMessagesAdapter
from rollout_buffer.proxy.messages import WireError
from rollout_buffer.proxy.session import ProxyOptions, Session


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("proxy-sim"), qwen_tokenizer_path) as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory, engine: Server, qwen_tokenizer_path: str) -> Iterator[Server]:
    """A buffer holding an agent run without input (sessions only), groups of 2 sessions per instance id."""
    with session_host(tmp_path_factory.mktemp("proxy-buffer"), engine.url, qwen_tokenizer_path,
                      num_repeat_per_sample=2, max_tokens=4096) as srv:
        yield srv


# ------------------------------------------------------------------ OpenAI


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_openai_client_multi_turn_with_parallel_tool_calls(buffer: Server, engine: Server, stream: bool) -> None:
    session = open_session(buffer.url, f"openai-{stream}")
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are careful."},
                                      {"role": "user", "content": PARALLEL_TASK}]

    def ask() -> tuple[Any, str, Any]:
        if not stream:
            reply = client.chat.completions.create(model="my-model", messages=messages, tools=OPENAI_TOOLS)
            return reply.choices[0].message, reply.choices[0].finish_reason, reply.usage
        with client.chat.completions.stream(model="my-model", messages=messages, tools=OPENAI_TOOLS,
                                            stream_options={"include_usage": True}) as events:
            final = events.get_final_completion()
        return final.choices[0].message, final.choices[0].finish_reason, final.usage

    message, finish_reason, usage = ask()
    assert finish_reason == "tool_calls" and message.content is None
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [{"expression": e} for e in RESULTS]
    assert len({c.id for c in message.tool_calls}) == 2
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    messages.append({"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in message.tool_calls]})
    messages += tool_results(message.tool_calls)
    message, finish_reason, usage = ask()
    assert finish_reason == "stop" and message.tool_calls is None
    assert message.content == "The results are: 12 * 7 + 3 = 87, 45 - 6 = 39."

    tree = view(buffer.url, session)
    assert [(b["branch"], b["turns"], b["tool_calls"]) for b in tree["branches"]] == [(0, 2, 2)]
    assert session["finish_url"] == f"{buffer.url}/sessions/{session['session_id']}/finish"
    stored = finish(buffer.url, session, 1.0)
    rec = record(buffer.url, stored["uids"][0])
    assert rec["status"] == "completed" and rec["extra_info"]["branch"] == 0
    assert "tokenization_mismatch" not in rec["extra_info"]
    assert len(spans(rec["loss_mask"])) == 2 and len(rec["rollout_log_probs"]) == rec["response_length"]
    assert_engine_tokens(engine, rec)


def test_async_openai_client_and_models(buffer: Server) -> None:
    session = open_session(buffer.url, "openai-async")

    async def main() -> tuple[Any, Any]:
        client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
        models = await client.models.list()
        chunks = [c async for c in await client.chat.completions.create(
            model="m", stream=True, messages=[{"role": "user", "content": "What is 6 * 7?"}])]
        return models, chunks

    models, chunks = asyncio.run(main())
    assert [m.id for m in models.data] == ["policy"]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "\\boxed{" in text and chunks[-1].choices[0].finish_reason == "stop"
    assert finish(buffer.url, session, 0.0)["records"] == 1


# ------------------------------------------------------------------ Anthropic


@pytest.mark.parametrize(("use_async", "stream"), [(False, False), (False, True), (True, True)],
                         ids=["sync-json", "sync-stream", "async-stream"])
def test_anthropic_client_tool_use(buffer: Server, engine: Server, use_async: bool, stream: bool) -> None:
    session = open_session(buffer.url, f"anthropic-{use_async}-{stream}")
    kwargs = {"base_url": session["anthropic_base_url"], "api_key": session["api_key"], "max_retries": 0}
    messages: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": PARALLEL_TASK}]}]
    request = {"model": "claude-x", "max_tokens": 1024, "system": "You are careful.", "tools": ANTHROPIC_TOOLS}

    async def ask_async() -> Any:
        client = anthropic.AsyncAnthropic(**kwargs)
        if stream:
            async with client.messages.stream(messages=messages, **request) as events:
                return await events.get_final_message()
        return await client.messages.create(messages=messages, **request)

    def ask() -> Any:
        if use_async:
            return asyncio.run(ask_async())
        client = anthropic.Anthropic(**kwargs)
        if stream:
            with client.messages.stream(messages=messages, **request) as events:
                return events.get_final_message()
        return client.messages.create(messages=messages, **request)

    counted = anthropic.Anthropic(**kwargs).messages.count_tokens(
        model="claude-x", messages=messages, system="You are careful.", tools=ANTHROPIC_TOOLS)
    reply = ask()
    assert reply.stop_reason == "tool_use" and reply.usage.input_tokens == counted.input_tokens > 0
    uses = [b for b in reply.content if b.type == "tool_use"]
    assert [u.input for u in uses] == [{"expression": e} for e in RESULTS]
    assert [b.type for b in reply.content] == ["thinking", "tool_use", "tool_use"]
    assert reply.content[0].signature, "clients send a thinking block back only with its signature"
    messages.append({"role": "assistant", "content": [b.model_dump() for b in reply.content]})
    messages.append({"role": "user", "content": [
        {"type": "tool_result", "tool_use_id": u.id, "content": RESULTS[u.input["expression"]]} for u in uses]})
    reply = ask()
    assert reply.stop_reason == "end_turn" and reply.usage.output_tokens > 0
    assert reply.content[-1].text == "The results are: 12 * 7 + 3 = 87, 45 - 6 = 39."
    assert [b["turns"] for b in view(buffer.url, session)["branches"]] == [2]
    rec = record(buffer.url, finish(buffer.url, session, 1.0)["uids"][0])
    assert rec["extra_info"]["protocols"] == ["anthropic"]
    assert_engine_tokens(engine, rec)


def test_anthropic_system_messages_anywhere_are_rendered_where_they_stand(buffer: Server) -> None:
    """Claude Code's mid-conversation system messages: counted and answered, and kept in place in the record."""
    session = open_session(buffer.url, "anthropic-mid-system")
    url = session["anthropic_base_url"]
    body = {"model": "claude-x", "system": "You are careful.", "messages": [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "system", "content": "Answer with a boxed number."},
        {"role": "user", "content": [{"type": "text", "text": "Go on."}]}]}
    key = {"x-api-key": session["api_key"]}
    counted = httpx.post(f"{url}/v1/messages/count_tokens", json=body, timeout=30, headers=key)
    reply = httpx.post(f"{url}/v1/messages", json={**body, "max_tokens": 256}, timeout=30, headers=key)
    assert counted.status_code == reply.status_code == 200, (counted.text, reply.text)
    assert reply.json()["usage"]["input_tokens"] == counted.json()["input_tokens"] > 0
    rec = record(buffer.url, finish(buffer.url, session, 1.0)["uids"][0])
    assert [m["role"] for m in rec["messages"]] == ["system", "user", "system", "user", "assistant"]
    prompt = decode_tail(rec["tokens"][:rec["loss_mask"].index(1)])
    assert prompt.index("What is 2 + 3?") < prompt.index("<|im_start|>system\nAnswer with a boxed number.")


# ------------------------------------------------------------------ branches


def test_a_rewritten_history_becomes_a_second_branch(buffer: Server, engine: Server) -> None:
    session = open_session(buffer.url, "rewrite", metadata={"task": "branching"})
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": PARALLEL_TASK}]
    first = client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS).choices[0].message
    messages.append(first.model_dump(exclude_none=True))  # reasoning_content echoed back: still the same turn
    results = tool_results(first.tool_calls)
    client.chat.completions.create(model="m", messages=[*messages, *results], tools=OPENAI_TOOLS)
    # The agent rewrites its history: an edited tool result after the first turn → a branch forked at turn 1.
    edited = [{**results[0], "content": "88"}, results[1]]
    forked = client.chat.completions.create(model="m", messages=[*messages, *edited], tools=OPENAI_TOOLS)
    assert "12 * 7 + 3 = 88" in forked.choices[0].message.content
    branches = view(buffer.url, session)["branches"]
    assert [(b["branch"], b["parent_branch"], b["fork_turn"], b["turns"], b["own_turns"]) for b in branches] == [
        (0, None, 0, 2, 2), (1, 0, 1, 2, 1)]

    stored = finish(buffer.url, session, 1.0)
    assert stored["records"] == 2 and [u.rsplit("-", 1)[1] for u in stored["uids"]] == ["0", "1"]
    main, fork = (record(buffer.url, uid) for uid in stored["uids"])
    episode = main["uid"].rsplit("-", 1)[0]
    for rec, branch, parent in ((main, 0, None), (fork, 1, 0)):
        info = rec["extra_info"]
        assert (info["branch"], info["parent_branch"], info["episode_id"]) == (branch, parent, episode)
        assert info["episode_reward"] == 1.0 and rec["reward"] == 1.0 and info["metadata"] == {"task": "branching"}
    # The fork holds the first turn's exact tokens as context (its prompt, loss 0) up to the edited tool result,
    # then trains its own turn only.
    prompt = len(fork["tokens"]) - fork["response_length"]
    same = next(i for i, (a, b) in enumerate(zip(fork["tokens"], main["tokens"], strict=False)) if a != b)
    assert same >= spans(main["loss_mask"])[0][1] and "88" in decode_tail(fork["tokens"][same - 1:prompt])
    assert not any(fork["loss_mask"][:prompt]) and [s for s, _ in spans(fork["loss_mask"])] == [prompt]
    assert_engine_tokens(engine, fork)


def test_conversations_the_client_names_apart_stay_apart(buffer: Server) -> None:
    """Two agent runs that send the same history under their own `X-Session-ID` (verifiers: a trace id each)
    keep a branch each, with that id as its lane; a run continues only its own lane's branch."""
    session = open_session(buffer.url, "lanes")
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 6 + 7?"}]

    def ask(lane: str, history: list[dict[str, Any]]) -> dict[str, Any]:
        answer = httpx.post(f"{session['base_url']}/chat/completions", timeout=60, headers={
            "Authorization": f"Bearer {session['api_key']}", "X-Session-ID": lane},
            json={"model": "m", "messages": history, "max_tokens": 256, "temperature": 0})
        assert answer.status_code == 200, answer.text
        message: dict[str, Any] = answer.json()["choices"][0]["message"]
        return {"role": "assistant", "content": message["content"]}

    first = {lane: ask(lane, messages) for lane in ("trace-a", "trace-b")}
    for lane in ("trace-a", "trace-b"):  # each run's second turn, even where both first replies are the same
        ask(lane, [*messages, first[lane], {"role": "user", "content": "And 8 + 9?"}])
    branches = view(buffer.url, session)["branches"]
    assert sorted((b["lane"], b["turns"], b["own_turns"]) for b in branches) == [("trace-a", 2, 2),
                                                                                 ("trace-b", 2, 2)]
    stored = finish(buffer.url, session, 1.0)
    assert sorted(record(buffer.url, uid)["extra_info"]["lane"] for uid in stored["uids"]) == ["trace-a", "trace-b"]


# ------------------------------------------------------------------ bad input


def test_bad_requests_get_protocol_shaped_errors_and_the_session_stays_consistent(buffer: Server) -> None:
    session = open_session(buffer.url, "bad-input")
    base, anthropic_base, key = session["base_url"], session["anthropic_base_url"], session["api_key"]
    client = openai.OpenAI(base_url=base, api_key=key, max_retries=0)
    user = [{"role": "user", "content": "What is 2 + 3?"}]
    client.chat.completions.create(model="m", messages=user)

    with pytest.raises(openai.NotFoundError) as unknown:
        openai.OpenAI(base_url=base.replace(session["session_id"], "s-nope"), api_key=key, max_retries=0
                      ).chat.completions.create(model="m", messages=user)
    assert unknown.value.body["type"] == "invalid_request_error" and "unknown session" in unknown.value.body["message"]
    with pytest.raises(anthropic.NotFoundError) as unknown_a:
        anthropic.Anthropic(base_url=anthropic_base.replace(session["session_id"], "s-nope"), api_key=key,
                            max_retries=0).messages.create(model="m", max_tokens=10, messages=user)
    assert unknown_a.value.body["type"] == "error" and unknown_a.value.body["error"]["type"] == "not_found_error"

    raw = httpx.post(f"{base}/chat/completions", content=b"{not json", timeout=10,
                     headers={"content-type": "application/json", **key_of(session)})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as no_messages:
        client.chat.completions.create(model="m", messages=[])
    assert no_messages.value.body["param"] == "messages"
    with pytest.raises(openai.BadRequestError) as custom_tool:
        client.chat.completions.create(model="m", messages=user, tools=[{"type": "custom", "custom": {"name": "x"}}])
    assert custom_tool.value.body["param"] == "tools[0]"
    with pytest.raises(openai.BadRequestError) as prefill:
        client.chat.completions.create(model="m", messages=[*user, {"role": "assistant", "content": "It is"}])
    assert "last message" in prefill.value.body["message"]
    with pytest.raises(anthropic.BadRequestError) as server_tool:
        anthropic.Anthropic(base_url=anthropic_base, api_key=key, max_retries=0).messages.create(
            model="m", max_tokens=10, messages=user, tools=[{"type": "bash_20250124", "name": "bash"}])
    assert server_tool.value.body["error"]["type"] == "invalid_request_error"
    assert "tools[0]" in server_tool.value.body["error"]["message"]
    bad_block = httpx.post(f"{anthropic_base}/v1/messages", timeout=10, headers={"x-api-key": key}, json={
        "model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "video"}]}]})
    assert bad_block.status_code == 400 and bad_block.json()["type"] == "error"

    # After all that, the session still holds one branch of one turn, and continues it.
    assert [(b["turns"], b["busy"]) for b in view(buffer.url, session)["branches"]] == [(1, False)]
    history = [*user, {"role": "assistant", "content": client.chat.completions.create(
        model="m", messages=user).choices[0].message.content}, {"role": "user", "content": "And 4 * 5?"}]
    client.chat.completions.create(model="m", messages=history)
    assert [b["turns"] for b in view(buffer.url, session)["branches"]] == [1, 2]
    assert finish(buffer.url, session, 0.5)["records"] == 2

    # Finishing it again, or a session that never was: slime's error shape with the status and the reason.
    again = httpx.post(f"{buffer.url}/sessions/{session['session_id']}/finish", json={"reward": 1.0}, timeout=10)
    assert again.status_code == 409 and again.json()["success"] is False and "already" in again.json()["message"]
    nope = httpx.post(f"{buffer.url}/sessions/s-nope/finish", json={"reward": 1.0}, timeout=10)
    assert nope.status_code == 404 and "unknown session 's-nope'" in nope.json()["message"]


def test_a_template_that_cannot_render_the_tools_is_a_client_error(qwen_tokenizer: Any) -> None:
    tokenizer = copy.deepcopy(qwen_tokenizer)
    tokenizer.chat_template = ("{% if tools %}{{ raise_exception('this model has no tool format') }}{% endif %}"
                               + qwen_tokenizer.chat_template)
    run = RunResources("run", "agent", {}, engine=None, tokenizer=tokenizer, sampling_params={},  # type: ignore[arg-type]
                       max_tokens=None)
    ctx = RolloutContext(run, "0", 0, 0, "run:0:0:0")
    session = Session("s-1", "key", ctx, "generator", ProxyOptions(), "http://x/v1", "http://x")
    req = AnthropicMessagesAdapter().parse({"messages": [{"role": "user", "content": "hi"}], "tools": ANTHROPIC_TOOLS})
    with pytest.raises(WireError) as refused:
        asyncio.run(session.count_tokens(req))
    assert (refused.value.status, refused.value.param) == (400, "tools")
    assert "this model has no tool format" in refused.value.message


def test_bodies_over_the_cap_are_refused_in_the_clients_protocol(tmp_path, engine: Server,
                                                                    qwen_tokenizer_path: str) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--max-body-bytes", "4096"]
    with running(args, "/healthz", port, tmp_path / "buffer.log") as srv:
        httpx.post(f"{srv.url}/start_rollout", timeout=30, json={
            "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
        }).raise_for_status()
        session = open_session(srv.url, "big")
        base, key = session["base_url"], session["api_key"]
        huge = [{"role": "user", "content": "x" * 5000}]
        with pytest.raises(openai.APIStatusError) as declared:
            openai.OpenAI(base_url=base, api_key=key, max_retries=0).chat.completions.create(model="m", messages=huge)
        assert declared.value.status_code == 413 and declared.value.body["code"] == "request_too_large"
        assert "4096" in declared.value.body["message"]
        with pytest.raises(anthropic.APIStatusError) as declared_a:
            anthropic.Anthropic(base_url=session["anthropic_base_url"], api_key=key, max_retries=0).messages.create(
                model="m", max_tokens=10, messages=huge)
        assert declared_a.value.status_code == 413
        assert declared_a.value.body["error"]["type"] == "request_too_large"

        def chunks() -> Iterator[bytes]:  # no Content-Length: the cap is found while the body is read
            yield b'{"model": "m", "messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 1000
            yield b'"}]}'

        streamed = httpx.post(f"{base}/chat/completions", content=chunks(), timeout=10,
                              headers={"content-type": "application/json", "authorization": f"Bearer {key}"})
        assert streamed.status_code == 413, streamed.text
        assert streamed.json()["error"]["code"] == "request_too_large"
        small = [{"role": "user", "content": "What is 2 + 3?"}]
        openai.OpenAI(base_url=base, api_key=key, max_retries=0).chat.completions.create(model="m", messages=small)
        assert [(b["turns"], b["messages"]) for b in view(srv.url, session)["branches"]] == [(1, 2)]
        big_record = httpx.post(f"{srv.url}/buffer/write", json={"content": "z" * 5000}, timeout=10)
        assert big_record.status_code == 413 and "4096" in big_record.json()["message"]  # slime's shape elsewhere


def test_a_client_that_hangs_up_leaves_no_half_turn(buffer: Server, engine: Server) -> None:
    session = open_session(buffer.url, "hang-up")
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    user = [{"role": "user", "content": "What is 9 * 9?"}]
    first = client.chat.completions.create(model="m", messages=user).choices[0].message.content
    follow_up = [*user, {"role": "assistant", "content": first}, {"role": "user", "content": "And 8 * 8?"}]
    for stream in (True, False):
        httpx.post(f"{engine.url}/sim/faults", json={"next": ["hang"]}, timeout=5).raise_for_status()
        if stream:
            with httpx.stream("POST", f"{session['base_url']}/chat/completions", timeout=30, headers=key_of(session),
                              json={"model": "m", "messages": follow_up, "stream": True}) as answer:
                first_line = next(answer.iter_lines())
            assert first_line.startswith("data: ") and '"role":"assistant"' in first_line  # the stream was open
        else:
            with pytest.raises(httpx.ReadTimeout):
                httpx.post(f"{session['base_url']}/chat/completions", timeout=1.0, headers=key_of(session),
                           json={"model": "m", "messages": follow_up})
        for _ in range(100):  # the server notices the hang-up and cancels the turn
            if not view(buffer.url, session)["branches"][0]["busy"]:
                break
            time.sleep(0.05)
        branches = view(buffer.url, session)["branches"]
        assert [(b["turns"], b["messages"], b["busy"]) for b in branches] == [(1, 2, False)]
    client.chat.completions.create(model="m", messages=follow_up)
    assert [(b["turns"], b["messages"]) for b in view(buffer.url, session)["branches"]] == [(2, 4)]
    assert finish(buffer.url, session, 1.0)["records"] == 1


# ------------------------------------------------------------------ many sessions, grouping, delivery


def test_256_concurrent_sessions_grouped_and_delivered(buffer: Server) -> None:
    drain(buffer.url, wait_s=0.1)  # what earlier tests completed

    async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str = "") -> dict[str, Any]:
        async with http.post(url, json=body, headers={"authorization": f"Bearer {key}"} if key else {}) as answer:
            assert answer.status == 200, await answer.text()
            return await answer.json()

    async def one(http: aiohttp.ClientSession, i: int) -> str:
        # Plain HTTP (aiohttp: httpx's pool and the SDK would cost the test more CPU than the buffer): open a
        # session, a tool call, its answer, finish.
        opened = await post(http, f"{buffer.url}/sessions", {"instance_id": f"many-{i // 2}"})
        url = opened["base_url"] + "/chat/completions"
        messages: list[dict[str, Any]] = [{"role": "user", "content": f"What is {i} * 3 + 1?"}]
        call = (await post(http, url, {"model": "m", "messages": messages, "tools": OPENAI_TOOLS}, opened["api_key"])
                )["choices"][0]["message"]
        messages += [{"role": "assistant", "content": None, "tool_calls": call["tool_calls"]},
                     {"role": "tool", "tool_call_id": call["tool_calls"][0]["id"], "content": str(i * 3 + 1)}]
        answer = await post(http, url, {"model": "m", "messages": messages, "tools": OPENAI_TOOLS}, opened["api_key"])
        assert answer["choices"][0]["finish_reason"] == "stop", answer
        done = await post(http, f"{buffer.url}/sessions/{opened['session_id']}/finish", {"reward": i % 3})
        assert done["records"] == 1, done
        return opened["session_id"]

    async def main() -> list[str]:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as http:
            return await asyncio.gather(*(one(http, i) for i in range(256)))

    assert len(set(asyncio.run(main()))) == 256
    records = drain(buffer.url, wait_s=0.5)
    by_instance: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_instance.setdefault(r["instance_id"], []).append(r)
    assert len(by_instance) == 128 and all(len(g) == 2 for g in by_instance.values())
    assert all(len(spans(r["loss_mask"])) == 2 and r["extra_info"]["branch_turns"] == 2 for r in records)
    assert sorted(r["raw_reward"] for r in records) == sorted(float(i % 3) for i in range(256))
    assert httpx.get(f"{buffer.url}/sessions", timeout=10).json()["sessions"] == []
