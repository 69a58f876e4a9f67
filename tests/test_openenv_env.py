"""Task type `openenv`: environments written with OpenEnv's own server library (tests/data/openenv_envs/), served
by the real `openenv` package from PyPI in a venv of its own, train through sessions on the simulated engine —
servers the buffer starts from a command, and a server the user runs."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import uvicorn
from environment_venvs import OPENENV, OPENENV_ENVS
from fastapi import FastAPI, WebSocket
from masks import spans
from readable import readable_copies
from replay_checks import MOE, assert_replayed
from runs import drain, wait_finished
from servers import Server, buffer_server, free_port, sim_engine, wait_http
from sessions import assert_engine_continues, decode_tail


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("openenv-sim"), qwen_tokenizer_path, *MOE) as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with buffer_server(tmp_path_factory.mktemp("openenv-buffer")) as srv:
        yield srv


@pytest.fixture
def env_server(openenv_python: str, tmp_path: Path) -> Iterator[str]:
    """A server the user runs (here: the test), started from one of the test environments."""
    port = free_port()
    proc: subprocess.Popen[bytes] | None = None

    def start(script: str) -> str:
        nonlocal proc
        log = open(tmp_path / f"{script}.log", "wb")
        proc = subprocess.Popen([openenv_python, str(OPENENV_ENVS / script), "--port", str(port)], stdout=log,
                                stderr=subprocess.STDOUT)
        url = f"http://127.0.0.1:{port}"
        wait_http(url + "/health", 120, proc)
        return url

    yield start  # type: ignore[misc]
    if proc is not None:
        proc.terminate()
        proc.wait(30)


def start(buffer: Server, engine: Server, tokenizer: str, **options: Any) -> httpx.Response:
    return httpx.post(f"{buffer.url}/start_rollout", timeout=120, json={
        "task_type": "openenv", "remote_engine_url": engine.url, "tokenizer_path": tokenizer,
        "num_repeat_per_sample": 1, "max_tokens": 4096, "openenv_resets": [{"seed": 1}, {"seed": 2}], **options})


def replayed_rewards(python: str, url: str, reset: dict[str, Any], actions: list[str]) -> list[float | None]:
    """The environment's rewards for the same actions, through OpenEnv's own client (run in its venv)."""
    script = ("import json, sys\nfrom openenv import GenericEnvClient\n"
              "reset, actions = json.loads(sys.argv[1]), json.loads(sys.argv[2])\n"
              "with GenericEnvClient(base_url=sys.argv[3]).sync() as env:\n"
              "    env.reset(**reset)\n"
              "    print(json.dumps([env.step({'message': a}).reward for a in actions]))\n")
    out = subprocess.run([python, "-c", script, json.dumps(reset), json.dumps(actions), url], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    rewards: list[float | None] = json.loads(out.stdout.strip().splitlines()[-1])
    return rewards


def test_a_multi_step_environment_started_by_the_buffer(openenv_python: str, buffer: Server, engine: Server,
                                                        qwen_tokenizer_path: str, env_server: Any,
                                                        qwen_tokenizer: Any) -> None:
    # The servers' venv named by its requirements ({python} is its interpreter): made by the buffer the first time.
    # Its episodes' records carry the MoE routing of each token, as every record of a run asking for it.
    answer = start(buffer, engine, qwen_tokenizer_path, openenv_servers=2, openenv_max_sessions=2,
                   return_routed_experts=True,
                   openenv_requirements=[OPENENV],
                   openenv_command=["{python}", str(OPENENV_ENVS / "arith_drill.py"), "--port", "{port}"])
    assert answer.status_code == 200, answer.text
    assert answer.json()["num_items"] == 2  # one row per openenv_resets entry
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["statuses"] == {"completed": 2}, status["run"]["progress"]
    url = env_server("arith_drill.py")
    for rec in drain(buffer.url):
        info = rec["extra_info"]["openenv"]
        assert info["steps"] == 3 and info["done"] and info["end"] == "done"
        assert rec["raw_reward"] == sum(info["step_rewards"])
        actions = [m["content"].split("</think>")[-1].strip() for m in rec["messages"] if m["role"] == "assistant"]
        assert replayed_rewards(openenv_python, url, info["reset"], actions) == info["step_rewards"]
        trained = spans(rec["loss_mask"])
        assert len(trained) == 3  # one model turn a step; the environment's questions between them at loss 0
        for (_, end), (begin, _) in itertools.pairwise(trained):
            assert "What is" in decode_tail(rec["tokens"][end:begin])
        assert_engine_continues(engine, rec)
        assert_replayed(rec, len(qwen_tokenizer), teacher=False, top_p=False)


def test_mcp_tools_of_a_running_server_are_offered_to_the_policy(buffer: Server, engine: Server,
                                                                 qwen_tokenizer_path: str, env_server: Any) -> None:
    url = env_server("calc_tools.py")
    answer = start(buffer, engine, qwen_tokenizer_path, openenv_url=url, openenv_max_sessions=2)
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["statuses"] == {"completed": 2}, status["run"]["progress"]
    for rec in drain(buffer.url):
        info = rec["extra_info"]["openenv"]
        assert info["step_rewards"] == [1.0] and rec["raw_reward"] == 1.0  # the calculator's value was the target
        (trained,) = spans(rec["loss_mask"])
        prompt = decode_tail(rec["tokens"][:trained[0]])
        assert '"name": "calculator"' in prompt  # the environment's MCP tool, offered as a function
        assert "<tool_call>" in decode_tail(rec["tokens"][trained[0]:trained[1]])
        assert_engine_continues(engine, rec)


def test_a_server_that_dies_is_replaced_and_its_episode_retried(openenv_python: str, buffer: Server, engine: Server,
                                                                qwen_tokenizer_path: str, tmp_path: Path) -> None:
    flag = str(tmp_path / "crashed")
    answer = start(buffer, engine, qwen_tokenizer_path, openenv_resets=[{"seed": 3, "crash_flag": flag}],
                   num_repeat_per_sample=2,
                   openenv_command=[openenv_python, str(OPENENV_ENVS / "arith_drill.py"), "--port", "{port}"])
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["statuses"] == {"completed": 2}, status["run"]["progress"]
    records = drain(buffer.url)  # the whole group, nothing stored twice
    assert len(records) == 2 and sorted(r["extra_info"]["openenv"]["retries"] for r in records)[-1] >= 1
    assert "exited with code 7" in buffer.log()


def test_a_time_limit_is_recorded(openenv_python: str, buffer: Server, engine: Server, qwen_tokenizer_path: str
                                  ) -> None:
    answer = start(buffer, engine, qwen_tokenizer_path, openenv_resets=[{"seed": 4, "sleep_s": 30}],
                   openenv_timeout_s=3,
                   openenv_command=[openenv_python, str(OPENENV_ENVS / "arith_drill.py"), "--port", "{port}"])
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["failures"] == {"env_timeout": 1}, status["run"]["progress"]


def test_bad_options_are_refused_naming_the_option(buffer: Server, engine: Server, qwen_tokenizer_path: str,
                                                   tmp_path: Path) -> None:
    down = start(buffer, engine, qwen_tokenizer_path, openenv_url=f"http://127.0.0.1:{free_port()}")
    assert down.status_code == 422 and "openenv_url" in down.text, down.text
    both = start(buffer, engine, qwen_tokenizer_path, openenv_url="http://127.0.0.1:1", openenv_command=["x"])
    assert both.status_code == 422 and "openenv_url" in both.text, both.text
    no_port = start(buffer, engine, qwen_tokenizer_path, openenv_command=["python", "server.py"])
    assert no_port.status_code == 422 and "openenv_command" in no_port.text and "{port}" in no_port.text
    missing = start(buffer, engine, qwen_tokenizer_path, openenv_command=[str(tmp_path / "no" / "python"), "{port}"])
    assert missing.status_code == 422 and "openenv_command" in missing.text, missing.text
    assert httpx.get(f"{buffer.url}/healthz", timeout=10).status_code == 200


def test_the_dashboard_shows_the_environments_metrics(buffer: Server, engine: Server, qwen_tokenizer_path: str,
                                                      env_server: Any) -> None:
    url = env_server("calc_tools.py")
    answer = start(buffer, engine, qwen_tokenizer_path, openenv_url=url, openenv_max_sessions=2)
    assert answer.status_code == 200, answer.text
    status = wait_finished(buffer.url, timeout_s=300)
    metrics = status["run"]["progress"]["metrics"]
    assert metrics["return"] == {"mean": 1.0, "n": 2} and metrics["steps"] == {"mean": 1.0, "n": 2}
    chromium = os.environ.get("RB_CHROMIUM", "/usr/bin/chromium")
    if shutil.which(chromium) is None:
        pytest.skip(f"no chromium at {chromium} (Debian: apt-get install chromium; .ci/run does)")
    playwright_sync = pytest.importorskip("playwright.sync_api")
    with playwright_sync.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=["--no-sandbox", "--disable-gpu"])
        try:
            page = browser.new_page()
            page.set_default_timeout(15_000)
            page.goto(f"{buffer.url}/ui")
            page.wait_for_function("() => [...document.querySelectorAll('#reasons td')].some("
                                   "td => td.textContent === 'return')")
            rows = page.eval_on_selector_all("#reasons tbody tr", "rs => rs.map(r => r.innerText)")
            assert any("metric (mean)" in r and "return" in r and "1.00 of 2" in r for r in rows), rows
        finally:
            browser.close()
    drain(buffer.url)


def test_no_reward_and_a_malformed_one_are_recorded_failed(openenv_python: str, buffer: Server, engine: Server,
                                                           qwen_tokenizer_path: str) -> None:
    unscored = start(buffer, engine, qwen_tokenizer_path, openenv_resets=[{"seed": 5, "unscored": True}],
                     openenv_command=[openenv_python, str(OPENENV_ENVS / "arith_drill.py"), "--port", "{port}"])
    assert unscored.status_code == 200, unscored.text
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["failures"] == {"env_reward": 1}, status["run"]["progress"]
    with not_openenv_server() as url:  # speaks OpenEnv's protocol, but its reward is not a number
        malformed = start(buffer, engine, qwen_tokenizer_path, openenv_url=url)
        assert malformed.status_code == 200, malformed.text
        status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["failures"] == {"env_reward": 2}, status["run"]["progress"]
    assert "reward that is not a number: 'lots'" in buffer.log()


@contextlib.contextmanager
def not_openenv_server() -> Iterator[str]:
    """A server of OpenEnv's wire protocol (`/schema`, `/ws`) that answers every step with the reward "lots"."""
    app = FastAPI()

    @app.get("/schema")
    def schema() -> dict[str, Any]:
        return {"action": {"properties": {"message": {"type": "string"}}, "required": ["message"]}}

    @app.websocket("/ws")
    async def ws(socket: WebSocket) -> None:
        await socket.accept()
        while True:
            frame = await socket.receive_json()
            if frame["type"] == "close":
                return
            reward = None if frame["type"] == "reset" else "lots"
            await socket.send_json({"type": "observation", "data": {"observation": {"prompt": "Say a number."},
                                                                     "reward": reward, "done": False}})

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve()), daemon=True)
    thread.start()
    try:
        wait_http(f"http://127.0.0.1:{port}/schema", 30)
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def test_started_servers_run_as_the_user_the_run_names(openenv_python: str, buffer: Server,
                                                        engine: Server, qwen_tokenizer_path: str) -> None:
    if os.geteuid() != 0:
        pytest.skip("switching users needs the buffer to run as root")
    with readable_copies([OPENENV_ENVS / "arith_drill.py"], "rb-openenv-") as envs:
        server = [openenv_python, str(envs / "arith_drill.py")]
        run_as_nobody(buffer, engine, qwen_tokenizer_path, server)
    nobody = start(buffer, engine, qwen_tokenizer_path, openenv_user="no-such-user-rb",
                   openenv_command=[openenv_python, str(OPENENV_ENVS / "arith_drill.py"), "--port", "{port}"])
    assert nobody.status_code == 403 and "openenv_user" in nobody.text and "--agent-user" in nobody.text, nobody.text


