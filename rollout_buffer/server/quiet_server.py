"""The uvicorn server the buffer and its session workers run (`serve`): uvicorn's own, its housekeeping once a
second.

uvicorn's `Server.main_loop` wakes ten times a second to check for an exit and, every tenth time, to renew the
`Date` header. Each wake-up of an otherwise idle event loop costs a system call, a timer and a context switch:
on a small VM that is most of an idle server's CPU, and at a moderate load it is a wake-up the requests do not
share (docs/benchmarks). `QuietServer` does the same housekeeping once a second (the `Date` header is renewed as
often as before) and wakes at once when a signal asks it to stop.

This module is the only one that relies on `uvicorn.Server`'s `main_loop`, `on_tick` and `handle_exit`;
`tests/test_quiet_server.py` fails if uvicorn changes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
from types import FrameType
from typing import Any

import uvicorn

from rollout_buffer.server.http_protocol import OneWriteHttpProtocol

TICK_S = 1.0
_TICKS_PER_S = 10  # uvicorn's `on_tick` renews the Date header when its counter is a multiple of this


class QuietServer(uvicorn.Server):
    """`uvicorn.Server` whose main loop ticks once a second, and at once on an exit signal."""

    _wake: asyncio.Event | None = None
    _loop: asyncio.AbstractEventLoop | None = None

    async def main_loop(self) -> None:
        """uvicorn's main loop at one tick a second: the same `on_tick`, the same exit checks."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        counter = 0
        should_exit = await self.on_tick(counter)
        while not should_exit:
            counter = (counter + _TICKS_PER_S) % 864000
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), TICK_S)
            should_exit = await self.on_tick(counter)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        """uvicorn's, then the main loop woken so that shutting down starts now, not at the next tick."""
        super().handle_exit(sig, frame)
        if self._loop is not None and self._wake is not None:
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
                self._loop.call_soon_threadsafe(self._wake.set)


def serve(app: Any, listeners: list[socket.socket], log_level: str) -> None:
    """Serve `app` on `listeners` until a stop signal: the buffer's and its session workers' server (uvicorn's
    logging left to the process, no access log, idle connections kept 75 s, each response in one write)."""
    QuietServer(uvicorn.Config(app, log_level=log_level, access_log=False, timeout_keep_alive=75, log_config=None,
                               http=OneWriteHttpProtocol)).run(sockets=listeners)
