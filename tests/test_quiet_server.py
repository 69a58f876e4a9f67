"""The server the buffer and its workers run (`server.quiet_server`): uvicorn's housekeeping once a second, the
`Date` header still current, and a stop asked for handled at once.

Served by the installed uvicorn in a thread: if uvicorn changes the methods `QuietServer` replaces, these fail.
"""

from __future__ import annotations

import email.utils
import inspect
import signal
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from servers import free_port
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from rollout_buffer.server import quiet_server
from rollout_buffer.server.quiet_server import QuietServer


class Counted(QuietServer):
    """A QuietServer counting its ticks."""

    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


def started(cls: type[QuietServer], port: int) -> tuple[QuietServer, threading.Thread]:
    """A `cls` serving a one-route app on `port`, in a thread, once it is up."""
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    srv = cls(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    for _ in range(200):  # bounded: up within 10 s
        if srv.started:
            break
        time.sleep(0.05)
    assert srv.started
    return srv, thread


@pytest.fixture()
def server() -> Iterator[tuple[Counted, str]]:
    port = free_port()
    srv, thread = started(Counted, port)
    assert isinstance(srv, Counted)
    yield srv, f"http://127.0.0.1:{port}"
    srv.should_exit = True
    thread.join(10)


def test_uvicorn_still_has_what_quiet_server_replaces() -> None:
    assert inspect.iscoroutinefunction(uvicorn.Server.main_loop)
    assert list(inspect.signature(uvicorn.Server.on_tick).parameters) == ["self", "counter"]
    # Called as uvicorn's signal handler is; sse-starlette (imported by mcp) wraps it as (*args, **kwargs).
    inspect.signature(uvicorn.Server.handle_exit).bind(object(), signal.SIGTERM, None)


def test_housekeeping_runs_once_a_second_and_the_date_header_stays_current(server: tuple[Counted, str]) -> None:
    srv, url = server
    ticks_before = srv.ticks
    time.sleep(2.5)
    assert 1 <= srv.ticks - ticks_before <= 4, "uvicorn's own loop ticks ten times a second"
    answer = httpx.get(url, timeout=10)
    assert answer.status_code == 200 and answer.text == "ok"
    date = email.utils.parsedate_to_datetime(answer.headers["date"]).timestamp()
    assert abs(date - time.time()) <= 2.5


def test_a_stop_signal_is_handled_at_once_not_at_the_next_tick(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(quiet_server, "TICK_S", 60.0)
    srv, thread = started(QuietServer, free_port())
    srv.handle_exit(signal.SIGTERM, None)
    thread.join(30)
    assert not thread.is_alive(), "the server waits for its next tick to stop"
