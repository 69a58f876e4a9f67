"""Task type `agent` end to end: the example agents (plain `openai`, the OpenAI Agents SDK) train through the
buffer as callables; subprocess agents run sandboxed (network, user, scratch folder, time limit, crash); a
harness run groups by `--group-size` and expires idle sessions; the start payload is checked."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import openai
import orjson
import psutil
import pytest
from agent_files import AGENTS, STDLIB_AGENT
from runs import drain, wait_finished
from servers import Server, free_port, running, sim_engine

from generators.agent.sandbox import namespaces_work
from rollout_buffer.tools.demo import bundled_dataset

REPO = Path(__file__).resolve().parents[1]
SECRET = "ROLLOUT_TEST_SECRET"
TOKEN = "buffer-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("agent-sim"), qwen_tokenizer_path, "--latency-ms", "5") as srv:
        yield srv


@pytest.fixture(scope="module")
def roots(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A data root for the tests' input files (the repository and the tokenizer are roots too)."""
    return tmp_path_factory.mktemp("agent-inputs")


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory, roots: Path, qwen_tokenizer_path: str,
           stdlib_agent: Path) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("agent-buffer")
    port = free_port()
    # What the operator allows the tests' runs, no more: their inputs, the agents they run, their hook, PROBE_PORTS.
    args = ["serve", "--port", str(port), "--data-dir", str(tmp / "data"), "--group-size", "2", "--auth-token", TOKEN,
            "--data-root", str(roots), "--allow-code", str(AGENTS), "--allow-code", str(stdlib_agent.parent),
            "--allow-code", str(roots / "score_hook.py"), "--allow-env", "PROBE_PORTS"]
    with running(args, "/healthz", port, tmp / "buffer.log", env={SECRET: "do-not-leak"}, trusting=False) as srv:
        yield srv


def rows(roots: Path, name: str, items: list[dict[str, Any]]) -> str:
    path = roots / f"{name}.jsonl"
    path.write_bytes(b"\n".join(orjson.dumps(i) for i in items) + b"\n")
    return str(path)


def start(buffer: Server, engine: Server, tokenizer: str, **payload: Any) -> httpx.Response:
    body = {"task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": tokenizer, "max_tokens": 2048,
            **payload}
    return httpx.post(f"{buffer.url}/start_rollout", json=body, timeout=60, headers=AUTH)


def calculator_rows(n: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in bundled_dataset("tool_call").read_text().splitlines()[:n]]


@pytest.mark.parametrize("agent", ["openai_agent.py", "agents_sdk_agent.py"])
def test_example_agents_train_through_the_buffer(buffer: Server, engine: Server, roots: Path,
                                                 qwen_tokenizer_path: str, agent: str) -> None:
    input_file = rows(roots, agent, calculator_rows(3))
    started = start(buffer, engine, qwen_tokenizer_path, input_file=input_file, agent=f"{AGENTS / agent}:agent",
                    num_repeat_per_sample=2, num_process=6)
    assert started.status_code == 200, started.text
    status = wait_finished(buffer.url, timeout_s=120, headers=AUTH)
    assert status["run"]["progress"]["failed"] == 0, status["run"]["progress"]
    records = drain(buffer.url, headers=AUTH)
    assert len(records) == 6 and {r["instance_id"] for r in records} == {"calc-000", "calc-001", "calc-002"}
    for r in records:
        info = r["extra_info"]
        assert r["status"] == "completed" and info["scorer"] == "math" and info["label"]
        assert info["branch_turns"] == 2 and info["tool_calls"] == 1 and info["protocols"] == ["openai"]
        assert r["raw_reward"] in (0.0, 1.0) and len(r["rollout_log_probs"]) == r["response_length"]
        assert "\\boxed{" in info["answer"]
    assert any(r["raw_reward"] == 1.0 for r in records)


