"""Anthropic Messages (`POST {anthropic_base_url}/v1/messages`, `/v1/messages/count_tokens`, `GET /v1/models`).

Requests: `system` (a string or text blocks), `messages` of user / assistant content (text, image as a
placeholder, `tool_use`, `tool_result`; `thinking` and `redacted_thinking` dropped, as the chat template drops
earlier reasoning) and `system` messages anywhere among them (Claude Code's mid-conversation system messages,
rendered where they stand), custom `tools` with an `input_schema` (server tools such as `bash_…` cannot be
rendered by a chat template and are refused), `tool_choice` (`none` turns parsing off), `max_tokens`,
`temperature`, `top_p`, `top_k`, `stop_sequences`, `stream`; other fields (`thinking`, `metadata`,
`context_management`, `output_config`) and beta headers are accepted and change nothing. Replies: `thinking`
(with an opaque signature), `text` and `tool_use` blocks, `stop_reason` end_turn / max_tokens / stop_sequence /
tool_use, `usage`. Streams: message_start, ping, content_block_start / _delta / _stop per block, message_delta,
message_stop. Errors: `{"type": "error", "error": {"type", "message"}}`, inside a stream an `error` event.
"""

from __future__ import annotations

import secrets
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
from rollout_buffer.proxy.replies import Reply, ReplyCall, ReplyPart
from rollout_buffer.proxy.session import TurnRequest

_ERROR_TYPES = {
    "invalid_request": "invalid_request_error",
    "context_length": "invalid_request_error",
    "authentication": "authentication_error",
    "permission": "permission_error",
    "not_found": "not_found_error",
    "too_large": "request_too_large",
    "media_type": "invalid_request_error",
    "server": "api_error",
    "engine": "api_error",
    "restoring": "api_error",
}
_STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use", "stop_sequence": "stop_sequence"}
_SAMPLING = ("temperature", "top_p", "top_k")
_BLOCK_TYPES = {"reasoning": "thinking", "text": "text", "call": "tool_use"}


# An assistant message's blocks beside text: tool calls, and reasoning (which the template drops).
_ASSISTANT_BLOCKS = (
    {"type": "object", "required": ["type", "name"],
     "properties": {"type": {"const": "tool_use"}, "name": {"type": "string"}}},
    {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["thinking", "redacted_thinking"]}}},
)


class MessagesBody(BaseModel):
    """The fields of a Messages request the proxy reads (count_tokens takes the same, max_tokens aside)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = "policy"
    # Each message is checked as it is converted, and only past the part the session's previous request held.
    messages: Annotated[list[Any], documented_messages(["user", "assistant", "system"],
                                                                         *_ASSISTANT_BLOCKS)] = Field(
        min_length=1)
    system: str | list[dict[str, Any]] | None = None
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    stream: bool = False
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = Field(default=None, ge=1)
    stop_sequences: list[str] | None = None


class AnthropicMessagesAdapter(WireAdapter):
    """Anthropic's Messages wire format."""

    protocol = "anthropic"

    def parse(self, body: Any, history: HistoryCache | None = None) -> TurnRequest:
        b = self.validated(MessagesBody, body)
        system = text_of(b.system, "system") if b.system else None
        head = [{"role": "system", "content": system}] if system is not None else []
        converted = (history or HistoryCache()).convert(system, head, b.messages, lambda m, i, _calls: _messages(m, i))
        messages = converted.messages
        ensure_user_turn_last(messages)
        tools = [_tool(t, i) for i, t in enumerate(b.tools or [])] or None
        return TurnRequest(
            protocol=self.protocol,
            model=b.model,
            messages=messages,
            tools=tools,
            sampling={k: getattr(b, k) for k in _SAMPLING if getattr(b, k) is not None},
            max_tokens=b.max_tokens,
            stops=list(b.stop_sequences or []),
            stream=b.stream,
            parse_tool_calls=tools is not None and (b.tool_choice or {}).get("type") != "none",
            response_id=f"msg_{secrets.token_hex(12)}",
            keys=converted.keys,
        )

    def response(self, req: TurnRequest, reply: Reply) -> dict[str, Any]:
        return {**self._message(req, reply), "content": _blocks(reply)}

    def _message(self, req: TurnRequest, reply: Reply | None) -> dict[str, Any]:
        return {
            "id": req.response_id,
            "type": "message",
            "role": "assistant",
            "model": req.model,
            "content": [],
            "stop_reason": _STOP_REASONS[reply.finish] if reply else None,
            "stop_sequence": reply.stop_sequence if reply else None,
            "usage": {"input_tokens": reply.prompt_tokens if reply else 0,
                      "output_tokens": reply.completion_tokens if reply else 0},
        }

    def stream_head(self, req: TurnRequest, state: StreamState) -> list[bytes]:
        return [self.sse({"type": "message_start", "message": self._message(req, None)}, "message_start"),
                self.stream_ping()]

    def stream_ping(self) -> bytes:
        return self.sse({"type": "ping"}, "ping")

    def stream_parts(self, req: TurnRequest, parts: list[ReplyPart], state: StreamState) -> list[bytes]:
        events: list[bytes] = []
        for part in parts:
            kind = _BLOCK_TYPES[part.kind]
            if state.open != kind or part.call is not None:
                events += self._close_block(state)
                events.append(self._open_block(state, kind, part))
            if part.call is not None:
                delta = {"type": "input_json_delta", "partial_json": orjson.dumps(part.call.arguments).decode()}
                events.append(self._delta(state, delta))
                events += self._close_block(state)
            elif kind == "thinking":
                events.append(self._delta(state, {"type": "thinking_delta", "thinking": part.text}))
            else:
                events.append(self._delta(state, {"type": "text_delta", "text": part.text}))
        return events

    def stream_end(self, req: TurnRequest, reply: Reply, state: StreamState) -> list[bytes]:
        events = []
        if "text" not in state.opened and not reply.calls:  # the JSON answer has a text block, empty or not
            events += self._close_block(state)
            events.append(self._open_block(state, "text", None))
        events += self._close_block(state)
        delta = {"stop_reason": _STOP_REASONS[reply.finish], "stop_sequence": reply.stop_sequence}
        usage = {"input_tokens": reply.prompt_tokens, "output_tokens": reply.completion_tokens}
        events.append(self.sse({"type": "message_delta", "delta": delta, "usage": usage}, "message_delta"))
        events.append(self.sse({"type": "message_stop"}, "message_stop"))
        return events

    def _open_block(self, state: StreamState, kind: str, part: ReplyPart | None) -> bytes:
        state.block += 1
        state.open = kind
        state.opened.add(kind)
        if part is not None and part.call is not None:
            start: dict[str, Any] = {"type": "tool_use", "id": _tool_use_id(part.call), "name": part.call.name,
                                     "input": {}}
        elif kind == "thinking":
            start = {"type": "thinking", "thinking": "", "signature": ""}
        else:
            start = {"type": "text", "text": ""}
        return self.sse({"type": "content_block_start", "index": state.block, "content_block": start},
                        "content_block_start")

    def _delta(self, state: StreamState, delta: dict[str, Any]) -> bytes:
        return self.sse({"type": "content_block_delta", "index": state.block, "delta": delta}, "content_block_delta")

    def _close_block(self, state: StreamState) -> list[bytes]:
        if state.open is None:
            return []
        events = []
        if state.open == "thinking":  # clients keep a thinking block only with its signature
            events.append(self._delta(state, {"type": "signature_delta", "signature": _signature()}))
        events.append(self.sse({"type": "content_block_stop", "index": state.block}, "content_block_stop"))
        state.open = None
        return events

    def error_body(self, err: WireError) -> dict[str, Any]:
        return {"type": "error", "error": {"type": _ERROR_TYPES[err.kind], "message": err.message}}

    def stream_error(self, req: TurnRequest, err: WireError, state: StreamState) -> bytes:
        return self.sse(self.error_body(err), "error")

    def models(self, name: str) -> dict[str, Any]:
        model = {"type": "model", "id": name, "display_name": name, "created_at": "1970-01-01T00:00:00Z"}
        return {"data": [model], "has_more": False, "first_id": name, "last_id": name}


