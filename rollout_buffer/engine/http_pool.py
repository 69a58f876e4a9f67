"""Keep-alive HTTP/1.1 POSTs to engines: the one request every turn of every trajectory makes.

Not httpx's: httpcore's pool scans every connection for every request, several milliseconds of CPU per request at
a thousand in flight. Not aiohttp's: its client cost ~58 µs of CPU per request against this one's ~15 µs in a
loopback microbenchmark (request
and response objects, header multidicts, a writer task and a timer per request): a tenth of the buffer's CPU per
proxied turn (README, Performance). What this client does, and only that: POST a JSON body to an origin, read the
answer whole or as it streams, over pooled keep-alive connections (most recently used first, at most
`max_connections` in use at once), with one deadline per request (the whole exchange, streamed body included),
over `https` too. Responses are parsed by httptools (uvicorn's parser) and framed by Content-Length, chunked
encoding or the connection's end.

Errors: `TimeoutError` past the deadline; `TransportError` (an `OSError`) when the connection cannot be made,
breaks, or the answer is not HTTP. Pooled connections the server closed while idle are left out.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import ssl
from collections.abc import AsyncIterator
from typing import cast
from urllib.parse import urlsplit

import httptools

_HEAD = b"POST %s%s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n"
# A request body: its bytes, or pieces of it written one after the other (a long prompt's ids are not copied
# into one buffer: `sglang_wire.request_body`).
Body = bytes | list[bytes]
# Bytes a streamed answer holds before the connection stops reading (its consumer is behind).
_STREAM_PAUSE_BYTES = 1 << 20


class TransportError(OSError):
    """The connection could not be made, broke, or did not answer HTTP."""


class Response:
    """One exchange on a connection: the status once the headers are in, then the body."""

    def __init__(self, conn: _Connection):
        self.status = 0
        self._conn = conn
        self._chunks: collections.deque[bytes] = collections.deque()
        self._held = 0
        self._pause_at = float("inf")  # read whole: nothing holds reading back
        self._complete = False
        self._error: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self.deadline: asyncio.TimerHandle | None = None

    # ---- fed by the connection -------------------------------------------------------------------
    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def _headers(self, status: int) -> None:
        self.status = status
        self._wake()

    def _body(self, data: bytes) -> None:
        self._chunks.append(data)
        self._held += len(data)
        if self._held > self._pause_at:
            self._conn.pause()
        self._wake()

    def _end(self, error: BaseException | None = None) -> None:
        if self._complete or self._error is not None:
            return
        if error is None:
            self._complete = True
        else:
            self._error = error
        if self.deadline is not None:
            self.deadline.cancel()
        self._wake()

    @property
    def done(self) -> bool:
        """The whole answer arrived (or the exchange failed)."""
        return self._complete or self._error is not None

    # ---- read by the caller ----------------------------------------------------------------------
    async def _wait(self) -> None:
        if self._error is not None:
            raise self._error
        self._waiter = self._conn.loop.create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None
        if self._error is not None:
            raise self._error

    async def _head(self) -> None:
        while not self.status:
            await self._wait()

    async def read(self) -> bytes:
        """The rest of the body."""
        self._pause_at = float("inf")
        self._conn.resume()
        while not self._complete:
            await self._wait()
        data = b"".join(self._chunks)
        self._chunks.clear()
        return data

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[bytes]:
        self._pause_at = _STREAM_PAUSE_BYTES
        while True:
            if self._chunks:
                data = b"".join(self._chunks)
                self._chunks.clear()
                self._held = 0
                self._conn.resume()
                yield data
            elif self._complete:
                return
            else:
                await self._wait()


class _Connection(asyncio.Protocol):
    """One keep-alive connection; `response` is the exchange it is serving."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: Response | None = None
        self.closed = False
        self._framed = False  # Content-Length or chunked: the answer does not end with the connection
        self._paused = False

    # ---- asyncio.Protocol ------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        response = self.response
        if response is None:  # nothing asked: a server talking out of turn is not reused
            self.close()
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            response._end(TransportError(f"the engine's answer is not HTTP: {e}"))
            self.close()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        response, self.response = self.response, None
        if response is None:
            return
        if response.status and not self._framed and exc is None:
            response._end()  # an answer delimited by the end of the connection
        else:
            response._end(TransportError(f"the engine closed the connection{f': {exc}' if exc else ''}"))

    # ---- httptools callbacks ---------------------------------------------------------------------
    def on_header(self, name: bytes, _value: bytes) -> None:
        if name.lower() in (b"content-length", b"transfer-encoding"):
            self._framed = True

    def on_headers_complete(self) -> None:
        if self.response is not None:
            self.response._headers(self.parser.get_status_code())

    def on_body(self, body: bytes) -> None:
        if self.response is not None:
            self.response._body(body)

    def on_message_complete(self) -> None:
        response = self.response
        if response is not None:
            response._end()
        if not self.parser.should_keep_alive():
            self.close()

    # ---- used by the pool ------------------------------------------------------------------------
    def send(self, request: list[bytes], response: Response) -> None:
        self.response = response
        self._framed = False
        assert self.transport is not None
        self.transport.writelines(request)  # uvloop writes the pieces with one system call, without joining them

    def finish(self) -> bool:
        """The exchange is over: True when the connection can serve another one."""
        response, self.response = self.response, None
        if self.closed or response is None or not response.done or response._error is not None:
            self.close()
            return False
        self.resume()
        return True

    def expire(self) -> None:
        """The deadline passed: fail the exchange and drop the connection."""
        if self.response is not None:
            self.response._end(TimeoutError("no complete answer before the deadline"))
        self.close()

    def pause(self) -> None:
        if not self._paused and self.transport is not None and not self.closed:
            self._paused = True
            self.transport.pause_reading()

    def resume(self) -> None:
        if self._paused and self.transport is not None and not self.closed:
            self._paused = False
            self.transport.resume_reading()

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()
        self.closed = True


