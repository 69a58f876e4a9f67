"""What moving a turn's bytes costs a process that does nothing else: the part of a long session's turn that no
proxy between a resending agent and SGLang's `/generate` can avoid.

An agent resends its whole history each turn, and SGLang's `/generate` takes every id of the prompt each turn: a
proxy receives the one body and sends the other, however little it does with them. This is such a proxy with
nothing else in it: an asyncio server on uvloop (httptools, as the buffer serves) that reads a request's body,
POSTs `x-forward-bytes` bytes to a sink in another process with the buffer's own engine client (`HttpPool`: pooled
keep-alive connections, a body in pieces written without joining them), waits for its short answer and answers
shortly. `bench.proxy --long-session` sends it each turn's exact body, with the size
of that turn's ids as JSON, and reads its CPU beside the buffer's.

    python -m bench.bytes_floor --port 9000 --sink http://127.0.0.1:9001   # the proxy
    python -m bench.bytes_floor --port 9001                                # the sink
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import cast

import httptools
import uvloop

from bench.harness import REPO, Service, free_port
from rollout_buffer.engine.http_pool import HttpPool

_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 11\r\n\r\n{\"ok\":true}"
# What the proxy sends the sink, in pieces of this size (the ids' JSON is the buffer's already, in pieces too).
_PIECE = b"1" * (1 << 16)


def _pieces(size: int) -> list[bytes]:
    whole, rest = divmod(size, len(_PIECE))
    return [_PIECE] * whole + ([_PIECE[:rest]] if rest else [])


class _Server(asyncio.Protocol):
    """One connection: each request's body read whole, then (with a sink) forwarded, then answered."""

    def __init__(self, engine: HttpPool | None, sink_url: str | None):
        self.engine, self.sink_url = engine, sink_url
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.forward = 0
        self.body: list[bytes] = []
        self.received = b""
        self.forwarding: asyncio.Task[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports do not subclass asyncio's

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.forward = 0
        self.body = []

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-forward-bytes":
            self.forward = int(value)

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.received = b"".join(self.body)  # the body assembled, as any server hands it on
        if self.engine is None or not self.forward:
            self._answer()
            return
        self.forwarding = asyncio.get_running_loop().create_task(self._forwarded(self.forward))  # held till done

    async def _forwarded(self, size: int) -> None:
        assert self.engine is not None and self.sink_url is not None
        await self.engine.post(self.sink_url, "/generate", _pieces(size))
        self._answer()

    def _answer(self) -> None:
        assert self.transport is not None
        self.transport.write(_OK)


async def _serve(port: int, sink_url: str | None) -> None:
    engine = HttpPool() if sink_url else None
    server = await asyncio.get_running_loop().create_server(lambda: _Server(engine, sink_url), "127.0.0.1", port)
    async with server:
        await server.serve_forever()


@contextlib.contextmanager
def bytes_floor(workdir: Path) -> Iterator[Service]:
    """This proxy and its sink as subprocesses on free ports; the proxy's service is yielded."""
    sink_port, port = free_port(), free_port()
    sink = Service("bench.bytes_floor", ["--port", str(sink_port)], sink_port, "/healthz",
                   workdir / f"bytes-sink-{sink_port}.log", REPO)
    proxy = Service("bench.bytes_floor", ["--port", str(port), "--sink", sink.url], port, "/healthz",
                    workdir / f"bytes-floor-{port}.log", REPO)
    with sink, proxy:
        yield proxy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--sink", default=None, help="the sink's URL (without it, this is the sink)")
    args = parser.parse_args()
    uvloop.run(_serve(args.port, args.sink))


if __name__ == "__main__":
    main()
