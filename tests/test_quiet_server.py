"""The server the buffer and its workers run (`shortcuts.quiet_server`, `shortcuts.http_protocol`): an idle server does
not wake, the `Date` header stays current all the same, and a stop asked for (a signal, or `should_exit` from
another thread) is handled at once.

Served by the installed uvicorn in a thread: if uvicorn changes what `QuietServer` and `OneWriteHttpProtocol`
replace, these fail.
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
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.server import ServerState

from rollout_buffer.shortcuts.http_protocol import OneWriteHttpProtocol
from rollout_buffer.shortcuts.quiet_server import QuietServer


class Counted(QuietServer):
    """A QuietServer counting its ticks."""

    ticks = 0

    async def on_tick(self, counter: int) -> bool:
        self.ticks += 1
        return await super().on_tick(counter)


def started(cls: type[QuietServer], port: int) -> tuple[QuietServer, threading.Thread]:
    """A `cls` serving a one-route app on `port`, in a thread, once it is up."""
    app = Starlette(routes=[Route("/", lambda request: PlainTextResponse("ok"))])
    srv = cls(uvicorn.Config(app, host="127.0.0.1", port=port, log_config=None, access_log=False,
                             http=OneWriteHttpProtocol))
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
    # SignalledServer (shortcuts off) notes its loop at start-up.
    assert inspect.iscoroutinefunction(uvicorn.Server.startup)
    inspect.signature(uvicorn.Server.startup).bind(object(), sockets=None)
    srv = QuietServer(uvicorn.Config(Starlette()))  # uvicorn sets `should_exit` in __init__: the property takes it
    assert srv.should_exit is False
    assert isinstance(ServerState().default_headers, list)
    assert "on_headers_complete" in vars(HttpToolsProtocol)
    assert "default_headers=self.server_state.default_headers" in inspect.getsource(
        HttpToolsProtocol.on_headers_complete), "uvicorn no longer reads the default headers per request"


def test_an_idle_server_does_not_wake_and_its_date_header_stays_current(server: tuple[Counted, str]) -> None:
    srv, url = server
    ticks_before = srv.ticks
    time.sleep(2.5)
    assert srv.ticks - ticks_before <= 1, "the server's main loop ticks"
    dates = []
    for _ in range(2):
        answer = httpx.get(url, timeout=10)
        assert answer.status_code == 200 and answer.text == "ok"
        dates.append(email.utils.parsedate_to_datetime(answer.headers["date"]).timestamp())
        assert abs(dates[-1] - time.time()) <= 1.5
        time.sleep(1.2)
    assert dates[1] > dates[0], "the Date header was not renewed"


@pytest.mark.parametrize("stop", ["signal", "flag from another thread"])
def test_a_stop_asked_for_is_handled_at_once(stop: str) -> None:
    srv, thread = started(QuietServer, free_port())
    time.sleep(0.2)  # asleep in its main loop
    if stop == "signal":
        srv.handle_exit(signal.SIGTERM, None)
    else:
        srv.should_exit = True
    thread.join(30)
    assert not thread.is_alive(), "the server did not stop"
