"""The engine client's HTTP/1.1 pool against real sockets on loopback: keep-alive reuse, the three ways an answer
is framed, streaming as bytes arrive, early exits, deadlines, broken and refused connections, the pool's cap.

The servers here are scripted asyncio servers so each test controls exactly what goes over the wire; the engine
client's behaviour against a real SGLang-like server (retries, streams, aborts) is in test_engine.py and
test_proxy_streaming.py.
"""

from __future__ import annotations

import asyncio
import shutil
import socket
import ssl
import subprocess
from collections.abc import Awaitable, Callable
from pathlib import Path

import orjson
import pytest

from rollout_buffer.engine.http_pool import HttpPool, TransportError

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


class Scripted:
    """A loopback server running `handler` per connection; counts connections and requests."""

    def __init__(self, handler: Handler, tls: ssl.SSLContext | None = None):
        self.handler = handler
        self.tls = tls
        self.connections = 0
        self.open = 0
        self.most_open = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.url = ""

    async def __aenter__(self) -> Scripted:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            self.connections += 1
            self.open += 1
            self.most_open = max(self.most_open, self.open)
            try:
                await self.handler(reader, writer)
            except (ConnectionError, asyncio.IncompleteReadError):
                pass
            finally:
                self.open -= 1
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=self.tls)
        scheme = "https" if self.tls else "http"
        self.url = f"{scheme}://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()

    async def request(self, reader: asyncio.StreamReader) -> bytes:
        """Read one request (head and Content-Length body); b"" when the client closed the connection."""
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))
        body = await reader.readexactly(length)
        self.requests.append(head + body)
        return body


def answer(body: bytes, status: int = 200, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 %d X\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n%s" % (
        status, len(body), extra, body)


def run(coro: Awaitable[None]) -> None:
    asyncio.run(asyncio.wait_for(coro, 30))


def test_sequential_requests_share_one_keep_alive_connection_and_are_well_formed() -> None:
    async def main() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                body = await server.request(reader)
                writer.write(answer(b'{"echo": ' + body + b"}"))

        async with Scripted(echo) as server:
            pool = HttpPool(timeout_s=10)
            for i in range(5):
                assert await pool.post(server.url, "/generate", b'{"i": %d}' % i) == (200, b'{"echo": {"i": %d}}' % i)
            # A body in pieces (a long prompt's ids, not copied into one buffer) arrives whole, its length counted.
            pieces = [b'{"input_ids":[', b",".join(b"%d" % i for i in range(300_000)), b'],"x":1}']
            status, echoed = await pool.post(server.url, "/generate", pieces)
            assert status == 200 and orjson.loads(echoed)["echo"] == {"input_ids": list(range(300_000)), "x": 1}
            await pool.aclose()
        assert server.connections == 1
        head = server.requests[0].split(b"\r\n\r\n")[0].split(b"\r\n")
        assert head[0] == b"POST /generate HTTP/1.1"
        assert f"Host: {server.url.removeprefix('http://')}".encode() in head
        assert b"Content-Type: application/json" in head

    run(main())


