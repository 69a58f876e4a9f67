"""Logs that explain: one access line per request to a session's API, a WARNING with the reason for every
4xx/5xx the proxy or slime's routes answer, and the refusals counted in /metrics by a bounded reason or route
label. A real buffer subprocess (text logs at INFO) whose agent run generates on the simulated engine with the
real Qwen3 tokenizer; its log file is read back."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from ops_helpers import delta, scrape
from servers import Server, free_port, running, session_host, sim_engine

from rollout_buffer.observability import logs

USER = [{"role": "user", "content": "What is 2 + 3?"}]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("logs-sim"), qwen_tokenizer_path) as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory, engine: Server, qwen_tokenizer_path: str) -> Iterator[Server]:
    """A buffer (default `--access-log info`) holding an agent run that hosts sessions."""
    with session_host(tmp_path_factory.mktemp("logs-buffer"), engine.url, qwen_tokenizer_path, max_tokens=256) as srv:
        yield srv


def open_session(url: str, instance_id: str) -> dict[str, Any]:
    answer = httpx.post(f"{url}/sessions", json={"instance_id": instance_id}, timeout=60)
    assert answer.status_code == 200, answer.text
    return answer.json()


def log_lines(srv: Server, *parts: str, expect: int = 1, timeout_s: float = 10.0) -> list[str]:
    """The log lines holding every one of `parts`, once there are at least `expect` of them (a line is
    written just after its response went out, so it may trail the response the test already holds)."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = [line for line in srv.log().splitlines() if all(p in line for p in parts)]
        if len(found) >= expect or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def proxy_errors(before: dict, after: dict, protocol: str, reason: str) -> float:
    return delta(after, before, "rollout_buffer_proxy_errors_total", protocol=protocol, reason=reason)


def test_a_chat_completion_gets_one_access_line(buffer: Server) -> None:
    session = open_session(buffer.url, "access-json")
    sid = session["session_id"]
    answer = httpx.post(f"{session['base_url']}/chat/completions", json={"model": "m", "messages": USER}, timeout=30,
                        headers={"authorization": f"Bearer {session['api_key']}"})
    assert answer.status_code == 200, answer.text
    new_tokens = answer.json()["usage"]["completion_tokens"]
    assert new_tokens > 0
    lines = log_lines(buffer, "rollout_buffer.access", f"session={sid} ")
    assert len(lines) == 1, lines
    assert re.search(rf" INFO rollout_buffer\.access: session={sid} protocol=openai route=chat/completions "
                     rf"status=200 new_tokens={new_tokens} ms=\d+\.\d$", lines[0]), lines[0]


def test_a_streamed_anthropic_turn_gets_its_access_line_once_delivered(buffer: Server) -> None:
    session = open_session(buffer.url, "access-stream")
    sid = session["session_id"]
    body = {"model": "m", "max_tokens": 64, "messages": USER, "stream": True}
    with httpx.stream("POST", f"{session['anthropic_base_url']}/v1/messages", json=body, timeout=30,
                      headers={"x-api-key": session["api_key"]}) as answer:
        events = [line for line in answer.iter_lines() if line.startswith("data: ")]
    assert answer.status_code == 200 and events
    output_tokens = [int(m) for e in events for m in re.findall(r'"output_tokens":(\d+)', e)][-1]
    lines = log_lines(buffer, "rollout_buffer.access", f"session={sid} ")
    assert len(lines) == 1, lines
    assert f"protocol=anthropic route=messages status=200 new_tokens={output_tokens} ms=" in lines[0]


