"""The uvicorn server the buffer and its session workers run (`serve`): uvicorn's own, without its housekeeping
tick.

uvicorn's `Server.main_loop` wakes ten times a second to check for an exit and, every tenth time, to renew the
`Date` header. On a small VM each wake-up of an otherwise idle event loop costs a system call, a timer, a context
switch and cold caches: most of an idle server's CPU, and at a moderate load a wake-up the requests do not share
(docs/benchmarks). `QuietServer` wakes only when asked to stop (a signal, or `should_exit` set from any thread);
the `Date` header is renewed by the first request of each second instead (`http_protocol.OneWriteHttpProtocol`,
which `serve` runs it with). uvicorn's other housekeeping (`limit_max_requests`, `callback_notify`) is not used
here.

This module is the only one that relies on `uvicorn.Server`'s `main_loop`, `on_tick` and `should_exit`;
`tests/test_quiet_server.py` fails if uvicorn changes them. With the shortcuts switched off (`switch`), `serve`
runs uvicorn's own server and protocol (`SignalledServer`).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

from rollout_buffer.shortcuts import switch
from rollout_buffer.shortcuts.http_protocol import OneWriteHttpProtocol


class QuietServer(uvicorn.Server):
    """`uvicorn.Server` whose main loop sleeps until it is asked to stop; `on_stop` runs on its loop when it is."""

    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None
    _exit = False
    on_stop: Callable[[], None] | None = None

    @property
    def should_exit(self) -> bool:
        """uvicorn's stop flag; setting it (uvicorn's signal handler, or another thread) wakes the main loop."""
        return self._exit

    @should_exit.setter
    def should_exit(self, value: bool) -> None:
        stopping = value and not self._exit
        self._exit = value
        if value and self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._wake.set)
                if stopping and self.on_stop is not None:
                    self._loop.call_soon_threadsafe(self.on_stop)

    async def main_loop(self) -> None:
        """uvicorn's main loop without its tick: `on_tick` once (the first default headers, an exit check), then
        asleep until `should_exit`."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        if await self.on_tick(0):
            return
        while not self.should_exit:
            await self._wake.wait()
            self._wake.clear()


# After a stop signal, how long requests still being answered get before their connections are closed (open
# long-polls answer at once: `on_stop`); then the app's shutdown stops its runs, which resume at the next start.
SHUTDOWN_GRACE_S = 5


def serve(app: Any, listeners: list[socket.socket], log_level: str, on_stop: Callable[[], None] | None = None
          ) -> None:
    """Serve `app` on `listeners` until a stop signal: the buffer's and its session workers' server (uvicorn's
    logging left to the process, no access log, idle connections kept 75 s, each response in one write).
    `on_stop` runs on the server's loop as the signal arrives; requests still open `SHUTDOWN_GRACE_S` later are
    cut off."""
    one_write = switch.enabled("http_protocol")
    config = uvicorn.Config(app, log_level=log_level, access_log=False, timeout_keep_alive=75, log_config=None,
                            http=OneWriteHttpProtocol if one_write else "httptools",
                            timeout_graceful_shutdown=SHUTDOWN_GRACE_S)
    # QuietServer does not tick: the Date header is renewed by OneWriteHttpProtocol, so it needs it.
    quiet = one_write and switch.enabled("quiet_server")
    server = QuietServer(config) if quiet else SignalledServer(config)
    server.on_stop = on_stop
    server.run(sockets=listeners)


class SignalledServer(uvicorn.Server):
    """uvicorn's own server (shortcuts off): its ticking main loop and protocol; `on_stop` runs on its loop when a
    stop signal arrives (uvicorn's signal handler, `handle_exit`)."""

    on_stop: Callable[[], None] | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's start-up, noting the loop `on_stop` will run on."""
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: Any) -> None:
        """uvicorn's signal handler, then `on_stop` (once) on the server's loop."""
        stopping = not self.should_exit
        super().handle_exit(sig, frame)
        if stopping and self.on_stop is not None and self._loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self.on_stop)
