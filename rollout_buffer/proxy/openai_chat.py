"""OpenAI Chat Completions (`POST {base_url}/chat/completions`, `GET {base_url}/models`).

Requests: `messages` (system / developer / user / assistant with `tool_calls` / tool), function `tools`,
`tool_choice` (`none` turns tool-call parsing off; other values are not enforced), `max_tokens` or
`max_completion_tokens`, `temperature`, `top_p`, `top_k`, `seed`, `stop`, presence / frequency penalties,
`stream` and `stream_options.include_usage`; `n` must be 1. Other fields are accepted and ignored.
Replies: `content` (null when the turn only calls tools), `reasoning_content` when the model reasoned,
`tool_calls` with ids and JSON-string arguments, `finish_reason` stop / length / tool_calls, `usage`.
Errors: `{"error": {"message", "type", "param", "code"}}`; inside a stream, a `data:` event holding it.
"""

from __future__ import annotations

import secrets
import time
from typing import Annotated, Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from rollout_buffer.proxy.adapter import StreamState, WireAdapter, ensure_user_turn_last
from rollout_buffer.proxy.history import HistoryCache
from rollout_buffer.proxy.messages import (
    WireError,
    arguments_of,
    assistant_message,
    content_of,
    documented_messages,
    function_tool,
    text_of,
    tool_call,
)
from rollout_buffer.proxy.replies import Reply, ReplyPart
from rollout_buffer.proxy.session import TurnRequest

_ERROR_TYPES = {
    "invalid_request": ("invalid_request_error", None),
    "context_length": ("invalid_request_error", "context_length_exceeded"),
    "authentication": ("invalid_request_error", "invalid_api_key"),
    "permission": ("permission_error", "permission_denied"),
    "not_found": ("invalid_request_error", "not_found"),
    "too_large": ("invalid_request_error", "request_too_large"),
    "media_type": ("invalid_request_error", "unsupported_media_type"),
    "server": ("server_error", None),
    "engine": ("server_error", "engine_unavailable"),
    "restoring": ("server_error", "session_restoring"),
}
_SAMPLING = ("temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty")


class ChatBody(BaseModel):
    """The fields of a chat-completions request the proxy reads (typed as OpenAI's API types them: no coercion)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = "policy"
    # Each message is checked as it is converted, and only past the part the session's previous request held.
    messages: Annotated[list[Any], documented_messages(["system", "developer", "user", "assistant",
                                                                    "tool", "function"])] = Field(min_length=1)
    tools: list[Any] | None = None
    tool_choice: Any = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    n: int = Field(default=1, ge=1, le=1)
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)


class OpenAIChatAdapter(WireAdapter):
    """OpenAI's chat-completions wire format."""

    protocol = "openai"

    def parse(self, body: Any, history: HistoryCache | None = None) -> TurnRequest:
        b = self.validated(ChatBody, body)
        converted = (history or HistoryCache()).convert(None, [], b.messages, lambda m, i, _calls: [_message(m, i)])
        messages = converted.messages
        ensure_user_turn_last(messages)
        tools = [_tool(t, i) for i, t in enumerate(b.tools or [])] or None
        parse_calls = tools is not None and b.tool_choice != "none"
        stops = [b.stop] if isinstance(b.stop, str) else list(b.stop or [])
        return TurnRequest(
            protocol=self.protocol,
            model=b.model,
            messages=messages,
            tools=tools,
            sampling={k: getattr(b, k) for k in _SAMPLING if getattr(b, k) is not None},
            max_tokens=b.max_completion_tokens or b.max_tokens,
            stops=stops,
            stream=b.stream,
            include_usage=bool((b.stream_options or {}).get("include_usage")),
            parse_tool_calls=parse_calls,
            response_id=f"chatcmpl-{secrets.token_hex(12)}",
            keys=converted.keys,
        )

    def response(self, req: TurnRequest, reply: Reply) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": _content(reply), "refusal": None}
        if reply.reasoning:
            message["reasoning_content"] = reply.reasoning
        if reply.calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function",
                 "function": {"name": c.name, "arguments": orjson.dumps(c.arguments).decode()}}
                for c in reply.calls
            ]
        return {
            "id": req.response_id,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": req.model,
            "choices": [{"index": 0, "message": message, "finish_reason": _finish(reply), "logprobs": None}],
            "usage": _usage(reply),
            "system_fingerprint": None,
        }

    def stream_head(self, req: TurnRequest, state: StreamState) -> list[bytes]:
        # No content yet: a reply that only calls tools keeps `content: null`, as in the JSON answer.
        return [self.sse(_chunk(req, {"role": "assistant"}, None))]

    def stream_ping(self) -> bytes:
        return b": keep-alive\n\n"

    def stream_parts(self, req: TurnRequest, parts: list[ReplyPart], state: StreamState) -> list[bytes]:
        events = []
        for part in parts:
            if part.call is None:
                field_name = "reasoning_content" if part.kind == "reasoning" else "content"
                events.append(self.sse(_chunk(req, {field_name: part.text}, None)))
                continue
            c, i = part.call, state.calls
            state.calls += 1
            opening = {"index": i, "id": c.id, "type": "function", "function": {"name": c.name, "arguments": ""}}
            events.append(self.sse(_chunk(req, {"tool_calls": [opening]}, None)))
            arguments = {"index": i, "function": {"arguments": orjson.dumps(c.arguments).decode()}}
            events.append(self.sse(_chunk(req, {"tool_calls": [arguments]}, None)))
        return events

    def stream_end(self, req: TurnRequest, reply: Reply, state: StreamState) -> list[bytes]:
        events = [self.sse(_chunk(req, {}, _finish(reply)))]
        if req.include_usage:
            events.append(self.sse({**_chunk(req, {}, None), "choices": [], "usage": _usage(reply)}))
        events.append(b"data: [DONE]\n\n")
        return events

    def error_body(self, err: WireError) -> dict[str, Any]:
        return openai_error(err)

    def stream_error(self, req: TurnRequest, err: WireError, state: StreamState) -> bytes:
        return self.sse(self.error_body(err))

    def models(self, name: str) -> dict[str, Any]:
        return openai_models(name)