def run_as_nobody(buffer: Server, engine: Server, qwen_tokenizer_path: str, server: list[str]) -> None:
    """A run whose server (`server`: its program and script) runs as `nobody`: seen as nobody's, its episode done."""
    answer = start(buffer, engine, qwen_tokenizer_path, openenv_user="nobody", openenv_resets=[{"seed": 6,
                                                                                                 "sleep_s": 1}],
                   openenv_command=[*server, "--port", "{port}"])
    assert answer.status_code == 200, answer.text
    assert buffer.proc is not None
    owners: set[str] = set()
    deadline = time.monotonic() + 120
    while not owners and time.monotonic() < deadline:  # the server the buffer started, while its episode runs
        # The program itself: the user-switching launcher before it (its arguments name the program too) is the
        # buffer's user until it execs the server.
        owners = {c.username() for c in psutil.Process(buffer.proc.pid).children() if c.cmdline()[:2] == server}
        time.sleep(0.1)
    assert owners == {"nobody"}
    status = wait_finished(buffer.url, timeout_s=300)
    assert status["run"]["progress"]["statuses"] == {"completed": 1}, status["run"]["progress"]
    drain(buffer.url)


def test_a_server_starts_only_programs_its_operator_allowed(openenv_python: str, engine: Server,
                                                             qwen_tokenizer_path: str, tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    with buffer_server(tmp_path, "--data-root", str(root), "--allow-code", str(root), trusting=False) as srv:
        outside = start(srv, engine, qwen_tokenizer_path,
                        openenv_command=[openenv_python, str(OPENENV_ENVS / "arith_drill.py"), "--port", "{port}"])
        assert outside.status_code == 403 and "openenv_command" in outside.text and "--allow-code" in outside.text
        installing = start(srv, engine, qwen_tokenizer_path, openenv_requirements=[OPENENV],
                           openenv_command=["{python}", str(OPENENV_ENVS / "arith_drill.py"), "--port", "{port}"])
        assert installing.status_code == 403 and "--allow-installs" in installing.text, installing.text