def _messages(m: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as canonical messages: a user message may hold tool results (each a tool message)
    between its text; an assistant message is one message with its tool calls."""
    where = f"messages[{i}]"
    if not isinstance(m, dict):
        raise WireError("invalid_request", f"{where}: a message must be an object", where)
    role, content = m.get("role"), m.get("content")
    if role == "system":
        return [{"role": "system", "content": content_of(content, f"{where}.content")}]
    if role not in ("user", "assistant"):
        raise WireError("invalid_request", f"{where}.role: must be user, assistant or system, not {role!r}",
                        f"{where}.role")
    blocks = content if isinstance(content, list) else [{"type": "text", "text": text_of(content, where)}]
    if role == "assistant":
        texts: list[str] = []
        calls = []
        for j, block in enumerate(blocks):
            at = f"{where}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "tool_use":
                if not isinstance(block.get("name"), str):
                    raise WireError("invalid_request", f"{at}: a tool_use block needs a name", at)
                calls.append(tool_call(block["name"], arguments_of(block.get("input"), f"{at}.input")))
            elif kind not in ("thinking", "redacted_thinking"):
                texts.append(text_of([block], at))
        return [assistant_message("\n".join(t for t in texts if t), calls)]
    out: list[dict[str, Any]] = []
    pending: list[Any] = []
    for j, block in enumerate(blocks):
        if isinstance(block, dict) and block.get("type") == "tool_result":
            if pending:
                out.append({"role": "user", "content": content_of(pending, f"{where}.content")})
                pending = []
            out.append({"role": "tool", "content": content_of(block.get("content"), f"{where}.content[{j}].content")})
        else:
            pending.append(block)
    if pending or not out:
        out.append({"role": "user", "content": content_of(pending, f"{where}.content")})
    return out


def _tool(t: Any, i: int) -> dict[str, Any]:
    where = f"tools[{i}]"
    if not isinstance(t, dict):
        raise WireError("invalid_request", f"{where}: a tool must be an object", where)
    kind = t.get("type")
    if kind not in (None, "custom") or "input_schema" not in t:
        raise WireError("invalid_request", f"{where}: only custom tools with an input_schema can be rendered by the "
                        f"chat template (got type {kind!r})", where)
    return function_tool(t.get("name"), t.get("description"), t.get("input_schema"), where)


def _blocks(reply: Reply) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if reply.reasoning:
        blocks.append({"type": "thinking", "thinking": reply.reasoning, "signature": _signature()})
    if reply.text or not reply.calls:
        blocks.append({"type": "text", "text": reply.text})
    blocks.extend({"type": "tool_use", "id": _tool_use_id(c), "name": c.name, "input": c.arguments}
                  for c in reply.calls)
    return blocks


def _signature() -> str:
    """An opaque signature for a thinking block: clients send the block back with it, the proxy ignores both (the
    session continues from its exact tokens)."""
    return "rb_" + secrets.token_urlsafe(24)


def _tool_use_id(call: ReplyCall) -> str:
    return "toolu_" + call.id.removeprefix("call_")
