"""Driving agent sessions in tests: open, view and finish a session over HTTP, the calculator task the proxy tests
give, and the checks that a session's trained tokens are the engine's own."""

from __future__ import annotations

import json
from typing import Any

import httpx
from masks import spans
from servers import Server

PARALLEL_TASK = "Compute 12 * 7 + 3 and 45 - 6 in parallel, using the calculator."
CALC_PARAMETERS = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}
OPENAI_TOOLS = [{"type": "function", "function": {"name": "calculator", "description": "Evaluate arithmetic.",
                                                  "parameters": CALC_PARAMETERS}}]
ANTHROPIC_TOOLS = [{"name": "calculator", "description": "Evaluate arithmetic.", "input_schema": CALC_PARAMETERS}]
RESULTS = {"12 * 7 + 3": "87", "45 - 6": "39"}



def key_of(session: dict[str, Any]) -> dict[str, str]:
    """The header proving a request may drive `session` (its key; a session's API always asks for it)."""
    return {"authorization": f"Bearer {session['api_key']}"}


def open_session(url: str, instance_id: str, **extra: Any) -> dict[str, Any]:
    answer = httpx.post(f"{url}/sessions", json={"instance_id": instance_id, **extra}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def finish(url: str, session: dict[str, Any], reward: float) -> dict[str, Any]:
    answer = httpx.post(f"{url}/sessions/{session['session_id']}/finish", json={"reward": reward}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def view(url: str, session: dict[str, Any]) -> dict[str, Any]:
    return httpx.get(f"{url}/sessions/{session['session_id']}", timeout=10).json()


def record(url: str, uid: str) -> dict[str, Any]:
    answer = httpx.get(f"{url}/trajectories/{uid}", timeout=10)
    assert answer.status_code == 200, answer.text
    return answer.json()


def tool_results(calls: Any) -> list[dict[str, Any]]:
    """The calculator's answers to OpenAI tool calls."""
    return [{"role": "tool", "tool_call_id": c.id, "content": RESULTS[json.loads(c.function.arguments)["expression"]]}
            for c in calls]


def decode_tail(ids: list[int]) -> str:
    from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path, load_tokenizer

    return load_tokenizer(bundled_tokenizer_path()).decode(ids)


def assert_engine_tokens(engine: Server, rec: dict[str, Any]) -> None:
    """Every trained span of a record is exactly what the engine returns for the tokens before it, and the
    engine was sent exactly those tokens (no re-rendering of earlier turns)."""
    prompt_tokens = {r["prompt_tokens"] for r in httpx.get(f"{engine.url}/sim/requests", timeout=10).json()}
    tokens, mask = rec["tokens"], rec["loss_mask"]
    assert len(mask) == len(tokens) and rec["response_length"] == len(tokens) - next(i for i, m in enumerate(mask) if m)
    for start, end in spans(mask):
        assert start in prompt_tokens, "the engine was sent this exact prefix"
        again = httpx.post(f"{engine.url}/generate", timeout=30, json={
            "input_ids": tokens[:start], "sampling_params": {"max_new_tokens": 4096}}).json()
        assert again["output_ids"] == tokens[start:end]


def assert_engine_continues(engine: Server, rec: dict[str, Any]) -> None:
    """Every trained span is the engine's own output for exactly the tokens before it: resent with the span's
    first token, the simulated engine continues the reply it generated for that exact prefix (a new prefix
    would get a new scripted reply), and it was sent a prompt of that length."""
    prompts = {r["prompt_tokens"] for r in httpx.get(f"{engine.url}/sim/requests", timeout=10).json()}
    tokens, mask = rec["tokens"], rec["loss_mask"]
    assert len(mask) == len(tokens) and spans(mask)
    for begin, end in spans(mask):
        assert begin in prompts, "the engine was sent a prompt of this length"
        again = httpx.post(f"{engine.url}/generate", timeout=30, json={
            "input_ids": tokens[:begin + 1], "sampling_params": {"max_new_tokens": 4096}}).json()
        assert again["output_ids"] == tokens[begin + 1:end]