def openai_error(err: WireError) -> dict[str, Any]:
    """OpenAI's error object (chat completions and responses alike)."""
    kind, code = _ERROR_TYPES[err.kind]
    return {"error": {"message": err.message, "type": kind, "param": err.param, "code": code}}


def openai_models(name: str) -> dict[str, Any]:
    """`GET /models` in OpenAI's shape: the one model a session serves."""
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "rollout-buffer"}]}


def _message(m: Any, i: int) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise WireError("invalid_request", f"{where}: a message must be an object", where)
    role = m.get("role")
    if role in ("system", "developer"):
        return {"role": "system", "content": content_of(m.get("content"), f"{where}.content")}
    if role in ("user", "tool", "function"):
        return {"role": "user" if role == "user" else "tool", "content": content_of(m.get("content"),
                                                                                    f"{where}.content")}
    if role != "assistant":
        raise WireError("invalid_request", f"{where}.role: unknown role {role!r}", f"{where}.role")
    content = text_of(m.get("content"), f"{where}.content")
    calls = m.get("tool_calls") or []
    if not isinstance(calls, list):
        raise WireError("invalid_request", f"{where}.tool_calls must be a list", f"{where}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        at = f"{where}.tool_calls[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise WireError("invalid_request", f"{at}: needs function.name", at)
        out.append(tool_call(function["name"], arguments_of(function.get("arguments"), f"{at}.function.arguments")))
    return assistant_message(content, out)


def _tool(t: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict) or t.get("type", "function") != "function" or not isinstance(t.get("function"), dict):
        kind = t.get("type") if isinstance(t, dict) else type(t).__name__
        raise WireError("invalid_request", f"{where}: only function tools can be rendered by the chat template "
                        f"(got {kind!r})", where)
    f = t["function"]
    return function_tool(f.get("name"), f.get("description"), f.get("parameters"), where)


def _content(reply: Reply) -> str | None:
    return reply.text if reply.text or not reply.calls else None


def _finish(reply: Reply) -> str:
    return "stop" if reply.finish == "stop_sequence" else reply.finish


def _usage(reply: Reply) -> dict[str, int]:
    return {"prompt_tokens": reply.prompt_tokens, "completion_tokens": reply.completion_tokens,
            "total_tokens": reply.prompt_tokens + reply.completion_tokens}


def _chunk(req: TurnRequest, delta: dict[str, Any], finish: str | None) -> dict[str, Any]:
    chunk: dict[str, Any] = {
        "id": req.response_id, "object": "chat.completion.chunk", "created": req.created, "model": req.model,
        "system_fingerprint": None,
        "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
    }
    if req.include_usage:
        chunk["usage"] = None
    return chunk
