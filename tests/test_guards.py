"""The security checks (`server.guards`: the request gate — agent socket, browsers, credentials —, a session's key,
the body cap), each written once and applied by both layers: FastAPI's middleware (slime's routes, refused in
slime's shape) and the session API's fast path (`/sessions/{id}/v1/...`, refused in OpenAI's or Anthropic's shape).

The checks directly on hand-made scopes, then over real HTTP against buffers running in this process (uvicorn in
a thread; a subprocess would add nothing here) on 127.0.0.1 and on their agent socket, each with an agent run
that hosts sessions. No engine: every request here is refused, or answered, before a turn would reach one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from servers import free_port

from rollout_buffer.config import ServerConfig
from rollout_buffer.policy import Policy
from rollout_buffer.server.app import create_app
from rollout_buffer.server.guards import (
    BodyTooLarge,
    Guards,
    Refusal,
    host_name,
    needs_server_token,
    presented_token,
    token_ok,
)
from rollout_buffer.server.peer import is_loopback, peer_uid

TOKEN = "s3cret"
CAP = 4096
AUTH = {"authorization": f"Bearer {TOKEN}"}
ANTHROPIC = {"anthropic-version": "2023-06-01"}
SOCKET_PATH = "/tmp/guards-test/agents.sock"


# ---- the checks themselves ---------------------------------------------------------------------------------------

def scope(path: str = "/status", headers: dict[str, str] | None = None, *, on_socket: bool = False,
          method: str = "GET", client: tuple[str, int] = ("10.0.0.9", 40000)) -> dict[str, Any]:
    """An HTTP scope as uvicorn builds it: a Unix socket's server is (path, None). The client is not on loopback
    (no peer to ask the kernel about) unless given."""
    return {"type": "http", "path": path, "method": method,
            "headers": [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()],
            "server": (SOCKET_PATH, None) if on_socket else ("127.0.0.1", 8889), "client": client}


def test_the_bearer_token_check() -> None:
    guards = Guards(TOKEN, None, CAP)
    assert presented_token(scope(headers=AUTH)) == TOKEN.encode()
    assert presented_token(scope(headers={"authorization": f"bearer  {TOKEN} "})) == TOKEN.encode()
    assert presented_token(scope(headers={"authorization": f"Basic {TOKEN}"})) == b""
    assert presented_token(scope(headers={"x-api-key": TOKEN})) == b"", "x-api-key only where a session's API reads it"
    assert presented_token(scope(headers={"x-api-key": TOKEN}), x_api_key=True) == TOKEN.encode()
    assert token_ok(b"a", (b"b", b"a")) and not token_ok(b"c", (b"b", b"a")) and not token_ok(b"", (b"",))

    # FastAPI's routes: the server token, except where none is needed.
    assert guards.refusal(scope(headers=AUTH)) is None
    for headers in ({}, {"authorization": "Bearer nope"}, {"x-api-key": TOKEN}, {"authorization": TOKEN}):
        assert guards.refusal(scope(headers=headers)) == Refusal(401, guards.refusal(scope()).message), headers
    for path in ("/healthz", "/ui", "/ui/", "/ui/static/app.js", "/sessions/s-1/v1/models"):
        assert not needs_server_token(path) and guards.refusal(scope(path)) is None, path
    for path in ("/ui/api/runs", "/sessions", "/sessions/s-1", "/sessions/s-1/finish", "/metrics"):
        assert needs_server_token(path) and guards.refusal(scope(path)).status == 401, path
    assert guards.refusal(scope("/sessions/s-1", method="HEAD")) is None, "Claude Code's bodiless probe"
    assert Guards(None, None, CAP).refusal(scope()) is None, "no --auth-token, a caller from another address"

    # A session's API: its key or the server token, as a bearer token or x-api-key, with or without a server token.
    for keeper in (guards, Guards(None, None, CAP)):
        for headers in ({"authorization": "Bearer key-1"}, {"x-api-key": "key-1"}):
            assert keeper.session_key_ok(scope("/sessions/s-1/v1/models", headers), "key-1"), headers
        for headers in ({}, {"authorization": "Bearer key-2"}, {"x-api-key": "nope"}):
            assert not keeper.session_key_ok(scope("/sessions/s-1/v1/models", headers), "key-1"), headers
    for headers in (AUTH, {"x-api-key": TOKEN}):
        assert guards.session_key_ok(scope("/sessions/s-1/v1/models", headers), "key-1"), headers


def test_browsers_cannot_post_across_sites_or_rebind_names() -> None:
    open_server, locked = Guards(None, None, CAP, frozenset({"buffer.internal"})), Guards(TOKEN, None, CAP)
    json_type = {"content-type": "application/json", "content-length": "2"}
    form = {"content-type": "text/plain", "content-length": "2"}
    # A body must be JSON on every state-changing route (a cross-site form cannot send that), an empty one aside.
    for guards in (open_server, locked):
        for path in ("/start_rollout", "/sessions/s-1/v1/chat/completions", "/buffer/write"):
            refused = guards.refusal(scope(path, {**form, **AUTH}, method="POST"))
            assert refused is not None and refused.status == 415 and "application/json" in refused.message, path
            for kind in ("application/x-www-form-urlencoded", "multipart/form-data; boundary=x", ""):
                headers = {"content-type": kind, "content-length": "2", **AUTH}
                assert guards.refusal(scope(path, headers, method="POST")).status == 415, (path, kind)
            chunked = {"content-type": "text/plain", "transfer-encoding": "chunked", **AUTH}
            assert guards.refusal(scope(path, chunked, method="POST")).status == 415
        json_charset = {"content-type": "Application/JSON; charset=utf-8", "content-length": "2", **AUTH}
        assert guards.refusal(scope("/start_rollout", json_charset, method="POST")) is None
        assert guards.refusal(scope("/get_rollout_data", {"content-length": "0", **AUTH}, method="POST")) is None
        assert guards.refusal(scope("/get_rollout_data", AUTH, method="POST")) is None, "slime may send no body"
        # A browser's Origin must be the server's own.
        own = {**json_type, **AUTH, "host": "127.0.0.1:8889", "origin": "http://127.0.0.1:8889"}
        assert guards.refusal(scope("/start_rollout", own, method="POST")) is None
        for origin in ("http://evil.example", "null", "http://127.0.0.1:9999", "file://"):
            headers = {**own, "origin": origin}
            for path in ("/start_rollout", "/sessions/s-1/v1/chat/completions"):
                refused = guards.refusal(scope(path, headers, method="POST"))
                assert refused is not None and refused.status == 403 and "origin" in refused.message, (origin, path)
    # Without a token the Host must name this server (DNS rebinding: a page's own name resolving to 127.0.0.1).
    for host in ("127.0.0.1:8889", "localhost:8889", "[::1]:8889", "127.0.0.2", "buffer.internal:8889", "LOCALHOST"):
        assert open_server.refusal(scope(headers={"host": host})) is None, host
    for host in ("evil.example", "evil.example:8889", "127.0.0.1.evil.example", "localhost.evil.example"):
        refused = open_server.refusal(scope(headers={"host": host}))
        assert refused is not None and refused.status == 403 and "--allowed-host" in refused.message, host
    # With one, a request presenting it is taken by any name (a page cannot attach it by itself).
    assert locked.refusal(scope(headers={"host": "10.1.2.3:8889", **AUTH})) is None
    assert locked.refusal(scope(headers={"host": "evil.example"})).status == 401
    assert host_name("[::1]:8889") == "::1" and host_name("Example.COM:80") == "example.com"


def test_without_a_token_only_the_servers_own_user_calls_its_routes() -> None:
    """The kernel names the user of a loopback caller's socket (netlink socket diagnostics)."""
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("::ffff:127.0.0.1")
    assert not is_loopback("10.0.0.1") and not is_loopback("not an address")
    with socket.create_server(("127.0.0.1", 0)) as listener, socket.create_connection(listener.getsockname()):
        accepted, client = listener.accept()
        with accepted:
            assert peer_uid(client, listener.getsockname()) == os.geteuid()
            guards = Guards(None, None, CAP)
            local = {**scope(), "client": client, "server": listener.getsockname()}
            assert guards.refusal(local) is None
            assert peer_uid(("127.0.0.1", 1), listener.getsockname()) is None, "no such connection"
            gone = {**local, "client": ("127.0.0.1", 1)}
            refused = guards.refusal(gone)
            assert refused is not None and refused.status == 403 and "--auth-token" in refused.message


