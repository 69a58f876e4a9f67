"""The Responses API of a session (`POST /sessions/{id}/v1/responses`) over real HTTP with the official `openai`
client and the OpenAI Agents SDK's default model: tool round trips continued by `previous_response_id` and by a
resent history, custom and namespace tools, streams whose events their parsers take, a rewritten history, exact
tokens in the records, OpenAI error objects for bad input and for an engine failing mid-stream, a client that hangs
up, 256 sessions at once."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import httpx
import openai
import pytest
from masks import spans
from runs import drain
from servers import Server, session_host, sim_engine
from sessions import RESULTS, assert_engine_tokens, finish, key_of, open_session, record, view

CALC_PARAMETERS = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
TOOLS: list[Any] = [{"type": "function", "name": "calculator", "description": "Evaluate arithmetic.",
                     "parameters": CALC_PARAMETERS, "strict": False}]
PARALLEL_TASK = "Compute 12 * 7 + 3 and 45 - 6 in parallel, using the calculator."


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("responses-sim"), qwen_tokenizer_path) as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory, engine: Server, qwen_tokenizer_path: str) -> Iterator[Server]:
    # engine_outage_s 0: an engine failing past the client's retries fails the turn at once (the error events are
    # tested here; waiting out an outage in tests/test_reliability.py).
    with session_host(tmp_path_factory.mktemp("responses-buffer"), engine.url, qwen_tokenizer_path,
                      num_repeat_per_sample=2, max_tokens=4096, engine_outage_s=0) as srv:
        yield srv


def client_of(session: dict[str, Any]) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)


def outputs(response: Any) -> list[dict[str, Any]]:
    """The calculator's answers to the function calls of a response, as input items."""
    return [{"type": "function_call_output", "call_id": item.call_id,
             "output": RESULTS[json.loads(item.arguments)["expression"]]}
            for item in response.output if item.type == "function_call"]


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_a_tool_round_trip_continued_by_previous_response_id(buffer: Server, engine: Server, stream: bool) -> None:
    session = open_session(buffer.url, f"responses-{stream}")
    client = client_of(session)

    def ask(**body: Any) -> Any:
        if not stream:
            return client.responses.create(model="my-model", tools=TOOLS, **body)
        with client.responses.stream(model="my-model", tools=TOOLS, **body) as events:
            return events.get_final_response()

    first = ask(instructions="You are careful.", input=PARALLEL_TASK)
    assert first.status == "completed" and first.id.startswith("resp_")
    assert [item.type for item in first.output] == ["reasoning", "function_call", "function_call"]
    assert first.output[0].content[0].text.startswith("I will compute")
    calls = [item for item in first.output if item.type == "function_call"]
    assert [json.loads(c.arguments) for c in calls] == [{"expression": e} for e in RESULTS]
    assert len({c.call_id for c in calls}) == 2 and all(c.id.startswith("fc_") for c in calls)
    assert first.usage.input_tokens > 0 and first.usage.output_tokens > 0

    second = ask(instructions="You are careful.", input=outputs(first), previous_response_id=first.id)
    assert second.status == "completed" and second.previous_response_id == first.id
    assert second.output_text == "The results are: 12 * 7 + 3 = 87, 45 - 6 = 39."

    assert [(b["branch"], b["turns"], b["tool_calls"]) for b in view(buffer.url, session)["branches"]] == [(0, 2, 2)]
    rec = record(buffer.url, finish(buffer.url, session, 1.0)["uids"][0])
    assert rec["status"] == "completed" and rec["extra_info"]["protocols"] == ["responses"]
    assert "tokenization_mismatch" not in rec["extra_info"]
    assert len(spans(rec["loss_mask"])) == 2
    assert_engine_tokens(engine, rec)