def test_subprocess_agents_run_sandboxed_with_a_time_limit(buffer: Server, engine: Server, roots: Path,
                                                           qwen_tokenizer_path: str, stdlib_agent: Path) -> None:
    prompt = "What is 12 * 7 + 3? Use the calculator."
    items = [{"instance_id": "ok", "prompt": prompt, "label": "87"},
             {"instance_id": "slow", "prompt": prompt, "label": "87", "mode": "sleep"},
             {"instance_id": "crash", "prompt": prompt, "label": "87", "mode": "crash"}]
    started = start(buffer, engine, qwen_tokenizer_path, input_file=rows(roots, "sandbox", items),
                    agent_command=[str(stdlib_agent)], agent_timeout_s=15, num_repeat_per_sample=1,
                    agent_env={"PROBE_PORTS": f"{buffer.port},{engine.port}"})
    assert started.status_code == 200, started.text
    run_id = started.json()["run_id"]
    status = wait_finished(buffer.url, timeout_s=60, headers=AUTH)
    assert status["run"]["progress"]["failures"] == {"agent_timeout": 1, "agent_exited": 1}

    def stored(instance: str) -> dict[str, Any]:
        return httpx.get(f"{buffer.url}/trajectories/{run_id}:{instance}:0:0", timeout=10, headers=AUTH).json()

    ok = stored("ok")
    assert ok["status"] == "completed" and ok["raw_reward"] == 1.0 and ok["extra_info"]["scorer"] == "math"
    agent = ok["extra_info"]["agent"]
    report = json.loads(next(line for line in agent["stderr_tail"].splitlines() if line.startswith("REPORT "))[7:])
    assert agent["exit_code"] == 0 and not Path(report["cwd"]).exists(), "the scratch folder is removed"
    assert SECRET not in report["env"] and "OPENAI_BASE_URL" in report["env"]
    if os.geteuid() == 0:
        assert (agent["user"], report["uid"]) == ("nobody", 65534)
    if namespaces_work():
        # Its own session only: the engine is unreachable, and the buffer's port (the forwarder to the agent
        # socket) answers nothing but session endpoints, and those only with the session's key.
        assert agent["network"] == "isolated" and report["reachable"] == [buffer.port]
        assert (report["buffer_status"], report["models_with_wrong_key"]) == (403, 401)
    slow, crash = stored("slow"), stored("crash")
    assert slow["status"] == "failed" and slow["extra_info"]["error_kind"] == "agent_timeout"
    assert "agent_timeout_s=15" in slow["extra_info"]["error"]
    assert crash["status"] == "failed" and crash["extra_info"]["error_kind"] == "agent_exited"
    assert "exited with code 3" in crash["extra_info"]["error"] and "boom" in crash["extra_info"]["error"]
    assert crash["extra_info"]["agent"]["exit_code"] == 3 and "boom" in crash["extra_info"]["agent"]["stderr_tail"]
    assert slow["extra_info"]["agent"]["exit_code"] is None, "the failed record keeps what the process said"


def test_a_harness_run_groups_by_group_size_and_expires_idle_sessions(buffer: Server, engine: Server,
                                                                      qwen_tokenizer_path: str) -> None:
    started = start(buffer, engine, qwen_tokenizer_path, session_ttl_s=1.0)
    assert started.status_code == 200, started.text
    status = httpx.get(f"{buffer.url}/status", timeout=10, headers=AUTH).json()
    assert status["run"]["num_repeat_per_sample"] == 2  # --group-size, since the payload named none
    drain(buffer.url, wait_s=0.1, headers=AUTH)

    def one_turn(instance: str) -> dict[str, Any]:
        opened = httpx.post(f"{buffer.url}/sessions", json={"instance_id": instance}, timeout=60, headers=AUTH).json()
        openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "What is 3 + 4?"}])
        return opened

    # With --auth-token, managing sessions needs the server's token; a session's API needs its own key.
    assert httpx.post(f"{buffer.url}/sessions", json={"instance_id": "x"}, timeout=10).status_code == 401

    finished = [one_turn("h") for _ in range(2)]
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=finished[0]["base_url"], api_key="wrong", max_retries=0).models.list()
    counted = anthropic.Anthropic(base_url=finished[0]["anthropic_base_url"], api_key=finished[0]["api_key"],
                                  max_retries=0).messages.count_tokens(model="m", messages=[{"role": "user",
                                                                                             "content": "Hi."}])
    assert counted.input_tokens > 0  # the Anthropic client sends the key as x-api-key
    for s in finished:
        done = httpx.post(f"{buffer.url}/sessions/{s['session_id']}/finish", json={"reward": 1.0}, headers=AUTH)
        assert done.status_code == 200
    assert [r["instance_id"] for r in drain(buffer.url, headers=AUTH)] == ["h", "h"]

    idle = one_turn("idle")
    for _ in range(100):
        if httpx.get(f"{buffer.url}/sessions/{idle['session_id']}", timeout=10, headers=AUTH).json()["state"] != "open":
            break
        time.sleep(0.1)
    closed = httpx.get(f"{buffer.url}/sessions/{idle['session_id']}", timeout=10, headers=AUTH).json()
    assert closed["state"] == "expired" and [b["turns"] for b in closed["branches"]] == [1]
    uid = closed["uid"]
    record = httpx.get(f"{buffer.url}/trajectories/{uid}", timeout=10, headers=AUTH).json()
    assert record["status"] == "failed" and "session_ttl_s=1" in record["extra_info"]["error"]
    with pytest.raises(openai.NotFoundError):
        openai.OpenAI(base_url=idle["base_url"], api_key=idle["api_key"], max_retries=0).chat.completions.create(
            model="m", messages=[{"role": "user", "content": "Still there?"}])
    late = httpx.post(f"{buffer.url}/sessions/{idle['session_id']}/finish", json={"reward": 1.0}, timeout=10,
                      headers=AUTH)
    assert late.status_code == 409 and "expired" in late.json()["message"]


