"""The shortcuts' off switch (`serve --no-shortcuts`, `ROLLOUT_BUFFER_SHORTCUTS=off`): the buffer and its session
workers then use only the public APIs of uvicorn, FastAPI, transformers and jinja2, and answer exactly as with
them (`rollout_buffer/shortcuts/`)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from runs import drain
from servers import Server, free_ports, session_host, sim_engine, stopped_while_long_polling
from sessions import OPENAI_TOOLS, PARALLEL_TASK, open_session, tool_results

from rollout_buffer.shortcuts import switch
from rollout_buffer.shortcuts import templates as internals
from rollout_buffer.shortcuts.quiet_server import SHUTDOWN_GRACE_S
from rollout_buffer.tokens.renderer import Renderer
from rollout_buffer.tokens.tokenizer import load_tokenizer

MESSAGES = [{"role": "system", "content": "You are careful."}, {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3 + 3?"}]


def test_the_switch_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(switch.ENV, raising=False)
    assert all(switch.enabled(name) for name in switch.NAMES) and switch.inherited() == {}
    for off in ("off", "OFF", "0", "false", "no"):
        monkeypatch.setenv(switch.ENV, off)
        assert not any(switch.enabled(name) for name in switch.NAMES) and switch.inherited() == {switch.ENV: "off"}
    monkeypatch.setenv(switch.ENV, "on")
    assert switch.enabled("templates")
    monkeypatch.setenv(switch.ENV, "fast_routes, templates")  # only those
    assert switch.switched_off() == ("templates", "fast_routes") and switch.enabled("http_protocol")
    assert switch.inherited() == {switch.ENV: "templates,fast_routes"}
    switch.switch_off(["quiet_server"])  # adds to what is off
    assert switch.switched_off() == ("templates", "fast_routes", "quiet_server")
    with pytest.raises(ValueError, match="no shortcut named templatez"):
        switch.switch_off(["templatez"])
    with pytest.raises(KeyError):
        switch.enabled("templatez")


def test_serve_refuses_a_shortcut_it_does_not_have(tmp_path: Path) -> None:
    done = subprocess.run([sys.executable, "-m", "rollout_buffer", "serve", "--port", str(free_ports(1)),
                           "--data-dir", str(tmp_path / "data"), "--no-shortcuts", "fast_route"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--no-shortcuts: no shortcut named fast_route" in done.stderr, done.stderr


def test_switched_off_chat_templates_render_through_transformers_public_api(
        qwen_tokenizer_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    on = load_tokenizer(qwen_tokenizer_path)
    expected = Renderer(on, None, {}).render(MESSAGES, True)
    monkeypatch.setenv(switch.ENV, "off")
    monkeypatch.setattr(internals, "_transformers_choice", None)  # chosen again, under the switch
    choice = internals.transformers_internals()
    assert choice.compile_template is None and not choice.reasoning_fields_match
    off = load_tokenizer(qwen_tokenizer_path)
    off.chat_template = off.chat_template + "{#- switched off -#}"  # a template no earlier test compiled
    renderer = Renderer(off, None, {})
    assert renderer.render(MESSAGES, True) == expected == off.apply_chat_template(
        MESSAGES, tokenize=False, add_generation_prompt=True)
    assert renderer._template is None, "no direct render"
    assert internals.speed_up_template_sandbox(off.chat_template) is False, "jinja's own sandbox"


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("shortcuts-sim"), qwen_tokenizer_path) as srv:
        yield srv


def _agent_session(url: str) -> dict[str, Any]:
    """A two-turn tool-calling session (opened at the buffer, driven and finished at its worker); its record."""
    session = open_session(url, "shortcuts")
    client = openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=0)
    messages: list[dict[str, Any]] = [{"role": "user", "content": PARALLEL_TASK}]
    message = client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS).choices[0].message
    messages += [{"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in message.tool_calls]},
                 *tool_results(message.tool_calls)]
    final = client.chat.completions.create(model="m", messages=messages, tools=OPENAI_TOOLS).choices[0].message
    assert final.content == "The results are: 12 * 7 + 3 = 87, 45 - 6 = 39."
    finished = httpx.post(session["finish_url"], json={"reward": 1.0}, timeout=60).json()
    assert finished["success"] and finished["records"] == 1, finished
    records = drain(url, wait_s=5)
    assert len(records) == 1
    return records[0]


def test_switched_off_the_buffer_and_its_workers_answer_the_same(
        tmp_path: Path, engine: Server, qwen_tokenizer_path: str) -> None:
    records = {}
    for mode, extra in (("on", ()), ("off", ("--no-shortcuts",))):
        (tmp_path / mode).mkdir()
        with session_host(tmp_path / mode, engine.url, qwen_tokenizer_path, "--session-workers", "1",
                          "--session-worker-port", str(free_ports(1)), *extra, num_repeat_per_sample=1) as srv:
            records[mode] = _agent_session(srv.url)
            log = srv.log()
        # The worker was told (its process title hides its environment from /proc).
        assert ("rollout_buffer.server.session_worker: shortcuts are off" in log) == (mode == "off"), log[-3000:]
        assert ("rollout_buffer.tools.cli: shortcuts are off" in log) == (mode == "off")
    on, off = records["on"], records["off"]
    for field in ("tokens", "loss_mask", "rollout_log_probs", "response_length", "messages", "reward"):
        assert on[field] == off[field], field


def test_switched_off_a_stop_signal_still_answers_open_long_polls_at_once(tmp_path: Path) -> None:
    port = free_ports(1)
    srv = Server(["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--no-shortcuts"],
                 "/healthz", port, tmp_path / "buffer.log").start()
    try:
        answer, took = stopped_while_long_polling(srv)
        assert answer.json()["success"] is False and took < SHUTDOWN_GRACE_S + 20
        assert "stopping: open long-polls answered" in srv.log()
    finally:
        srv.stop()