def test_a_resent_history_continues_and_a_rewritten_one_branches(buffer: Server, engine: Server) -> None:
    """Codex's way: `store: false` and the whole history every turn, its own reasoning and calls included."""
    session = open_session(buffer.url, "responses-resent")
    client = client_of(session)
    task = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be careful."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": PARALLEL_TASK}]}]
    first = client.responses.create(model="m", input=task, tools=TOOLS, store=False)
    history = [*task, *[item.model_dump(exclude_none=True) for item in first.output], *outputs(first)]
    second = client.responses.create(model="m", input=history, tools=TOOLS, store=False)
    assert second.output_text.startswith("The results are")
    assert [(b["turns"], b["messages"]) for b in view(buffer.url, session)["branches"]] == [(2, 6)]

    # The agent drops the calls from its history and asks again: a new branch, rendered from the messages.
    rewritten = [*task, {"type": "message", "role": "user", "content": "Just tell me 45 - 6."}]
    client.responses.create(model="m", input=rewritten, tools=TOOLS, store=False)
    assert [b["turns"] for b in view(buffer.url, session)["branches"]] == [2, 1]
    stored = finish(buffer.url, session, 1.0)
    assert stored["records"] == 2
    for uid in stored["uids"]:
        assert_engine_tokens(engine, record(buffer.url, uid))


def test_stream_events_come_in_the_order_their_parsers_need(buffer: Server) -> None:
    session = open_session(buffer.url, "responses-events")
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{session['base_url']}/responses", timeout=30, headers=key_of(session), json={
            "model": "m", "input": PARALLEL_TASK, "tools": TOOLS, "stream": True}) as answer:
        assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/event-stream")
        name = None
        for line in answer.iter_lines():
            if line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                event = json.loads(line.removeprefix("data: "))
                assert event["type"] == name
                events.append(event)
    kinds = [e["type"] for e in events]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds[2:9] == ["response.output_item.added", "response.content_part.added", *(
        ["response.reasoning_text.delta"] * kinds.count("response.reasoning_text.delta")),
        "response.reasoning_text.done", "response.content_part.done", "response.output_item.done"][:7]
    assert kinds.count("response.function_call_arguments.delta") == 2
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert done == events[-1]["response"]["output"]
    assert [item["type"] for item in done] == ["reasoning", "function_call", "function_call"]
    added = [e["item"] for e in events if e["type"] == "response.output_item.added"]
    assert [a["id"] for a in added] == [d["id"] for d in done] and added[1]["arguments"] == ""
    finish(buffer.url, session, 0.0)


def test_a_reply_cut_by_max_output_tokens_is_incomplete(buffer: Server) -> None:
    session = open_session(buffer.url, "responses-cut")
    response = client_of(session).responses.create(model="m", input="What is 2 + 3?", max_output_tokens=3)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3
    with client_of(session).responses.stream(model="m", input="What is 2 + 3?", max_output_tokens=3) as events:
        assert [e.type for e in events][-1] == "response.incomplete"
    finish(buffer.url, session, 0.0)


def test_bad_input_gets_openai_errors_naming_the_field(buffer: Server) -> None:
    session = open_session(buffer.url, "responses-bad")
    other = open_session(buffer.url, "responses-bad-other")
    client = client_of(session)
    first = client.responses.create(model="m", input="What is 2 + 3?")

    def refused(param: str, **body: Any) -> str:
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(model="m", **body)
        assert e.value.body["type"] == "invalid_request_error" and e.value.body["param"] == param, e.value.body
        return str(e.value.body["message"])

    assert "no response" in refused("previous_response_id", input="and?", previous_response_id="resp_nope")
    other_first = client_of(other).responses.create(model="m", input="What is 1 + 1?")
    refused("previous_response_id", input="and?", previous_response_id=other_first.id)
    assert "no tool call 'call_x'" in refused("input[0].call_id", input=[
        {"type": "function_call_output", "call_id": "call_x", "output": "4"}], previous_response_id=first.id)
    assert "unsupported input item type 'local_shell_call'" in refused("input[0].type", input=[
        {"type": "local_shell_call", "call_id": "c", "action": {}}])
    refused("input[1]", input=[{"role": "user", "content": "What?"}, 3])
    refused("input[0].name", input=[{"type": "function_call", "call_id": "c", "arguments": "{}"}])
    refused("tools[0].type", input="hi", tools=[{"type": "computer_use_preview", "display_width": 1}])
    refused("input", input=[])
    refused("temperature", input="hi", temperature=5)
    raw = httpx.post(f"{session['base_url']}/responses", content=b"{not json", timeout=10,
                     headers={"content-type": "application/json", "authorization": f"Bearer {session['api_key']}"})
    assert raw.status_code == 400 and raw.json()["error"]["type"] == "invalid_request_error"

    # Nothing refused left a trace; hosted tools are left out of the prompt, so this continues the first branch.
    later = client.responses.create(model="m", input="And 4 * 5?", previous_response_id=first.id,
                                    tools=[{"type": "web_search"}])
    assert later.status == "completed"
    assert [(b["turns"], b["messages"]) for b in view(buffer.url, session)["branches"]] == [(2, 4)]
    finish(buffer.url, session, 0.0)
    finish(buffer.url, other, 0.0)


