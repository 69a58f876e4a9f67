"""OpenAI Responses (`POST {base_url}/responses`), as Codex and the OpenAI Agents SDK use it.

Requests: `instructions` (the system message); `input` as a string (one user message) or items: `message`
(roles user, system, developer, assistant; `input_text` / `output_text` parts, images as a placeholder),
`function_call` and `custom_tool_call` (the assistant's calls), `function_call_output` and
`custom_tool_call_output` (each answers a call of the same input or of the previous response), `reasoning`
(dropped: a session continues from its exact tokens, reasoning included, and a history rendered afresh leaves
earlier reasoning out as the chat endpoint does). `previous_response_id` names a response of the same session:
its history and answer come before `input`, its request's instructions do not. `tools`: `function`, `custom`
(free-form input, offered to the chat template as a function taking one string `input`), `namespace` (its tools
offered by their own names); hosted tools (`web_search`, `file_search`, ...) are left out of the prompt, since
OpenAI's servers and not the model run them. `tool_choice` (`none` turns call parsing off), `max_output_tokens`,
`temperature`, `top_p`, `stream`; `store`, `include`, `metadata`, `parallel_tool_calls`, `text` and `reasoning` are
echoed in the answer and change nothing.

Replies: output items `reasoning` (the text as `reasoning_text` content), `message` (`output_text`),
`function_call` / `custom_tool_call` with ids; `status` completed, or incomplete with `max_output_tokens`; `usage`.
Streams: response.created and response.in_progress, then per item output_item.added, its content part, its
deltas (output_text, reasoning_text, function_call_arguments, custom_tool_call_input) and their .done events,
output_item.done (Codex takes the items from these); then response.completed or response.incomplete. Every event
carries its sequence number. Errors: OpenAI's error object; inside a stream an `error` event, then response.failed.
"""

from __future__ import annotations

import functools
import secrets
from dataclasses import dataclass, field
from typing import Any

import orjson
from pydantic import BaseModel, ConfigDict, Field

from rollout_buffer.proxy.adapter import StreamState, WireAdapter, ensure_user_turn_last
from rollout_buffer.proxy.history import HistoryCache
from rollout_buffer.proxy.messages import (
    WireError,
    arguments_of,
    assistant_message,
    content_of,
    function_tool,
    merge_assistant_runs,
    text_of,
    tool_call,
)
from rollout_buffer.proxy.openai_chat import openai_error, openai_models
from rollout_buffer.proxy.replies import Reply, ReplyCall, ReplyPart
from rollout_buffer.proxy.session import Session, TurnRequest

