"""The wire-format contract: one small base, a few hooks per protocol.

A protocol adapter turns a parsed JSON body into a `TurnRequest` (`parse`), a served turn into its
protocol's response (`response`) or server-sent events (`stream_head` before the reply is ready,
`stream_ping` while waiting, `stream_events` with the reply), and a `WireError` into its protocol's error
object (`error_body`, `stream_error`). Everything else (sessions, routing in the tree, generation) is the
same for every protocol and lives in `session`.

Streams are sent once the turn is generated (the engine call is not streamed: it is retried and resumed as a
whole), so a stream carries the reply in one delta per part; clients see the same events as from the vendors'
APIs, with keep-alives while the turn is generated.
"""

from __future__ import annotations

from typing import Any, ClassVar, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from rollout_buffer.proxy.messages import WireError
from rollout_buffer.proxy.replies import Reply
from rollout_buffer.proxy.session import TurnRequest

_M = TypeVar("_M", bound=BaseModel)


class WireAdapter:
    """Base of the protocol adapters; subclasses fill the hooks below."""

    protocol: ClassVar[str] = ""

    def parse(self, body: Any) -> TurnRequest:
        """The request, translated; WireError naming the bad field."""
        raise NotImplementedError

    def response(self, req: TurnRequest, reply: Reply) -> dict[str, Any]:
        """The non-streaming answer."""
        raise NotImplementedError

    def stream_head(self, req: TurnRequest) -> list[bytes]:
        """Events sent when the stream opens, before the reply exists."""
        raise NotImplementedError

    def stream_ping(self) -> bytes:
        """A keep-alive the client's parser skips."""
        raise NotImplementedError

    def stream_events(self, req: TurnRequest, reply: Reply, head_sent: bool) -> list[bytes]:
        """The reply as events (after `stream_head`, which is included when `head_sent` is False)."""
        raise NotImplementedError

    def error_body(self, err: WireError) -> dict[str, Any]:
        """The protocol's error object."""
        raise NotImplementedError

    def stream_error(self, err: WireError) -> bytes:
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