def test_the_start_payload_of_agent_runs_is_checked(buffer: Server, engine: Server, roots: Path,
                                                    qwen_tokenizer_path: str, tmp_path: Path) -> None:
    def refused(status: int = 422, **payload: Any) -> str:
        answer = start(buffer, engine, qwen_tokenizer_path, **payload)
        assert answer.status_code == status, answer.text
        return answer.json()["message"]

    outside = tmp_path / "agent.py"
    outside.write_text("def agent(item, base_url, api_key):\n    return 1.0\n")
    input_file = rows(roots, "checks", calculator_rows(1))
    math = httpx.post(f"{buffer.url}/start_rollout", json={"task_type": "math"}, timeout=10, headers=AUTH)
    assert math.status_code == 422 and "input_file: required" in math.json()["message"]
    assert "not both" in refused(input_file=input_file, agent=f"{AGENTS}/openai_agent.py:agent",
                                 agent_command=["x"])
    assert "--allow-code" in refused(403, input_file=input_file, agent=f"{outside}:agent")
    assert "--allow-module json" in refused(403, input_file=input_file, agent="json:loads")
    assert "agent_command" in refused(403, input_file=input_file,
                                      agent_command=["/usr/bin/python3", str(STDLIB_AGENT)])
    assert "input_file: required" in refused(agent=f"{AGENTS}/openai_agent.py:agent")
    no_tokenizer = httpx.post(f"{buffer.url}/start_rollout", timeout=10, json={"task_type": "agent"}, headers=AUTH)
    assert no_tokenizer.status_code == 422 and "tokenizer_path" in no_tokenizer.json()["message"]
    # A session still open when its run is replaced is closed as failed, with its branch stored.
    assert start(buffer, engine, qwen_tokenizer_path).status_code == 200
    opened = httpx.post(f"{buffer.url}/sessions", json={"instance_id": "left-open"}, timeout=60, headers=AUTH).json()
    openai.OpenAI(base_url=opened["base_url"], api_key=opened["api_key"], max_retries=0).chat.completions.create(
        model="m", messages=[{"role": "user", "content": "What is 1 + 1?"}])
    math_run = httpx.post(f"{buffer.url}/start_rollout", timeout=30, headers=AUTH, json={
        "task_type": "math", "input_file": input_file, "num_repeat_per_sample": 1, "remote_engine_url": engine.url})
    assert math_run.status_code == 200, math_run.text
    not_agent = httpx.post(f"{buffer.url}/sessions", json={"instance_id": "x"}, timeout=10, headers=AUTH)
    assert not_agent.status_code == 409 and "run_id" in not_agent.json()["message"]
    left = httpx.get(f"{buffer.url}/sessions/{opened['session_id']}", timeout=10, headers=AUTH).json()
    record = httpx.get(f"{buffer.url}/trajectories/{left['uid']}", timeout=10, headers=AUTH).json()
    assert left["state"] == "failed" and record["status"] == "failed" and "ended" in record["extra_info"]["error"]


