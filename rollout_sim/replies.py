"""The simulated engine's HTTP answers in SGLang's shapes: JSON bodies, native and OpenAI errors, a reset
connection, a truncated body, and the deterministic log-probs and weight-version spans answers carry."""

from __future__ import annotations

import socket
import struct
import zlib
from typing import Any

import orjson
from starlette.responses import PlainTextResponse, Response
from starlette.types import Receive, Scope, Send


def token_logprob(token_id: int, position: int, weights: str = "") -> float:
    """A deterministic negative log-prob for `token_id` at `position`, under the checkpoint `weights` loaded last
    ("" for the one the engine started with)."""
    h = zlib.crc32(f"{weights}{position}:{token_id}".encode())
    return -(0.01 + (h % 4000) / 1000.0)


def logprob_rows(tokenizer: Any, ids: list[int], first: int, weights: str, with_text: bool) -> list[list[Any]]:
    """SGLang's `[logprob, id, text]` rows for `ids` from position `first` on (text only `with_text`)."""
    return [[token_logprob(t, first + i, weights), t, tokenizer.decode([t]) if with_text else None]
            for i, t in enumerate(ids)]


def input_logprob_rows(tokenizer: Any, ids: list[int], start: int, weights: str, with_text: bool
                       ) -> list[list[Any]]:
    """`input_token_logprobs`: the rows of the prompt's tokens from `start` on (-1: none), the first one's log-prob
    None whatever `start` is, as SGLang has it."""
    if not 0 <= start < len(ids):
        return []
    rows = logprob_rows(tokenizer, ids[start:], start, weights, with_text)
    rows[0][0] = None
    return rows


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def error_response(status: int, message: str) -> Response:
    """SGLang's native error body (`http_server._create_error_response`): `{"error": {"message"}}`."""
    return json_response({"error": {"message": message}}, status)


def openai_error(status: int, message: str, err_type: str) -> Response:
    """SGLang's `ErrorResponse` (OpenAI routes, HTTPException and request validation errors)."""
    return json_response({"object": "error", "message": message, "type": err_type, "param": None,
                          "code": status}, status)


def internal_server_error() -> Response:
    """What Starlette answers for an exception SGLang's handler does not catch."""
    return PlainTextResponse("Internal Server Error", status_code=500)


def weight_version_spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict[str, Any]]:
    """0.5.23's `compute_weight_version_spans` + the visible spans of `add_weight_versions_to_meta_info`."""
    spans: list[list[Any]] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1][2]:
            continue
        if spans and version == spans[-1][0]:
            spans[-1][2] = end
            continue
        spans.append([version, spans[-1][2] if spans else 0, end])
    return [{"version": v, "start": s, "end": min(e, n)} for v, s, e in spans if s < n or s == 0]



class ResetConnection(Response):
    """Closes the client's TCP connection with RST instead of answering (uvicorn's transport)."""

    def __init__(self) -> None:
        super().__init__(status_code=500)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = getattr(getattr(receive, "__self__", None), "transport", None)
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                # Linger 0 turns close() into a reset, as a crashed engine would look to the client.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        # Completes the ASGI cycle; the bytes go nowhere once the transport is aborted.
        await super().__call__(scope, receive, send)



def finish_response(payload: dict[str, Any], fault: str | None) -> Response:
    """A whole JSON answer, cut in half when the request's fault is `truncated_json`."""
    data = orjson.dumps(payload)
    if fault == "truncated_json":
        return Response(data[: len(data) // 2], media_type="application/json")
    return Response(data, media_type="application/json")