# Tools OpenAI's servers run: the model never calls them, so the prompt does not offer them.
HOSTED_TOOLS = frozenset({
    "web_search", "web_search_preview", "web_search_preview_2025_03_11", "web_search_2025_08_26", "file_search",
    "code_interpreter", "image_generation", "mcp",
})
_CUSTOM_PARAMETERS = {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"]}
_CALL_ITEMS = {"function_call": "arguments", "custom_tool_call": "input"}
_OUTPUT_ITEMS = ("function_call_output", "custom_tool_call_output")
_ECHOED = ("instructions", "max_output_tokens", "metadata", "parallel_tool_calls", "previous_response_id",
           "reasoning", "store", "temperature", "text", "tool_choice", "top_p")


class ResponsesBody(BaseModel):
    """The fields of a Responses request the proxy reads (typed as OpenAI's API types them: no coercion)."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: str = "policy"
    input: str | list[Any]
    instructions: str | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stream: bool = False
    store: bool | None = None
    include: list[str] | None = None
    metadata: dict[str, str] | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None


@dataclass
class ResponsesRequest(TurnRequest):
    """A Responses request: what its answer echoes, how its calls map back to output items, and what `bind`
    still has to check once the previous response is known."""

    echo: dict[str, Any] = field(default_factory=dict)
    tools_echo: list[Any] = field(default_factory=list)
    # tool name -> (item type of its calls: function or custom, its namespace)
    tool_kinds: dict[str, tuple[str, str | None]] = field(default_factory=dict)
    previous_response_id: str | None = None
    # with a previous response: outputs whose call is not in the input (call_id, where), for `bind` to find there
    unanswered: list[tuple[str, str]] = field(default_factory=list)


class OpenAIResponsesAdapter(WireAdapter):
    """OpenAI's Responses wire format."""

    protocol = "responses"
    history_key = "input"

    def parse(self, body: Any, history: HistoryCache | None = None) -> ResponsesRequest:
        b = self.validated(ResponsesBody, body)
        head = [{"role": "system", "content": b.instructions}] if b.instructions else []
        items = [{"role": "user", "content": b.input}] if isinstance(b.input, str) else b.input
        unanswered: list[tuple[str, str]] = []
        if b.previous_response_id is None:  # the whole history: what its previous request held is reused
            converted = (history or HistoryCache()).convert(b.instructions, head, items, _input_item)
        else:  # new items only; their outputs may answer the previous response's calls (`bind` checks)
            converted = HistoryCache().convert(b.instructions, head, items, functools.partial(
                _input_item, unanswered=unanswered))
        tools, kinds = _tools(b.tools or [])
        sampling = {k: getattr(b, k) for k in ("temperature", "top_p") if getattr(b, k) is not None}
        return ResponsesRequest(
            protocol=self.protocol,
            model=b.model,
            messages=converted.messages,
            keys=converted.keys,
            tools=tools or None,
            sampling=sampling,
            max_tokens=b.max_output_tokens,
            stops=[],
            stream=b.stream,
            parse_tool_calls=bool(tools) and b.tool_choice != "none",
            response_id=f"resp_{secrets.token_hex(16)}",
            remember=True,
            instructions=1 if b.instructions else 0,
            echo={k: getattr(b, k) for k in _ECHOED},
            tools_echo=list(b.tools or []),
            tool_kinds=kinds,
            previous_response_id=b.previous_response_id,
            unanswered=unanswered,
        )

    def bind(self, req: TurnRequest, session: Session) -> None:
        assert isinstance(req, ResponsesRequest)
        if req.previous_response_id is not None:
            history, history_keys, known = session.continued(req.previous_response_id)
            for call_id, where in req.unanswered:
                if call_id not in known:
                    raise WireError("invalid_request", f"{where}: no tool call {call_id!r} in this input or the "
                                    "previous response to answer", where)
            n, keys = req.instructions, req.keys or []
            joined = [*req.messages[:n], *history, *req.messages[n:]]
            req.messages = merge_assistant_runs(joined)
            # The keys stand unless the input's first message merged into the history's last (both assistant's).
            req.keys = [*keys[:n], *history_keys, *keys[n:]] if len(req.messages) == len(joined) else None
        if not req.messages:
            raise WireError("invalid_request", "input: there is nothing to answer", "input")
        ensure_user_turn_last(req.messages)

    def response(self, req: TurnRequest, reply: Reply) -> dict[str, Any]:
        assert isinstance(req, ResponsesRequest)
        items = []
        if reply.reasoning:
            items.append(_reasoning_item(reply.reasoning))
        if reply.text or not reply.calls:
            items.append(_message_item(reply.text, "incomplete" if reply.finish == "length" else "completed"))
        items += [_call_item(req, c) for c in reply.calls]
        return _response(req, _status(reply), items, reply)

    def stream_head(self, req: TurnRequest, state: StreamState) -> list[bytes]:
        assert isinstance(req, ResponsesRequest)
        opening = _response(req, "in_progress", [], None)
        return [self._event(state, "response.created", response=opening),
                self._event(state, "response.in_progress", response=opening)]

    def stream_ping(self) -> bytes:
        return b": keep-alive\n\n"

    def stream_parts(self, req: TurnRequest, parts: list[ReplyPart], state: StreamState) -> list[bytes]:
        assert isinstance(req, ResponsesRequest)
        events: list[bytes] = []
        for part in parts:
            if part.call is not None:
                events += self._close_item(state)
                events += self._call_events(req, state, part.call)
                continue
            kind = "reasoning" if part.kind == "reasoning" else "message"
            if not state.item_open or state.items[-1]["type"] != kind:
                events += self._close_item(state)
                events += self._open_item(state, _reasoning_item("") if kind == "reasoning" else _message_item(""))
            item = state.items[-1]
            item["content"][0]["text"] += part.text
            delta_type = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
            extra: dict[str, Any] = {} if kind == "reasoning" else {"logprobs": []}
            events.append(self._event(state, delta_type, item_id=item["id"], output_index=len(state.items) - 1,
                                      content_index=0, delta=part.text, **extra))
        return events

    def stream_end(self, req: TurnRequest, reply: Reply, state: StreamState) -> list[bytes]:
        assert isinstance(req, ResponsesRequest)
        events = self._close_item(state)
        if not any(item["type"] != "reasoning" for item in state.items):  # the JSON answer has a message
            events += self._open_item(state, _message_item(""))
            events += self._close_item(state)
        status = _status(reply)
        if status == "incomplete":
            for item in state.items:
                if item["type"] == "message":
                    item["status"] = "incomplete"
        return [*events, self._event(state, f"response.{status}", response=_response(req, status, state.items,
                                                                                      reply))]

    def error_body(self, err: WireError) -> dict[str, Any]:
        return openai_error(err)

    def stream_error(self, req: TurnRequest, err: WireError, state: StreamState) -> bytes:
        assert isinstance(req, ResponsesRequest)
        body = openai_error(err)["error"]
        failed = _response(req, "failed", state.items, None)
        failed["error"] = {"code": body["code"] or body["type"], "message": err.message}
        return (self._event(state, "error", code=body["code"], message=err.message, param=err.param)
                + self._event(state, "response.failed", response=failed))

    def models(self, name: str) -> dict[str, Any]:
        return openai_models(name)

    # ---- stream events -------------------------------------------------------------------------------------
    def _event(self, state: StreamState, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": state.seq, **fields}
        state.seq += 1
        return self.sse(data, kind)

    def _open_item(self, state: StreamState, item: dict[str, Any]) -> list[bytes]:
        state.items.append(item)
        state.item_open = True
        index = len(state.items) - 1
        part = {**item["content"][0], "text": ""}
        return [self._event(state, "response.output_item.added", output_index=index,
                            item={**item, "content": [], "status": "in_progress"}),
                self._event(state, "response.content_part.added", item_id=item["id"], output_index=index,
                            content_index=0, part=part)]

    def _close_item(self, state: StreamState) -> list[bytes]:
        if not state.item_open:
            return []
        state.item_open = False
        item, index = state.items[-1], len(state.items) - 1
        part = item["content"][0]
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        if item["type"] == "reasoning":
            done = self._event(state, "response.reasoning_text.done", **where, text=part["text"])
        else:
            done = self._event(state, "response.output_text.done", **where, text=part["text"], logprobs=[])
        return [done, self._event(state, "response.content_part.done", **where, part=part),
                self._event(state, "response.output_item.done", output_index=index, item=item)]

    def _call_events(self, req: ResponsesRequest, state: StreamState, call: ReplyCall) -> list[bytes]:
        item = _call_item(req, call)
        state.items.append(item)
        index = len(state.items) - 1
        field_name = _CALL_ITEMS[item["type"]]
        stage = "function_call_arguments" if item["type"] == "function_call" else "custom_tool_call_input"
        where = {"item_id": item["id"], "output_index": index}
        return [self._event(state, "response.output_item.added", output_index=index,
                            item={**item, field_name: "", "status": "in_progress"}),
                self._event(state, f"response.{stage}.delta", **where, delta=item[field_name]),
                self._event(state, f"response.{stage}.done", **where, **{field_name: item[field_name]}),
                self._event(state, "response.output_item.done", output_index=index, item=item)]


def _input_item(item: Any, i: int, calls: dict[str, None], unanswered: list[tuple[str, str]] | None = None
                ) -> list[dict[str, Any]]:
    """One input item as canonical messages (none for reasoning). An output must answer a call among `calls` (the
    items' before it); with `unanswered`, one that does not is noted there instead (the previous response may
    hold its call)."""
    where = f"input[{i}]"
    if not isinstance(item, dict):
        raise WireError("invalid_request", f"{where}: an input item must be an object", where)
    kind = item.get("type", "message" if "role" in item else None)
    if not isinstance(kind, str):  # a type given as an object or list is no type (and unhashable)
        kind = None
    if kind == "message":
        return [_message(item, where)]
    if kind in _CALL_ITEMS:
        name, call_id = item.get("name"), item.get("call_id")
        if not isinstance(name, str) or not name:
            raise WireError("invalid_request", f"{where}.name: a {kind} needs the tool's name", f"{where}.name")
        if not isinstance(call_id, str):
            raise WireError("invalid_request", f"{where}.call_id: a {kind} needs a string call_id",
                            f"{where}.call_id")
        calls[call_id] = None
        if kind == "function_call":
            arguments = arguments_of(item.get("arguments"), f"{where}.arguments")
        else:
            arguments = {"input": _string(item.get("input"), f"{where}.input")}
        return [assistant_message("", [tool_call(name, arguments)])]
    if kind in _OUTPUT_ITEMS:
        call_id = item.get("call_id")
        if not isinstance(call_id, str):
            raise WireError("invalid_request", f"{where}.call_id: a {kind} needs the call_id of its call",
                            f"{where}.call_id")
        if call_id not in calls:
            if unanswered is None:
                raise WireError("invalid_request", f"{where}.call_id: no tool call {call_id!r} in this input or the "
                                "previous response to answer", f"{where}.call_id")
            unanswered.append((call_id, f"{where}.call_id"))
        return [{"role": "tool", "content": content_of(item.get("output"), f"{where}.output")}]
    if kind == "reasoning":
        return []
    raise WireError("invalid_request", f"{where}.type: unsupported input item type {kind!r} (message, "
                    "function_call, function_call_output, custom_tool_call, custom_tool_call_output and "
                    "reasoning are)", f"{where}.type")


def _message(item: dict[str, Any], where: str) -> dict[str, Any]:
    role = item.get("role")
    if role in ("system", "developer", "user"):
        return {"role": "user" if role == "user" else "system",
                "content": content_of(item.get("content"), f"{where}.content")}
    if role == "assistant":
        return assistant_message(text_of(item.get("content"), f"{where}.content"), [])
    raise WireError("invalid_request", f"{where}.role: unknown role {role!r}", f"{where}.role")


def _string(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise WireError("invalid_request", f"{where} must be a string", where)
    return value


def _tools(raw: list[Any]) -> tuple[list[dict[str, Any]], dict[str, tuple[str, str | None]]]:
    """The tools the template offers, and each one's call type and namespace by name."""
    tools: list[dict[str, Any]] = []
    kinds: dict[str, tuple[str, str | None]] = {}

    def add(t: Any, where: str, namespace: str | None) -> None:
        if not isinstance(t, dict):
            raise WireError("invalid_request", f"{where}: a tool must be an object", where)
        kind = t.get("type")
        if kind == "function":
            tools.append(function_tool(t.get("name"), t.get("description"), t.get("parameters"), where))
        elif kind == "custom":
            tools.append(function_tool(t.get("name"), _custom_description(t), _CUSTOM_PARAMETERS, where))
        else:
            raise WireError("invalid_request", f"{where}.type: {kind!r} tools cannot be offered through the chat "
                            "template (function, custom and namespace tools can; hosted tools are left out)",
                            f"{where}.type")
        kinds[t["name"]] = (kind, namespace)

    for i, t in enumerate(raw):
        where = f"tools[{i}]"
        kind = t.get("type") if isinstance(t, dict) else None
        if isinstance(kind, str) and kind in HOSTED_TOOLS:
            continue
        if kind == "namespace":
            inner = t.get("tools")
            if not isinstance(inner, list):
                raise WireError("invalid_request", f"{where}.tools: a namespace holds a list of tools",
                                f"{where}.tools")
            for j, tool in enumerate(inner):
                add(tool, f"{where}.tools[{j}]", t.get("name"))
        else:
            add(t, where, None)
    return tools, kinds


def _custom_description(tool: dict[str, Any]) -> Any:
    """A custom tool's description, with its input grammar when it has one (the model must follow it)."""
    description, fmt = tool.get("description"), tool.get("format")
    if isinstance(fmt, dict) and fmt.get("type") == "grammar" and isinstance(fmt.get("definition"), str):
        head = description if isinstance(description, str) else ""
        return f"{head}\n\nThe input follows this {fmt.get('syntax', '')} grammar:\n{fmt['definition']}".strip()
    return description


def _item_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_hex(16)}"


def _reasoning_item(text: str) -> dict[str, Any]:
    return {"id": _item_id("rs"), "type": "reasoning", "summary": [],
            "content": [{"type": "reasoning_text", "text": text}], "encrypted_content": None, "status": "completed"}


def _message_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {"id": _item_id("msg"), "type": "message", "role": "assistant", "status": status,
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}]}