def test_an_agent_that_exits_before_reading_its_row_is_recorded_with_its_exit(
        buffer: Server, engine: Server, roots: Path, qwen_tokenizer_path: str, stdlib_agent: Path) -> None:
    # A row larger than a pipe's buffer: writing it to an agent that is gone fails, which is the agent's exit.
    items = [{"instance_id": "early", "prompt": "x" * 200_000, "label": "1"}]
    started = start(buffer, engine, qwen_tokenizer_path, input_file=rows(roots, "early", items),
                    agent_command=[str(stdlib_agent.with_name("early_exit.sh"))], num_repeat_per_sample=1)
    assert started.status_code == 200, started.text
    status = wait_finished(buffer.url, timeout_s=60, headers=AUTH)
    assert status["run"]["progress"]["failures"] == {"agent_exited": 1}, status["run"]["progress"]
    run_id = started.json()["run_id"]
    record = httpx.get(f"{buffer.url}/trajectories/{run_id}:early:0:0", timeout=10, headers=AUTH).json()
    agent = record["extra_info"]["agent"]
    assert record["extra_info"]["error_kind"] == "agent_exited" and agent["exit_code"] == 7, record["extra_info"]
    assert "cannot start (no such model)" in agent["stderr_tail"]


def test_a_scorer_hook_sees_the_row_the_workdir_and_the_transcript(buffer: Server, engine: Server, roots: Path,
                                                                  qwen_tokenizer_path: str) -> None:
    hook = roots / "score_hook.py"
    hook.write_text(
        "import os\n\n"
        "def score(item, workdir, transcript):\n"
        "    assert os.path.isfile(os.path.join(workdir, 'item.json'))\n"
        "    assert transcript['messages'][-1]['role'] == 'assistant' and transcript['exit_code'] is None\n"
        "    return 0.25 if item['label'] in transcript['answer'] else -1.0\n")
    started = start(buffer, engine, qwen_tokenizer_path, input_file=rows(roots, "hooked", calculator_rows(1)),
                    agent=f"{AGENTS / 'openai_agent.py'}:agent", scorer=f"{hook}:score", num_repeat_per_sample=1)
    assert started.status_code == 200, started.text
    wait_finished(buffer.url, timeout_s=60, headers=AUTH)
    run_id = started.json()["run_id"]
    record = httpx.get(f"{buffer.url}/trajectories/{run_id}:calc-000:0:0", timeout=10, headers=AUTH).json()
    assert record["status"] == "completed" and record["extra_info"]["scorer"] == f"{hook}:score"
    assert record["raw_reward"] in (0.25, -1.0)


@pytest.mark.parametrize("network", ["host", "isolated"])
def test_agents_die_with_a_buffer_killed_by_sigkill(tmp_path: Path, engine: Server, roots: Path,
                                                    qwen_tokenizer_path: str, stdlib_agent: Path, network: str) -> None:
    """A crashed buffer leaves no agent running (its session is gone with it): the agents share its fate."""
    if network == "isolated" and not namespaces_work():
        pytest.skip("unshare cannot create namespaces here")
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--group-size", "2",
            "--agent-network", "host"]
    srv = Server(args, "/healthz", port, tmp_path / "buffer.log").start()
    try:
        prompt = "What is 12 * 7 + 3? Use the calculator."
        items = [{"instance_id": f"slow{i}", "prompt": prompt, "label": "87", "mode": "sleep"} for i in range(2)]
        body = {"task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
                "input_file": rows(roots, f"fate-{network}", items), "agent_command": [str(stdlib_agent)],
                "agent_network": network, "num_repeat_per_sample": 1}
        started = httpx.post(f"{srv.url}/start_rollout", json=body, timeout=60)
        assert started.status_code == 200, started.text

        def agents() -> list[psutil.Process]:
            found = []
            for p in psutil.process_iter(["cmdline"]):
                if str(stdlib_agent) in (p.info["cmdline"] or []):
                    found.append(p)
            return found

        deadline = time.monotonic() + 30
        while len(agents()) < 2:
            assert time.monotonic() < deadline, f"the agents did not start; log:\n{srv.log()[-2000:]}"
            time.sleep(0.1)
        if network == "host" and os.geteuid() == 0:  # the user switch without subprocess's own (uvloop lacks it)
            assert {p.uids().real for p in agents()} == {65534}
        srv.kill9()
        deadline = time.monotonic() + 10
        while left := [p for p in agents() if p.status() != psutil.STATUS_ZOMBIE]:
            assert time.monotonic() < deadline, f"agents outlived the buffer: {[p.cmdline() for p in left]}"
            time.sleep(0.1)
    finally:
        srv.stop()
