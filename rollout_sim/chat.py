"""`POST /v1/chat/completions` on the simulated engine: OpenAI's shape (not streamed) over the same scheduler as
`/generate`; tool calls parsed as SGLang's `--tool-call-parser` does when the engine has one (`tool_calls`)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from jinja2 import TemplateError
from starlette.responses import Response

from rollout_sim.contract import CHAT_SAMPLING_KEYS, SIM_MODEL_NAME, ChatRequest, GenerateRequest, Refused
from rollout_sim.detokenizer import Detokenizer
from rollout_sim.engine import SimEngine
from rollout_sim.replies import finish_response, openai_error, token_logprob
from rollout_sim.requests import Output
from rollout_sim.tool_calls import normalize_history, parse_tool_calls
from rollout_sim.turns import Turn


async def chat(engine: SimEngine, body: ChatRequest) -> Response:
    """Answer one chat request on `engine`, faults included."""
    fault = engine.faults.next()
    replaced = await engine.faults.response(fault)
    if replaced is not None:
        return replaced
    if body.stream:
        return openai_error(400, "streaming is not simulated", "BadRequestError")
    extra = body.model_extra or {}
    params = {k: extra[k] for k in CHAT_SAMPLING_KEYS if k in extra}
    # `max_completion_tokens or max_tokens`: absent means no limit but the context.
    params["max_new_tokens"] = body.max_completion_tokens or body.max_tokens
    started = time.time()
    try:
        normalize_history(body.messages)
        text = await asyncio.to_thread(
            engine.tokenizer.apply_chat_template, body.messages, tools=body.tools, add_generation_prompt=True,
            tokenize=False, **(body.chat_template_kwargs or {}),
        )
        ids = await asyncio.to_thread(engine.tokenizer.encode, text, add_special_tokens=False)
        sampling, known = await engine.admit(ids, params)
    except Refused as e:
        return openai_error(e.status, e.message, e.err_type)
    except (ValueError, TypeError, KeyError, TemplateError) as e:
        return openai_error(400, str(e), "BadRequest")
    rid = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
    gen = GenerateRequest(input_ids=ids, return_logprob=body.logprobs, rid=rid)
    out = Output(Detokenizer(engine.tokenizer, ids, sampling.skip_special_tokens, sampling.no_stop_trim))
    answer: dict[str, Any] = {}
    turn: Turn | None = None
    async for event, turn, req in engine.run(rid, ids, sampling, known, fault, stream=False):
        answer = engine.answer(gen, rid, ids, sampling, event, turn, req, out, started)
    engine.record("/v1/chat/completions", rid, ids, sampling, answer, turn.policy if turn else None, fault)
    meta = answer["meta_info"]
    finish_reason = meta["finish_reason"]
    status = finish_reason.get("status_code") if finish_reason.get("type") == "abort" else None
    if status == 400:
        return openai_error(400, finish_reason["message"], "BadRequestError")
    if isinstance(status, int) and status >= 400:
        return openai_error(status, finish_reason["message"], str(status))
    output = answer["output_ids"]
    logprobs = None
    if body.logprobs:
        first = turn.first_position if turn else 0
        logprobs = {"content": [{"token": engine.tokenizer.decode([t]),
                                 "logprob": token_logprob(t, first + i, engine.weights), "top_logprobs": []}
                                for i, t in enumerate(output)]}
    content, calls, finish = answer["text"], None, finish_reason["type"]
    matched = finish_reason.get("matched")
    if engine.config.tool_call_parser and body.tools and extra.get("tool_choice", "auto") != "none":
        parsed = parse_tool_calls(content, body.tools)
        if parsed is not None:
            (content, calls), finish = parsed, "tool_calls" if finish == "stop" else finish
            matched = None if finish == "tool_calls" else matched
    choice = {
        "index": 0,
        "message": {"role": "assistant", "content": content, "tool_calls": calls, "reasoning_content": None},
        "logprobs": logprobs,
        "finish_reason": finish,
        "matched_stop": matched,
    }
    n_in, n_out = len(ids), len(output)
    metadata = {"weight_version": meta["weight_version"]}
    if "weight_versions" in meta:
        metadata["weight_versions"] = meta["weight_versions"]
    payload = {
        "id": rid,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": SIM_MODEL_NAME,
        "choices": [choice],
        "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
        "metadata": metadata,
    }
    return finish_response(payload, fault)