def test_an_unknown_session_is_logged_with_its_reason_and_counted(buffer: Server) -> None:
    before = scrape(buffer.url)
    answer = httpx.post(f"{buffer.url}/sessions/s-nope/v1/chat/completions", json={"model": "m", "messages": USER},
                        timeout=10)
    assert answer.status_code == 404 and "unknown session 's-nope'" in answer.json()["error"]["message"]
    warning = log_lines(buffer, " WARNING ", "session=s-nope ")
    assert len(warning) == 1, warning
    assert ("protocol=openai route=chat/completions status=404 reason=unknown_session: unknown session 's-nope'"
            in warning[0])
    assert log_lines(buffer, "rollout_buffer.access", "session=s-nope ", "status=404 new_tokens=0")
    assert proxy_errors(before, scrape(buffer.url), "openai", "unknown_session") == 1


def test_an_unknown_route_under_a_session_is_refused_in_its_protocol_logged_and_counted(buffer: Server) -> None:
    session = open_session(buffer.url, "unknown-route")
    sid = session["session_id"]
    before = scrape(buffer.url)
    # A client pointed at the wrong base URL: OpenAI's legacy completions, Anthropic's path doubled.
    legacy = httpx.post(f"{session['base_url']}/completions", json={"model": "m", "prompt": "hi"}, timeout=10)
    assert legacy.status_code == 404 and "'completions'" in legacy.json()["error"]["message"]
    doubled = httpx.post(f"{session['base_url']}/v1/messages", json={"model": "m", "messages": USER}, timeout=10,
                         headers={"anthropic-version": "2023-06-01"})
    assert doubled.status_code == 404 and doubled.json()["error"]["type"] == "not_found_error"
    wrong_method = httpx.get(f"{session['base_url']}/chat/completions", timeout=10)
    assert wrong_method.status_code == 405
    warnings = log_lines(buffer, " WARNING ", f"session={sid} ", expect=3)
    assert len(warnings) == 3, warnings
    assert "protocol=openai route=completions status=404 reason=unknown_route: no route 'completions'" in warnings[0]
    assert "protocol=anthropic route=v1/messages status=404 reason=unknown_route" in warnings[1]
    assert "route=chat/completions status=405 reason=method_not_allowed: chat/completions takes POST" in warnings[2]
    after = scrape(buffer.url)
    assert proxy_errors(before, after, "openai", "unknown_route") == 1
    assert proxy_errors(before, after, "anthropic", "unknown_route") == 1
    assert proxy_errors(before, after, "openai", "method_not_allowed") == 1
    # Refused by the proxy itself: not counted again as one of FastAPI's unmatched routes.
    assert delta(after, before, "rollout_buffer_http_errors_total", route="unmatched", status="404") == 0


def test_a_malformed_body_is_logged_with_its_reason_and_counted(buffer: Server) -> None:
    session = open_session(buffer.url, "malformed")
    sid = session["session_id"]
    before = scrape(buffer.url)
    key = {"authorization": f"Bearer {session['api_key']}"}
    raw = httpx.post(f"{session['base_url']}/chat/completions", content=b"{not json", timeout=10,
                     headers={"content-type": "application/json", **key})
    assert raw.status_code == 400
    empty = httpx.post(f"{session['base_url']}/chat/completions", json={"model": "m", "messages": []}, timeout=10,
                       headers=key)
    assert empty.status_code == 400
    warnings = log_lines(buffer, " WARNING ", f"session={sid} ", expect=2)
    assert len(warnings) == 2, warnings
    assert "route=chat/completions status=400 reason=bad_request: the body is not valid JSON" in warnings[0]
    assert "status=400 reason=bad_request: messages" in warnings[1]
    assert proxy_errors(before, scrape(buffer.url), "openai", "bad_request") == 2


def test_a_client_that_hangs_up_is_logged_and_counted(buffer: Server, engine: Server) -> None:
    session = open_session(buffer.url, "hang-up")
    sid = session["session_id"]
    before = scrape(buffer.url)
    httpx.post(f"{engine.url}/sim/faults", json={"next": ["hang"]}, timeout=5).raise_for_status()
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{session['base_url']}/chat/completions", json={"model": "m", "messages": USER}, timeout=1.0,
                   headers={"authorization": f"Bearer {session['api_key']}"})
    warnings = log_lines(buffer, " WARNING ", f"session={sid} ", timeout_s=10)
    assert len(warnings) == 1 and "status=499 reason=client_gone" in warnings[0], warnings
    assert proxy_errors(before, scrape(buffer.url), "openai", "client_gone") == 1


