"""The HTTP protocol the buffer and its session workers serve with: uvicorn's httptools protocol, each response
written to the socket in one piece, its `Date` header renewed by the requests.

uvicorn writes a response's head when the app sends `http.response.start` and its body when it sends the body:
two writes, each a system call and, on loopback, the receiver's TCP work done in the sender's time, and two
segments the client wakes up for. `OneWritePerTick` holds what is written during one pass of the event loop and
hands it to the socket at the end of that pass, so a whole response costs one write. Nothing waits longer than
the pass it was written in; a stream's chunks go out as they are sent.

uvicorn renews the `Date` header of every response from its main loop, once a second; `shortcuts.quiet_server`'s
loop does not tick (an idle server wakes for nothing), so the first request of each second renews it here
(`DateHeader`).

This module is the only one that names uvicorn's protocol class; it wraps the transport uvicorn is given
(`asyncio.Protocol.connection_made`) and renews the server's default headers (`ServerState.default_headers`, as
uvicorn's `Server.on_tick` builds them) before uvicorn's `on_headers_complete` reads them.
`tests/test_http_protocol.py` fails if a response stops going out in one write; `tests/test_quiet_server.py` if
its `Date` header stops being current.
"""

from __future__ import annotations

import asyncio
import time
from email.utils import formatdate
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol


class OneWritePerTick:
    """An `asyncio.Transport` whose writes during one pass of the event loop reach the socket as one write."""

    __slots__ = ("_loop", "_pending", "_transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Hold `data` until the end of this pass of the event loop."""
        if not self._pending:
            self._loop.call_soon(self.flush)
        self._pending.append(bytes(data) if not isinstance(data, bytes) else data)

    def writelines(self, lines: Any) -> None:
        """Hold each of `lines` (see `write`)."""
        for data in lines:
            self.write(data)

    def flush(self) -> None:
        """Hand what is held to the socket."""
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        """Close once what is held is written (as `Transport.close` does with its own buffer)."""
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        """Close at once; what is held is dropped."""
        self._pending.clear()
        self._transport.abort()

    def write_eof(self) -> None:
        self.flush()
        self._transport.write_eof()

    def get_write_buffer_size(self) -> int:
        return self._transport.get_write_buffer_size() + sum(len(d) for d in self._pending)

    # What uvicorn calls on every request, named here instead of through `__getattr__`.
    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def pause_reading(self) -> None:
        self._transport.pause_reading()

    def resume_reading(self) -> None:
        self._transport.resume_reading()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._transport.get_extra_info(name, default)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


class DateHeader:
    """The `Date` header of the process's responses, formatted once a second."""

    def __init__(self) -> None:
        self._second = -1
        self.header = (b"date", b"")

    def current(self) -> tuple[bytes, bytes]:
        """The header for this second (the same object all through it)."""
        second = int(time.time())
        if second != self._second:
            self._second, self.header = second, (b"date", formatdate(second, usegmt=True).encode())
        return self.header


DATE = DateHeader()


class OneWriteHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol on a `OneWritePerTick` transport, renewing the `Date` header itself
    (`uvicorn.Config(http=...)`)."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(OneWritePerTick(transport, self.loop))  # type: ignore[arg-type]

    def on_headers_complete(self) -> None:
        """uvicorn's, once the server's default headers hold this second's date."""
        if self.config.date_header:
            date = DATE.current()
            headers = self.server_state.default_headers
            if not headers or headers[0] is not date:
                self.server_state.default_headers = [date, *self.config.encoded_headers]
        super().on_headers_complete()