class _Origin:
    """Where requests go: host, port, TLS, and the idle connections to it."""

    def __init__(self, url: str):
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"engine URL must be http(s)://host[:port]: {url!r}")
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.base_path = parts.path.rstrip("/")
        self.host_header = parts.netloc.rpartition("@")[2].encode("idna")
        self.idle: list[_Connection] = []


class HttpPool:
    """Pooled keep-alive connections to any number of origins (`scheme://host:port[/prefix]`)."""

    def __init__(self, max_connections: int = 4096, timeout_s: float = 600.0, headers: dict[str, str] | None = None):
        self.loop = asyncio.get_running_loop()  # connections belong to the loop they were made on
        self.timeout_s = timeout_s
        # Sent with every request (a session worker's secret).
        self._headers = b"".join(f"{k}: {v}\r\n".encode("latin-1") for k, v in (headers or {}).items())
        self._slots = asyncio.Semaphore(max_connections)
        self._origins: dict[str, _Origin] = {}
        self.closed = False

    def _origin(self, url: str) -> _Origin:
        origin = self._origins.get(url)
        if origin is None:
            origin = self._origins[url] = _Origin(url)
        return origin

    async def _connect(self, origin: _Origin) -> _Connection:
        loop = self.loop
        try:
            async with asyncio.timeout(self.timeout_s):
                _, conn = await loop.create_connection(lambda: _Connection(loop), origin.host, origin.port,
                                                       ssl=origin.ssl)
        except TimeoutError:
            raise
        except OSError as e:
            raise TransportError(f"cannot connect to {origin.host}:{origin.port}: {e}") from None
        return conn

    async def _start(self, url: str, path: str, body: Body) -> tuple[_Connection, Response, _Origin]:
        """Send the request (on an idle connection when there is one) and wait for the answer's headers."""
        if self.closed:
            raise TransportError("the engine client is closed")
        origin = self._origin(url)
        pieces = [body] if isinstance(body, bytes) else body
        head = _HEAD % (origin.base_path.encode(), path.encode(), origin.host_header, sum(map(len, pieces)),
                        self._headers)
        request = [head, *pieces]
        conn = None
        while origin.idle and conn is None:
            conn = origin.idle.pop()
            if conn.closed:  # the server closed it while it was idle
                conn = None
        if conn is None:
            conn = await self._connect(origin)
        response = Response(conn)
        response.deadline = self.loop.call_later(self.timeout_s, conn.expire)
        conn.send(request, response)
        try:
            await response._head()
        except BaseException:
            response.deadline.cancel()
            conn.finish()
            raise
        return conn, response, origin

    def _release(self, conn: _Connection, origin: _Origin) -> None:
        if conn.finish() and not self.closed:
            origin.idle.append(conn)

    async def post(self, url: str, path: str, body: Body) -> tuple[int, bytes]:
        """POST `body` (JSON, whole or in pieces) to `url + path`: the status and the whole answer."""
        async with self._slots:
            conn, response, origin = await self._start(url, path, body)
            try:
                data = await response.read()
            finally:
                self._release(conn, origin)
            return response.status, data

    @contextlib.asynccontextmanager
    async def stream(self, url: str, path: str, body: Body) -> AsyncIterator[Response]:
        """POST `body` to `url + path`; the answer as it arrives (`status`, then `async for` its bytes, or
        `read()`). Leaving before its end closes the connection, which tells the server to stop."""
        async with self._slots:
            conn, response, origin = await self._start(url, path, body)
            try:
                yield response
            finally:
                self._release(conn, origin)

    async def aclose(self) -> None:
        """Close every idle connection; requests still running end with their connections."""
        self.closed = True
        for origin in self._origins.values():
            for conn in origin.idle:
                conn.close()
            origin.idle.clear()