def test_slimes_routes_refusals_are_logged_and_counted_by_route_template(buffer: Server) -> None:
    before = scrape(buffer.url)
    refused = httpx.post(f"{buffer.url}/start_rollout", json={"task_type": "no-such-task"}, timeout=10)
    assert refused.status_code == 422 and "task_type: unknown 'no-such-task'" in refused.json()["message"]
    missing = httpx.get(f"{buffer.url}/trajectories/u-missing", timeout=10)
    assert missing.status_code == 404
    nowhere = httpx.get(f"{buffer.url}/no/such/path", timeout=10)
    assert nowhere.status_code == 404
    # A route served ahead of FastAPI's router (once per session) is logged and counted the same way.
    wrong_run = httpx.post(f"{buffer.url}/sessions", json={"instance_id": "x", "run_id": "r-none"}, timeout=10)
    assert wrong_run.status_code == 409 and wrong_run.json()["message"].startswith("run_id: 'r-none'")
    bad = httpx.post(f"{buffer.url}/sessions", json={"instance_id": "x", "metadata": 5}, timeout=10)
    assert bad.status_code == 422 and "body.metadata" in bad.json()["message"], bad.text
    warning = log_lines(buffer, " WARNING rollout_buffer.http: ", "route=/start_rollout ")
    assert len(warning) == 1, warning
    assert "status=422 method=POST path=/start_rollout: task_type: unknown 'no-such-task'" in warning[0]
    assert log_lines(buffer, "route=/trajectories/{uid} status=404 method=GET path=/trajectories/u-missing: "
                             "uid: no trajectory 'u-missing'")
    assert log_lines(buffer, "route=unmatched status=404 method=GET path=/no/such/path: Not Found")
    assert log_lines(buffer, "route=/sessions status=409 method=POST path=/sessions: run_id: 'r-none'")
    assert log_lines(buffer, "route=/sessions status=422 method=POST path=/sessions: invalid request: "
                             "body.metadata")
    after = scrape(buffer.url)
    assert delta(after, before, "rollout_buffer_http_errors_total", route="/start_rollout", status="422") == 1
    assert delta(after, before, "rollout_buffer_http_errors_total", route="/trajectories/{uid}", status="404") == 1
    assert delta(after, before, "rollout_buffer_http_errors_total", route="unmatched", status="404") == 1
    assert delta(after, before, "rollout_buffer_http_errors_total", route="/sessions", status="409") == 1
    assert delta(after, before, "rollout_buffer_http_errors_total", route="/sessions", status="422") == 1
    # The refused start left the agent run running: its sessions still open.
    open_session(buffer.url, "after-refusal")


def test_access_log_modes() -> None:
    try:
        logs.set_access_log("debug")
        assert logs.access_level == logging.DEBUG
        logs.set_access_log("off")
        assert not logs.access.isEnabledFor(logs.access_level)
        with pytest.raises(ValueError, match="access log must be one of info, debug, off"):
            logs.set_access_log("loud")
    finally:
        logs.set_access_log("info")
    assert logs.access_level == logging.INFO and logs.access.level == logging.NOTSET


def test_access_log_off_keeps_the_warnings(tmp_path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--access-log", "off"]
    with running(args, "/healthz", port, tmp_path / "buffer.log") as srv:
        answer = httpx.get(f"{srv.url}/sessions/s-gone/v1/models", timeout=10)
        assert answer.status_code == 404
        assert log_lines(srv, " WARNING ", "session=s-gone protocol=openai route=models status=404 "
                                           "reason=unknown_session")
    assert "rollout_buffer.access" not in srv.log()