def test_custom_and_namespace_tools_come_back_as_their_own_calls(buffer: Server) -> None:
    """A custom tool's call is a `custom_tool_call` (its input as text) answered by a `custom_tool_call_output`;
    a namespace's tool is called by its own name, the call naming the namespace."""
    session = open_session(buffer.url, "responses-custom")
    client = client_of(session)
    task = "What is 12 * 7 + 3? Use the calculator."
    custom: list[Any] = [{"type": "custom", "name": "calculator", "description": "Evaluate arithmetic."}]
    first = client.responses.create(model="m", input=task, tools=custom)
    call = next(item for item in first.output if item.type == "custom_tool_call")
    assert call.name == "calculator" and "12 * 7 + 3" in call.input
    second = client.responses.create(model="m", previous_response_id=first.id, tools=custom, input=[
        {"type": "custom_tool_call_output", "call_id": call.call_id, "output": "87"}])
    # The calculator's answer came back: the model answers (right or off, as the simulated engine draws it).
    assert second.status == "completed" and "The answer is \\boxed{" in second.output_text
    assert [(b["turns"], b["tool_calls"]) for b in view(buffer.url, session)["branches"]] == [(2, 1)]
    finish(buffer.url, session, 1.0)

    # Streamed, a custom call is its input's events, then the item.
    streamed = open_session(buffer.url, "responses-custom-stream")
    with httpx.stream("POST", f"{streamed['base_url']}/responses", timeout=30, headers=key_of(streamed), json={
            "model": "m", "input": task, "tools": custom, "stream": True}) as answer:
        events = [json.loads(line.removeprefix("data: ")) for line in answer.iter_lines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    at = kinds.index("response.custom_tool_call_input.delta")
    assert kinds[at - 1:at + 3] == ["response.output_item.added", "response.custom_tool_call_input.delta",
                                    "response.custom_tool_call_input.done", "response.output_item.done"]
    item = events[at + 2]["item"]
    assert item["type"] == "custom_tool_call" and item["input"] == events[at]["delta"] == events[at + 1]["input"]
    assert events[-1]["response"]["output"][-1] == item
    finish(buffer.url, streamed, 0.0)

    other = open_session(buffer.url, "responses-namespace")
    namespace: list[Any] = [{"type": "namespace", "name": "math", "description": "Math tools.", "tools": TOOLS}]
    called = client_of(other).responses.create(model="m", input=task, tools=namespace)
    assert [(i.type, i.name, i.namespace) for i in called.output if i.type != "reasoning"] == [
        ("function_call", "calculator", "math")]
    finish(buffer.url, other, 0.0)


def test_an_engine_failure_mid_stream_is_an_error_event_then_response_failed(buffer: Server, engine: Server) -> None:
    session = open_session(buffer.url, "responses-engine-down")
    # Failures past the engine client's 3 retries; their backoff outlasts the 0.25 s before a stream opens.
    httpx.post(f"{engine.url}/sim/faults", json={"next": ["http_500"] * 4}, timeout=5).raise_for_status()
    events: list[dict[str, Any]] = []
    with httpx.stream("POST", f"{session['base_url']}/responses", timeout=30, headers=key_of(session), json={
            "model": "m", "input": "What is 2 + 3?", "stream": True}) as answer:
        assert answer.status_code == 200
        events = [json.loads(line.removeprefix("data: ")) for line in answer.iter_lines() if line.startswith("data: ")]
    assert [e["type"] for e in events] == ["response.created", "response.in_progress", "error", "response.failed"]
    assert events[-1]["response"]["status"] == "failed" and events[-1]["response"]["error"]["message"]
    assert view(buffer.url, session)["branches"] == [], "the failed turn left nothing"
    finish(buffer.url, session, 0.0)


def test_a_client_that_hangs_up_mid_stream_leaves_no_response(buffer: Server, engine: Server) -> None:
    session = open_session(buffer.url, "responses-hang-up")
    client = client_of(session)
    first = client.responses.create(model="m", input="What is 9 * 9?")
    httpx.post(f"{engine.url}/sim/faults", json={"next": ["hang"]}, timeout=5).raise_for_status()
    with httpx.stream("POST", f"{session['base_url']}/responses", timeout=30, headers=key_of(session), json={
            "model": "m", "input": "And 8 * 8?", "previous_response_id": first.id, "stream": True}) as answer:
        assert next(answer.iter_lines()) == "event: response.created"
    for _ in range(100):
        if not view(buffer.url, session)["branches"][0]["busy"]:
            break
        time.sleep(0.05)
    assert [(b["turns"], b["messages"]) for b in view(buffer.url, session)["branches"]] == [(1, 2)]
    again = client.responses.create(model="m", input="And 8 * 8?", previous_response_id=first.id)
    assert again.status == "completed"
    assert [(b["turns"], b["messages"]) for b in view(buffer.url, session)["branches"]] == [(2, 4)]
    assert finish(buffer.url, session, 1.0)["records"] == 1


def test_the_agents_sdk_default_model_calls_a_function_tool(buffer: Server, engine: Server) -> None:
    agents = pytest.importorskip("agents")
    session = open_session(buffer.url, "responses-agents-sdk")
    client = openai.AsyncOpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    used: list[str] = []

    @agents.function_tool
    def calculator(expression: str) -> str:
        """Evaluate arithmetic."""
        used.append(expression)
        return RESULTS[expression]

    agent = agents.Agent(name="calc", instructions="You are careful.", tools=[calculator],
                         model=agents.OpenAIResponsesModel(model="policy", openai_client=client))
    result = asyncio.run(agents.Runner.run(agent, PARALLEL_TASK, run_config=agents.RunConfig(tracing_disabled=True)))
    assert used == list(RESULTS) and result.final_output == "The results are: 12 * 7 + 3 = 87, 45 - 6 = 39."
    assert [(b["turns"], b["tool_calls"]) for b in view(buffer.url, session)["branches"]] == [(2, 2)]
    rec = record(buffer.url, finish(buffer.url, session, 1.0)["uids"][0])
    assert_engine_tokens(engine, rec)


def test_256_concurrent_responses_sessions(buffer: Server) -> None:
    drain(buffer.url, wait_s=0.1)

    async def post(http: aiohttp.ClientSession, url: str, body: dict[str, Any], key: str = "") -> dict[str, Any]:
        async with http.post(url, json=body, headers={"authorization": f"Bearer {key}"} if key else {}) as answer:
            assert answer.status == 200, await answer.text()
            return await answer.json()

    async def one(http: aiohttp.ClientSession, i: int) -> None:
        opened = await post(http, f"{buffer.url}/sessions", {"instance_id": f"responses-many-{i // 2}"})
        url = opened["base_url"] + "/responses"
        first = await post(http, url, {"model": "m", "input": f"What is {i} * 3 + 1?", "tools": TOOLS},
                           opened["api_key"])
        call = next(item for item in first["output"] if item["type"] == "function_call")
        answer = await post(http, url, {"model": "m", "previous_response_id": first["id"], "tools": TOOLS, "input": [
            {"type": "function_call_output", "call_id": call["call_id"], "output": str(i * 3 + 1)}]}, opened["api_key"])
        assert answer["status"] == "completed" and answer["output"][-1]["type"] == "message", answer
        done = await post(http, f"{buffer.url}/sessions/{opened['session_id']}/finish", {"reward": i % 3})
        assert done["records"] == 1, done

    async def main() -> None:
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=120)) as http:
            await asyncio.gather(*(one(http, i) for i in range(256)))

    asyncio.run(main())
    records = drain(buffer.url, wait_s=0.5)
    assert len([r for r in records if r["instance_id"].startswith("responses-many-")]) == 256