def test_the_agent_socket_gate() -> None:
    guards = Guards(None, SOCKET_PATH, CAP)
    assert guards.on_agent_socket(scope(on_socket=True)) and not guards.on_agent_socket(scope())
    assert not Guards(None, "/elsewhere.sock", CAP).on_agent_socket(scope(on_socket=True))
    assert not Guards(None, None, CAP).on_agent_socket(scope(on_socket=True))
    # On the socket: a session's API only (whose key the session API checks)...
    for path in ("/status", "/healthz", "/sessions", "/sessions/s-1", "/ui", "/sessions/s-1/v1/"):
        refused = guards.refusal(scope(path, on_socket=True))
        assert refused is not None and refused.status == 403 and guards.refusal(scope(path)) is None, path
    assert guards.refusal(scope("/sessions/s-1/v1/chat/completions", on_socket=True)) is None
    # ...and that with the session's key, as over TCP.
    models = "/sessions/s-1/v1/models"
    assert not guards.session_key_ok(scope(models, on_socket=True), "key-1")
    assert guards.session_key_ok(scope(models, {"x-api-key": "key-1"}, on_socket=True), "key-1")


def test_the_body_cap() -> None:
    guards = Guards(None, None, CAP)
    guards.check_declared_length(scope(headers={"content-length": str(CAP)}))
    guards.check_declared_length(scope(headers={"content-length": "not a number"}))
    with pytest.raises(BodyTooLarge) as declared:
        guards.check_declared_length(scope(headers={"content-length": str(CAP + 1)}))
    assert (declared.value.status_code, declared.value.detail) == (413, f"request body exceeds {CAP} bytes")

    async def chunks(*sizes: int) -> AsyncIterator[dict[str, Any]]:
        for i, size in enumerate(sizes):
            yield {"type": "http.request", "body": b"x" * size, "more_body": i < len(sizes) - 1}

    async def read(*sizes: int) -> int:
        source = chunks(*sizes)
        receive = guards.capped(source.__anext__)
        seen, more = 0, True
        while more:
            msg = await receive()
            seen, more = seen + len(msg["body"]), msg["more_body"]
        return seen

    assert asyncio.run(read(CAP // 2, CAP // 2)) == CAP
    with pytest.raises(BodyTooLarge):
        asyncio.run(read(CAP // 2, CAP // 2, 1))


def test_both_layers_hold_the_same_guards(tmp_path: Path) -> None:
    config = ServerConfig(data_dir=tmp_path, auth_token=TOKEN, max_body_bytes=CAP, agent_socket=tmp_path / "a.sock")
    app: Any = create_app(config)
    installed = [m.kwargs["guards"] for m in app.user_middleware if "guards" in m.kwargs]
    assert len(installed) == 2 and all(g is app.front.guards for g in installed)
    assert app.front.guards == Guards(TOKEN, str(tmp_path / "a.sock"), CAP, frozenset({"127.0.0.1"}))


# ---- over HTTP: FastAPI's routes and the session API alike ------------------------------------------------------

@dataclass
class Buffer:
    url: str
    agent_socket: Path
    session: dict[str, Any]

    def over_socket(self) -> httpx.Client:
        return httpx.Client(transport=httpx.HTTPTransport(uds=str(self.agent_socket)), base_url="http://agent",
                            timeout=10)

    def session_url(self, endpoint: str) -> str:
        return f"/sessions/{self.session['session_id']}/v1/{endpoint}"


@contextlib.contextmanager
def buffer_in_process(folder: Path, tokenizer: str, auth_token: str | None) -> Iterator[Buffer]:
    """A buffer (`create_app`, served by uvicorn in a thread) on a free port of 127.0.0.1 and on an agent socket,
    like `serve`, holding an agent run that hosts sessions, with one session open."""
    port = free_port()
    agent_socket = folder / "agents.sock"
    unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    unix.bind(str(agent_socket))
    tcp = socket.create_server(("127.0.0.1", port))
    config = ServerConfig(port=port, data_dir=folder / "data", auth_token=auth_token, max_body_bytes=CAP,
                          agent_socket=agent_socket, policy=Policy(read_roots=(Path(tokenizer),)))
    server = uvicorn.Server(uvicorn.Config(create_app(config), log_level="warning", access_log=False,
                                           log_config=None, timeout_graceful_shutdown=1))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [tcp, unix]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 30
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "the buffer did not start"
            time.sleep(0.02)
        url = f"http://127.0.0.1:{port}"
        headers = AUTH if auth_token else {}
        # No engine listens there: nothing here generates a turn.
        started = httpx.post(f"{url}/start_rollout", headers=headers, timeout=60, json={
            "task_type": "agent", "remote_engine_url": f"http://127.0.0.1:{free_port()}", "tokenizer_path": tokenizer})
        assert started.status_code == 200, started.text
        opened = httpx.post(f"{url}/sessions", headers=headers, timeout=60, json={"instance_id": "guards"})
        assert opened.status_code == 200, opened.text
        yield Buffer(url, agent_socket, opened.json())
    finally:
        server.should_exit = True
        thread.join(30)
        tcp.close()
        unix.close()


@pytest.fixture(scope="module")
def with_token(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Buffer]:
    """A buffer with `--auth-token` and a 4 KiB body cap."""
    with buffer_in_process(tmp_path_factory.mktemp("guards-token"), qwen_tokenizer_path, TOKEN) as buffer:
        yield buffer


@pytest.fixture(scope="module")
def without_token(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Buffer]:
    """A buffer without a server token (its own user's requests need none; a session's API still its key)."""
    with buffer_in_process(tmp_path_factory.mktemp("guards-open"), qwen_tokenizer_path, None) as buffer:
        yield buffer


def slime_refusal(resp: httpx.Response, status: int, message: str) -> None:
    assert resp.status_code == status, resp.text
    assert resp.json()["success"] is False and message in resp.json()["message"], resp.text


def openai_refusal(resp: httpx.Response, status: int, code: str) -> None:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == ("invalid_request_error", code), resp.text


def anthropic_refusal(resp: httpx.Response, status: int, kind: str) -> None:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and body["error"]["type"] == kind, resp.text


def test_a_missing_or_wrong_bearer_token_is_refused_on_both_paths(with_token: Buffer) -> None:
    url, key = with_token.url, with_token.session["api_key"]
    models, count = with_token.session_url("models"), with_token.session_url("messages/count_tokens")
    counting = {"model": "m", "messages": [{"role": "user", "content": "Hi."}]}
    for wrong in ({}, {"authorization": "Bearer nope"}, {"authorization": TOKEN}):
        # slime's routes (FastAPI's middleware), in slime's shape
        slime_refusal(httpx.get(f"{url}/status", headers=wrong), 401, "missing or wrong bearer token")
        slime_refusal(httpx.post(f"{url}/sessions", headers=wrong, json={"instance_id": "x"}), 401, "bearer token")
        # a session's API (the fast path), in its protocol's shape
        openai_refusal(httpx.get(f"{url}{models}", headers=wrong), 401, "invalid_api_key")
        anthropic_refusal(httpx.post(f"{url}{count}", headers={**wrong, **ANTHROPIC}, json=counting), 401,
                          "authentication_error")
    openai_refusal(httpx.get(f"{url}{models}", headers={"x-api-key": "nope"}), 401, "invalid_api_key")
    # The session's key opens its own API only; the server token opens both.
    slime_refusal(httpx.get(f"{url}/status", headers={"authorization": f"Bearer {key}"}), 401, "bearer token")
    slime_refusal(httpx.get(f"{url}/status", headers={"x-api-key": TOKEN}), 401, "bearer token")
    assert httpx.get(f"{url}/status", headers=AUTH).status_code == 200
    assert httpx.get(f"{url}/healthz").status_code == 200
    for good in (AUTH, {"authorization": f"Bearer {key}"}, {"x-api-key": key}):
        assert httpx.get(f"{url}{models}", headers=good).status_code == 200, good
    counted = httpx.post(f"{url}{count}", headers={"x-api-key": key, **ANTHROPIC}, json=counting)
    assert counted.status_code == 200 and counted.json()["input_tokens"] > 0, counted.text


def test_an_oversized_body_is_refused_on_both_paths(with_token: Buffer) -> None:
    url, key = with_token.url, with_token.session["api_key"]
    session = {"authorization": f"Bearer {key}"}
    huge = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x" * (CAP + 1)}]}

    def chunks() -> Iterator[bytes]:  # no Content-Length: the cap is found while the body is read
        yield b'{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "'
        for _ in range(CAP // 1000 + 1):
            yield b"y" * 1000
        yield b'"}]}'

    message = f"request body exceeds {CAP} bytes"
    json_type = {"content-type": "application/json"}
    for content in (huge, chunks):
        def post(path: str, headers: dict[str, str], content: Any = content) -> httpx.Response:
            if callable(content):
                return httpx.post(f"{url}{path}", content=content(), headers={**headers, **json_type}, timeout=10)
            return httpx.post(f"{url}{path}", json=content, headers=headers, timeout=10)

        # slime's routes: one parsed by hand, one by FastAPI
        slime_refusal(post("/buffer/write", AUTH), 413, message)
        slime_refusal(post("/ack", AUTH), 413, message)
        # a session's API
        openai_refusal(post(with_token.session_url("chat/completions"), session), 413, "request_too_large")
        assert message in post(with_token.session_url("chat/completions"), session).json()["error"]["message"]
        anthropic_refusal(post(with_token.session_url("messages"), {**session, **ANTHROPIC}), 413, "request_too_large")
    # Authentication comes first on slime's routes, the declared length on a session's API (as before).
    slime_refusal(httpx.post(f"{url}/buffer/write", json=huge), 401, "bearer token")
    openai_refusal(httpx.post(f"{url}{with_token.session_url('chat/completions')}", json=huge), 413,
                   "request_too_large")
    # Under the cap, the session still answers.
    small = {"model": "m", "messages": [{"role": "user", "content": "Hi."}]}
    counted = httpx.post(f"{url}{with_token.session_url('messages/count_tokens')}", json=small,
                         headers={**session, **ANTHROPIC}, timeout=10)
    assert counted.status_code == 200, counted.text


def test_the_agent_socket_serves_only_session_apis_with_their_keys(with_token: Buffer, without_token: Buffer) -> None:
    gate = "the agent socket serves only /sessions/{session_id}/v1/"
    for buffer in (with_token, without_token):
        key = buffer.session["api_key"]
        models = buffer.session_url("models")
        with buffer.over_socket() as agent:
            # FastAPI's routes: refused in slime's shape, the server token or not.
            for path in ("/status", "/healthz", "/ui", f"/sessions/{buffer.session['session_id']}"):
                slime_refusal(agent.get(path, headers=AUTH), 403, gate)
            slime_refusal(agent.post("/sessions", json={"instance_id": "x"}, headers=AUTH), 403, gate)
            slime_refusal(agent.post("/buffer/write", json={}, headers=AUTH), 403, gate)
            # A session's API: its key required (also without a server token), refused in its protocol's shape.
            openai_refusal(agent.get(models), 401, "invalid_api_key")
            openai_refusal(agent.get(models, headers={"authorization": "Bearer nope"}), 401, "invalid_api_key")
            anthropic_refusal(agent.get(models, headers={"x-api-key": "nope", **ANTHROPIC}), 401,
                              "authentication_error")
            assert agent.get(models, headers={"authorization": f"Bearer {key}"}).status_code == 200
            answer = agent.get(models, headers={"x-api-key": key, **ANTHROPIC})
            assert answer.status_code == 200 and answer.json()["data"][0]["type"] == "model", answer.text
            # The body cap holds there too.
            huge = {"model": "m", "messages": [{"role": "user", "content": "x" * (CAP + 1)}]}
            openai_refusal(agent.post(buffer.session_url("chat/completions"), json=huge,
                                      headers={"authorization": f"Bearer {key}"}), 413, "request_too_large")
    # Over TCP a session's API asks for its key with a server token or without; the server's own user needs no
    # token for the rest of a buffer without one.
    for buffer in (with_token, without_token):
        models = f"{buffer.url}{buffer.session_url('models')}"
        openai_refusal(httpx.get(models), 401, "invalid_api_key")
        openai_refusal(httpx.get(models, headers={"authorization": "Bearer wrong"}), 401, "invalid_api_key")
        assert httpx.get(models, headers={"authorization": f"Bearer {buffer.session['api_key']}"}).status_code == 200
    assert httpx.get(f"{without_token.url}/status").status_code == 200
