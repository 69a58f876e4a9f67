"""The wire-format contract: one small base, a few hooks per protocol.

A protocol adapter turns a parsed JSON body into a `TurnRequest` (`parse`), a served turn into its
protocol's response (`response`) or server-sent events (`stream_head` when the stream opens, `stream_ping`
while waiting, `stream_parts` as the reply's parts are parsed, `stream_end` with the whole reply), and a
`WireError` into its protocol's error object (`error_body`, `stream_error`). Everything else (sessions,
routing in the tree, generation) is the same for every protocol and lives in `session`.

Streams follow the engine token by token: each reasoning or text piece the reply parser gives out becomes a
delta at once, a tool call becomes the protocol's tool-call events once its block is whole. A `StreamState`
per stream remembers what is open (Anthropic's content blocks, OpenAI's tool-call indexes, the Responses API's
output items and event numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from rollout_buffer.proxy.history import HistoryCache
from rollout_buffer.proxy.messages import WireError
from rollout_buffer.proxy.replies import Reply, ReplyPart
from rollout_buffer.proxy.session import Session, TurnRequest

_M = TypeVar("_M", bound=BaseModel)


@dataclass
class StreamState:
    """What one stream has sent so far."""

    block: int = -1  # index of the last content block opened (Anthropic)
    open: str | None = None  # type of the content block still open (Anthropic)
    opened: set[str] = field(default_factory=set)  # types of the blocks opened so far (Anthropic)
    calls: int = 0  # tool calls sent
    seq: int = 0  # the next event's sequence number (Responses)
    items: list[dict[str, Any]] = field(default_factory=list)  # output items, the last one maybe still open (Responses)
    item_open: bool = False  # the last of `items` is still being streamed (Responses)


class WireAdapter:
    """Base of the protocol adapters; subclasses fill the hooks below."""

    protocol: ClassVar[str] = ""
    history_key: ClassVar[str] = "messages"  # the body's field holding the conversation (`request_bodies`)

    def parse(self, body: Any, history: HistoryCache | None = None) -> TurnRequest:
        """The request, translated; WireError naming the bad field. With the session's `history`, what its
        previous request already converted is reused."""
        raise NotImplementedError

    def response(self, req: TurnRequest, reply: Reply) -> dict[str, Any]:
        """The non-streaming answer."""
        raise NotImplementedError

    def bind(self, req: TurnRequest, session: Session) -> None:
        """Complete the request with what the session holds (a previous response's history); WireError if it
        cannot be. Most protocols carry their whole history in each request and need nothing here."""

    def stream_head(self, req: TurnRequest, state: StreamState) -> list[bytes]:
        """Events sent when the stream opens, before the reply exists."""
        raise NotImplementedError

    def stream_ping(self) -> bytes:
        """A keep-alive the client's parser skips."""
        raise NotImplementedError

    def stream_parts(self, req: TurnRequest, parts: list[ReplyPart], state: StreamState) -> list[bytes]:
        """Events of reply parts as they are parsed (after `stream_head`)."""
        raise NotImplementedError

    def stream_end(self, req: TurnRequest, reply: Reply, state: StreamState) -> list[bytes]:
        """The events that close a stream, with the finish reason and usage of the whole reply."""
        raise NotImplementedError

    def error_body(self, err: WireError) -> dict[str, Any]:
        """The protocol's error object."""
        raise NotImplementedError

    def stream_error(self, req: TurnRequest, err: WireError, state: StreamState) -> bytes:
        """An error inside an open stream."""
        raise NotImplementedError

    def models(self, name: str) -> dict[str, Any]:
        """`GET /models` in this protocol's shape: the one model a session serves."""
        raise NotImplementedError

    # ---- shared helpers ------------------------------------------------------------------------------
    @staticmethod
    def sse(data: Any, event: str | None = None) -> bytes:
        """One server-sent event (`data` JSON-encoded unless already bytes)."""
        payload = data if isinstance(data, bytes) else orjson.dumps(data)
        head = b"event: " + event.encode() + b"\n" if event else b""
        return head + b"data: " + payload + b"\n\n"

    @staticmethod
    def validated(model: type[_M], body: Any) -> _M:
        """`body` validated as `model`; WireError naming the first bad field."""
        if not isinstance(body, dict):
            raise WireError("invalid_request", "the body must be a JSON object")
        try:
            return model.model_validate(body)
        except ValidationError as e:
            err = e.errors()[0]
            where = ".".join(str(x) for x in err.get("loc", ())) or "body"
            raise WireError("invalid_request", f"{where}: {err.get('msg', 'invalid')}", where) from None


def ensure_user_turn_last(messages: list[dict[str, Any]]) -> None:
    """A request asks for the next assistant turn: its last message cannot be one (no prefill)."""
    if messages[-1]["role"] == "assistant":
        where = f"messages[{len(messages) - 1}]"
        raise WireError("invalid_request", f"{where}: the last message is the assistant's; continuing a partial "
                        "assistant message is not supported", where)
