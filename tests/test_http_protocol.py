"""The buffer's HTTP protocol (`shortcuts.http_protocol`): a whole response leaves in one write to the socket, and
what HTTP needs still holds — keep-alive, streams chunk by chunk, `Connection: close` after the complete answer.

Served by the installed uvicorn in a thread, driven over a raw socket: if uvicorn changes how it hands a response
to its transport, the count of writes fails here.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from rollout_buffer.shortcuts.http_protocol import OneWriteHttpProtocol

WRITES: list[bytes] = []  # what the server wrote to its sockets, one item per write


class _Counting:
    """The socket's transport, as uvicorn's protocol would get it, counting the writes that reach it."""

    def __init__(self, transport: asyncio.Transport):
        self._transport = transport

    def write(self, data: bytes) -> None:
        WRITES.append(bytes(data))
        self._transport.write(data)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class CountingProtocol(OneWriteHttpProtocol):
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_Counting(transport))  # type: ignore[arg-type]


async def answer(request: Request) -> Response:
    body = await request.json()
    return JSONResponse({"success": True, "echo": body})


async def stream(request: Request) -> Response:
    async def chunks() -> Any:
        for part in (b"one\n", b"two\n", b"three\n"):
            yield part
            await asyncio.sleep(0.05)

    return StreamingResponse(chunks(), media_type="text/plain")


@contextlib.contextmanager
def served() -> Iterator[int]:
    app = Starlette(routes=[Route("/answer", answer, methods=["POST"]), Route("/stream", stream)])
    listener = socket.create_server(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, http=CountingProtocol,
                                           timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [listener]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield listener.getsockname()[1]
    finally:
        server.should_exit = True
        thread.join(10)


def _read_response(conn: socket.socket, buffered: bytearray) -> bytes:
    """One response with a Content-Length (what `answer` sends), from `buffered` and the socket."""
    while b"\r\n\r\n" not in buffered:
        buffered += conn.recv(65536)
    head, _, rest = bytes(buffered).partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(rest) < length:
        rest += conn.recv(65536)
    buffered[:] = rest[length:]
    return head + b"\r\n\r\n" + rest[:length]


def _post(body: bytes, close: bool = False) -> bytes:
    return (b"POST /answer HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%s\r\n%s"
            % (len(body), b"connection: close\r\n" if close else b"", body))


def test_each_response_is_one_write_and_keep_alive_holds() -> None:
    with served() as port, socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        buffered = bytearray()
        answers = []
        for i in range(3):  # one connection, three requests in turn
            WRITES.clear()
            conn.sendall(_post(b'{"i": %d}' % i))
            answers.append(_read_response(conn, buffered))
            assert len(WRITES) == 1, f"request {i}: the response took {len(WRITES)} writes"
            assert WRITES[0] == answers[-1]  # head and body, together
        assert [a.split(b"\r\n", 1)[0] for a in answers] == [b"HTTP/1.1 200 OK"] * 3
        assert answers[2].endswith(b'{"success":true,"echo":{"i":2}}')


def test_connection_close_answers_in_full_then_closes() -> None:
    with served() as port, socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        WRITES.clear()
        conn.sendall(_post(b'{"last": true}', close=True))
        received = b""
        while chunk := conn.recv(65536):  # until the server closes
            received += chunk
        assert received.startswith(b"HTTP/1.1 200 OK") and received.endswith(b'{"success":true,"echo":{"last":true}}')
        assert len(WRITES) == 1


def test_a_stream_goes_out_chunk_by_chunk() -> None:
    with served() as port, socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        WRITES.clear()
        conn.sendall(b"GET /stream HTTP/1.1\r\nhost: test\r\n\r\n")
        received = b""
        while not received.endswith(b"0\r\n\r\n"):
            received += conn.recv(65536)
        assert b"transfer-encoding: chunked" in received
        assert received.split(b"\r\n\r\n", 1)[1] == b"4\r\none\n\r\n4\r\ntwo\n\r\n6\r\nthree\n\r\n0\r\n\r\n"
        # The head leaves with the first chunk; each later chunk and the end, sent after a wait, is its own write.
        assert len(WRITES) == 4
        assert WRITES[0].endswith(b"\r\n\r\n4\r\none\n\r\n") and WRITES[1:] == [b"4\r\ntwo\n\r\n", b"6\r\nthree\n\r\n",
                                                                         b"0\r\n\r\n"]