def test_answers_framed_by_length_chunks_or_the_connection_end_are_read_whole() -> None:
    async def main() -> None:
        async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n6\r\n world\r\n0\r\n\r\n")
            await server.request(reader)  # kept alive: the second request comes on this connection
            writer.write(answer(b"again"))
            await reader.read()

        async with Scripted(chunked) as server:
            pool = HttpPool(timeout_s=10)
            assert await pool.post(server.url, "/x", b"{}") == (200, b"hello world")
            assert await pool.post(server.url, "/x", b"{}") == (200, b"again")
            await pool.aclose()
        assert server.connections == 1

        async def until_close(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(b"HTTP/1.1 503 Busy\r\nConnection: close\r\n\r\nno room")
            await writer.drain()

        async with Scripted(until_close) as server:
            pool = HttpPool(timeout_s=10)
            assert await pool.post(server.url, "/x", b"{}") == (503, b"no room")
            assert await pool.post(server.url, "/x", b"{}") == (503, b"no room")
        assert server.connections == 2  # "Connection: close" is honoured: no reuse

    run(main())


def test_a_stream_gives_bytes_as_they_arrive_and_leaving_early_closes_the_connection() -> None:
    async def main() -> None:
        gate = asyncio.Event()
        closed_by_client = asyncio.Event()

        async def events(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n7\r\ndata: 1\r\n")
            await gate.wait()  # the client must see the first event before the second exists
            writer.write(b"7\r\ndata: 2\r\n")
            if await reader.read() == b"":
                closed_by_client.set()

        async with Scripted(events) as server:
            pool = HttpPool(timeout_s=10)
            seen = []
            async with pool.stream(server.url, "/generate", b"{}") as response:
                assert response.status == 200
                async for data in response:
                    seen.append(data)
                    if len(seen) == 1:
                        gate.set()
                    else:
                        break
            assert seen == [b"data: 1", b"data: 2"]
            await asyncio.wait_for(closed_by_client.wait(), 5)
            assert not pool._origin(server.url).idle  # an unfinished answer's connection is not reused

    run(main())


def test_the_deadline_covers_the_whole_exchange() -> None:
    async def main() -> None:
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            await reader.read()

        async def stalls(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
            await reader.read()

        for handler in (silent, stalls):
            async with Scripted(handler) as server:
                pool = HttpPool(timeout_s=0.3)
                loop = asyncio.get_running_loop()
                start = loop.time()
                with pytest.raises(TimeoutError):
                    await pool.post(server.url, "/generate", b"{}")
                assert 0.25 <= loop.time() - start < 3
                assert not pool._origin(server.url).idle

    run(main())


def test_broken_refused_and_garbled_connections_are_transport_errors() -> None:
    async def main() -> None:
        async def hangs_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\ncut")
            await writer.drain()

        async def garbles(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(b"SMTP ready\r\n\r\n")
            await reader.read()

        for handler, message in ((hangs_up, "closed the connection"), (garbles, "not HTTP")):
            async with Scripted(handler) as server:
                pool = HttpPool(timeout_s=10)
                with pytest.raises(TransportError, match=message):
                    await pool.post(server.url, "/generate", b"{}")

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]  # nothing listens on it
        with pytest.raises(TransportError, match="cannot connect") as refused:
            await HttpPool(timeout_s=10).post(f"http://127.0.0.1:{port}", "/generate", b"{}")
        assert isinstance(refused.value, OSError)

    run(main())


def test_connections_the_server_closed_while_idle_are_replaced() -> None:
    async def main() -> None:
        async def one_per_connection(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await server.request(reader)
            writer.write(answer(b"ok"))
            await writer.drain()  # then closes without "Connection: close", like a keep-alive timeout

        async with Scripted(one_per_connection) as server:
            pool = HttpPool(timeout_s=10)
            for _ in range(3):
                assert await pool.post(server.url, "/generate", b"{}") == (200, b"ok")
                await asyncio.sleep(0.05)  # the close reaches the client while the connection is idle
        assert server.connections == 3

    run(main())


def test_the_pool_caps_connections_in_use_and_keeps_a_path_prefix() -> None:
    async def main() -> None:
        async def slow(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await server.request(reader)
                await asyncio.sleep(0.05)
                writer.write(answer(b"ok"))

        async with Scripted(slow) as server:
            pool = HttpPool(max_connections=2, timeout_s=10)
            answers = await asyncio.gather(*(pool.post(server.url + "/engine/", "/generate", b"{}")
                                             for _ in range(6)))
            await pool.aclose()
        assert answers == [(200, b"ok")] * 6
        assert server.most_open == 2 and server.connections == 2
        assert all(r.startswith(b"POST /engine/generate HTTP/1.1\r\n") for r in server.requests)

    run(main())


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl command to make a certificate")
def test_https_engines_are_reached_with_verified_certificates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
                   check=True, capture_output=True)
    server_tls = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_tls.load_cert_chain(cert, key)

    async def main() -> None:
        async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                writer.write(answer(await server.request(reader)))

        async with Scripted(echo, server_tls) as server:
            with pytest.raises(TransportError, match="CERTIFICATE_VERIFY_FAILED"):
                await HttpPool(timeout_s=10).post(server.url, "/generate", b"{}")  # not trusted yet
            monkeypatch.setenv("SSL_CERT_FILE", str(cert))
            pool = HttpPool(timeout_s=10)
            assert await pool.post(server.url, "/generate", b'{"a": 1}') == (200, b'{"a": 1}')
            assert await pool.post(server.url, "/generate", b'{"a": 2}') == (200, b'{"a": 2}')
            await pool.aclose()
        assert server.connections == 1  # both on one kept-alive connection (the refused handshake never got one)

    run(main())


def test_answers_larger_than_the_stream_buffer_arrive_whole_read_or_streamed() -> None:
    big = bytes(range(256)) * (3 * 4096)  # 3 MiB: past the bytes a stream holds before it stops reading

    async def main() -> None:
        async def large(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            while True:
                await server.request(reader)
                writer.write(answer(big))
                await writer.drain()

        async with Scripted(large) as server:
            pool = HttpPool(timeout_s=10)
            assert await pool.post(server.url, "/generate", b"{}") == (200, big)
            got = []
            async with pool.stream(server.url, "/generate", b"{}") as response:
                async for data in response:
                    got.append(data)
                    await asyncio.sleep(0.01)  # a slow consumer: the connection pauses and resumes
            assert b"".join(got) == big
            assert await pool.post(server.url, "/generate", b"{}") == (200, big)
            await pool.aclose()
        assert server.connections == 1

    run(main())