def _call_item(req: ResponsesRequest, call: ReplyCall) -> dict[str, Any]:
    kind, namespace = req.tool_kinds.get(call.name, ("function", None))
    item: dict[str, Any]
    if kind == "custom":
        given = call.arguments.get("input")
        text = given if isinstance(given, str) and len(call.arguments) == 1 else orjson.dumps(call.arguments).decode()
        item = {"id": _item_id("ctc"), "type": "custom_tool_call", "status": "completed", "call_id": call.id,
                "name": call.name, "input": text}
    else:
        item = {"id": _item_id("fc"), "type": "function_call", "status": "completed", "call_id": call.id,
                "name": call.name, "arguments": orjson.dumps(call.arguments).decode()}
    if namespace is not None:
        item["namespace"] = namespace
    return item


def _status(reply: Reply) -> str:
    return "incomplete" if reply.finish == "length" else "completed"


def _response(req: ResponsesRequest, status: str, output: list[dict[str, Any]], reply: Reply | None
              ) -> dict[str, Any]:
    echo = req.echo
    usage = None
    if reply is not None:
        usage = {"input_tokens": reply.prompt_tokens, "input_tokens_details": {"cached_tokens": 0},
                 "output_tokens": reply.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                 "total_tokens": reply.prompt_tokens + reply.completion_tokens}
    return {
        "id": req.response_id, "object": "response", "created_at": req.created, "status": status,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": echo["instructions"], "max_output_tokens": echo["max_output_tokens"], "model": req.model,
        "output": output, "parallel_tool_calls": echo["parallel_tool_calls"] is not False,
        "previous_response_id": echo["previous_response_id"],
        "reasoning": echo["reasoning"] or {"effort": None, "summary": None},
        "store": echo["store"] is not False, "temperature": echo["temperature"],
        "text": echo["text"] or {"format": {"type": "text"}}, "tool_choice": echo["tool_choice"] or "auto",
        "tools": req.tools_echo, "top_p": echo["top_p"], "truncation": "disabled", "usage": usage, "user": None,
        "metadata": echo["metadata"] or {},
    }
