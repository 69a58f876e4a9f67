"""`serve --executor ray --session-workers 2`: session workers on a local Ray cluster (`ray.init(num_cpus=2)` in
this process), each started on its node by a Ray actor; the buffer a real `rollout-buffer serve` subprocess that
joins the cluster, the engine the simulated one, the tokenizer the real Qwen3 one.

Harness sessions across the two workers with exact tokens and whole groups; a worker process killed with SIGKILL
comes back through its actor at the same URL with its sessions; a lost actor is replaced at another address and
the sessions it held are recorded failed with the reason; agent runs and environments (verifiers, OpenEnv) in the
Ray actors with their sessions on the workers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import psutil
import pytest
import ray
from agent_files import AGENTS
from environment_venvs import OPENENV_ENVS, VERIFIERS_ENVS
from masks import spans
from ray_cluster import NAMESPACE, SESSION_WORKERS_TOKEN, answering_right, buffer_on_ray, workers
from ray_cluster import SESSION_WORKERS_AUTH as AUTH
from runs import drain, wait_finished
from servers import Server, free_port, free_ports
from sessions import assert_engine_tokens


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with answering_right(tmp_path_factory, qwen_tokenizer_path) as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory, ray_address: str) -> Iterator[Server]:
    with buffer_on_ray(tmp_path_factory.mktemp("ray-workers"), ray_address).start(timeout_s=120) as srv:
        yield srv


def open_session(srv: Server, instance_id: str, **hints: str) -> dict[str, Any]:
    answer = httpx.post(f"{srv.url}/sessions", json={"instance_id": instance_id, **hints}, headers=AUTH, timeout=120)
    assert answer.status_code == 200, answer.text
    opened: dict[str, Any] = answer.json()
    return opened


def finish(srv: Server, session: dict[str, Any]) -> dict[str, Any]:
    answer = httpx.post(f"{srv.url}/sessions/{session['session_id']}/finish", json={"reward": 1.0}, headers=AUTH,
                        timeout=120)
    assert answer.status_code == 200, answer.text
    done: dict[str, Any] = answer.json()
    return done


def wait_until(check: Any, timeout_s: float = 90.0) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if got := check():
            return got
        time.sleep(0.2)
    raise TimeoutError("the condition did not hold in time")


def client(session: dict[str, Any], retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=session["base_url"], api_key=session["api_key"], max_retries=retries)


def test_sessions_on_ray_workers_survive_a_killed_worker_and_report_a_lost_actor(
        buffer: Server, engine: Server, qwen_tokenizer_path: str) -> None:
    started = httpx.post(f"{buffer.url}/start_rollout", headers=AUTH, timeout=60, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
        "num_repeat_per_sample": 2, "max_tokens": 2048})
    assert started.status_code == 200, started.text
    first = open_session(buffer, "ray-0", node=ray.get_runtime_context().get_node_id())
    second = open_session(buffer, "ray-0")
    assert {first["worker"], second["worker"]} == {0, 1}
    placed = workers(buffer)
    assert all(w["node"] == "127.0.0.1" and w["up"] for w in placed), placed
    # Each worker says which Ray node it is on; a harness may name its node (address or Ray id) to be placed there.
    assert {w["node_id"] for w in placed} == {ray.get_runtime_context().get_node_id()}
    assert first["node"] == "127.0.0.1"
    refused = httpx.post(f"{buffer.url}/sessions", json={"instance_id": "x", "node": ""}, headers=AUTH, timeout=60)
    assert refused.status_code == 422 and "node" in refused.json()["message"], refused.text
    assert {s["base_url"].split("/sessions/")[0] for s in (first, second)} == {w["url"] for w in placed}

    # One turn each; then the first session's worker process is killed while its second turn is in flight.
    histories = []
    for session in (first, second):
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 2 + 3?"}]
        reply = client(session).chat.completions.create(model="m", messages=messages).choices[0].message.content
        histories.append([*messages, {"role": "assistant", "content": reply}, {"role": "user", "content": "And 4?"}])
    victim = placed[first["worker"]]
    answers: list[Any] = []
    turn = threading.Thread(target=lambda: answers.append(
        client(first, retries=12).chat.completions.create(model="m", messages=histories[0])))
    turn.start()
    os.kill(victim["pid"], signal.SIGKILL)
    turn.join(180)
    assert answers and answers[0].choices[0].finish_reason == "stop", "the retry at the same URL succeeded"
    again = workers(buffer)[first["worker"]]
    assert again["restarts"] == 1 and again["url"] == victim["url"] and again["pid"] != victim["pid"]
    assert client(second).chat.completions.create(model="m", messages=histories[1]).choices[0].finish_reason == "stop"
    records = [finish(buffer, s) for s in (first, second)]
    delivered = drain(buffer.url, headers=AUTH)
    assert sorted(r["uid"] for r in delivered) == sorted(u for r in records for u in r["uids"])
    for r in delivered:
        assert len(spans(r["loss_mask"])) == 2
        assert_engine_tokens(engine, r)

    # The actor itself lost: a new actor starts the worker at another address; the session it held is recorded
    # failed with the reason (agents hold the old URL), and new sessions go to the new address.
    held = open_session(buffer, "ray-1")
    client(held).chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 1 + 1?"}])
    before = workers(buffer)[held["worker"]]
    actor = ray.get_actor(f"session-worker-{buffer.proc.pid}-{held['worker']}", namespace=NAMESPACE)
    ray.kill(actor)
    moved = wait_until(lambda: (w := workers(buffer)[held["worker"]])["up"] and w["url"] != before["url"] and w)
    assert moved["restarts"] == before["restarts"] + 1
    failed = httpx.get(f"{buffer.url}/trajectories/{held['uid']}", headers=AUTH, timeout=10).json()
    assert failed["status"] == "failed" and "at another address" in failed["extra_info"]["error"]
    fresh = [open_session(buffer, f"ray-2-{i}") for i in range(2)]
    assert moved["url"] in {s["base_url"].split("/sessions/")[0] for s in fresh}
    for session in fresh:
        client(session).chat.completions.create(model="m", messages=[{"role": "user", "content": "What is 3 + 3?"}])
        finish(buffer, session)
    progress = httpx.get(f"{buffer.url}/status", headers=AUTH, timeout=10).json()["run"]["progress"]
    assert progress["in_flight"] == 0 and progress["done"] == 4 and progress["failed"] == 1


def test_keys_and_tokens_are_in_no_workers_command_line(buffer: Server) -> None:
    for w in workers(buffer):
        cmdline = Path(f"/proc/{w['pid']}/cmdline").read_bytes().decode()
        assert "session-worker" in cmdline and SESSION_WORKERS_TOKEN not in cmdline and "SECRET" not in cmdline


def test_an_agent_run_on_ray_actors_has_its_sessions_on_the_workers(
        buffer: Server, engine: Server, qwen_tokenizer_path: str, tmp_path: Path) -> None:
    """The trajectories run in the `ray` executor's actors; the sessions their agents talk to are on the session
    workers (the actors open, read and close them through the buffer)."""
    rows = tmp_path / "tasks.jsonl"
    rows.write_text("".join(json.dumps({"instance_id": f"ray-agent-{i}", "prompt": "What is 12 * 7 + 3? Use the "
                                        "calculator.", "label": "87"}) + "\n" for i in range(2)))
    served = [w["served"] for w in workers(buffer)]
    started = httpx.post(f"{buffer.url}/start_rollout", headers=AUTH, timeout=60, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
        "input_file": str(rows), "agent": f"{AGENTS / 'openai_agent.py'}:agent", "num_repeat_per_sample": 2,
        "max_tokens": 2048, "ray_actors": 1})
    assert started.status_code == 200, started.text
    status = wait_finished(buffer.url, headers=AUTH, timeout_s=180)
    assert status["run"]["progress"]["failed"] == 0, status["run"]["progress"]
    assert status["executor"]["kind"] == "ray"
    assert [w["served"] - before for w, before in zip(workers(buffer), served, strict=True)] == [2, 2]
    records = drain(buffer.url, headers=AUTH)
    assert sorted(r["instance_id"] for r in records) == ["ray-agent-0", "ray-agent-0", "ray-agent-1", "ray-agent-1"]
    for r in records:
        assert r["status"] == "completed" and r["extra_info"]["tool_calls"] == 1 and len(spans(r["loss_mask"])) == 2
        assert_engine_tokens(engine, r)


def test_workers_the_cluster_cannot_place_are_a_clear_error_not_a_hang(
        tmp_path: Path, ray_address: str, engine: Server, qwen_tokenizer_path: str) -> None:
    port = free_port()
    srv = Server(["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--executor", "ray",
                  "--ray-address", ray_address, "--session-workers", "1", "--session-worker-cpus", "64",
                  "--session-worker-port", str(free_ports(1))],
                 "/healthz", port, tmp_path / "buffer.log", env={"ROLLOUT_BUFFER_AUTH_TOKEN": SESSION_WORKERS_TOKEN})
    with srv.start(timeout_s=120):
        assert [w["up"] for w in workers(srv)] == [False]
        assert "--session-worker-cpus 64: no node of the Ray cluster has that many CPUs" in srv.log()
        started = httpx.post(f"{srv.url}/start_rollout", headers=AUTH, timeout=60, json={
            "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path})
        assert started.status_code == 200, started.text
        refused = httpx.post(f"{srv.url}/sessions", json={"instance_id": "x"}, headers=AUTH, timeout=60)
        assert refused.status_code == 503 and "no session worker is up (worker 0 did not start: " \
            "--session-worker-cpus 64: no node of the Ray cluster has that many CPUs" in refused.json()["message"]


def assert_ran_in_an_actor(buffer: Server, program: str, served: list[int]) -> None:
    """Wait for the run's end: its two episodes completed, their sessions served by the workers (`served`: their
    counts before), and the environment's processes (`program` in their command line) started under a Ray actor,
    not the buffer."""
    parents: set[str] = set()  # what started the environment's processes, seen while the run runs

    def finished() -> dict[str, Any] | None:
        # This test's processes only (its Ray cluster and its buffer descend from it; other tests' do not).
        for proc in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                if program in " ".join(proc.cmdline()):
                    parents.update(" ".join(p.cmdline()) for p in proc.parents())
        run = httpx.get(f"{buffer.url}/status", headers=AUTH, timeout=10).json()["run"]
        return run if run["state"] in ("finished", "failed") else None

    run = wait_until(finished, 300)
    assert run["progress"]["statuses"] == {"completed": 2}, run["progress"]
    assert sum(w["served"] for w in workers(buffer)) - sum(served) == 2
    assert any("TrajectoryWorker" in p for p in parents), parents  # Ray's name for the actor's process
    assert not any("rollout_buffer serve" in p for p in parents), "not the buffer's"


def test_an_environments_workers_run_in_the_ray_actors(
        buffer: Server, engine: Server, qwen_tokenizer_path: str, verifiers_python: str) -> None:
    """verifiers' tool-using environment with `--executor ray`: its worker processes run under the Ray actor that
    runs the episodes (not the buffer), the episodes' sessions on the session workers."""
    served = [w["served"] for w in workers(buffer)]
    started = httpx.post(f"{buffer.url}/start_rollout", headers=AUTH, timeout=600, json={
        "task_type": "verifiers", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
        "env_python": verifiers_python, "env_id": "rb_shell", "env_paths": [str(VERIFIERS_ENVS)],
        "num_repeat_per_sample": 1, "max_tokens": 4096, "ray_actors": 1})
    assert started.status_code == 200, started.text
    assert_ran_in_an_actor(buffer, "verifiers_worker.py", served)
    for rec in drain(buffer.url, headers=AUTH):
        trained = spans(rec["loss_mask"])
        assert len(trained) == 2 and rec["status"] == "completed"
        assert_engine_tokens(engine, rec)


def test_an_openenv_runs_servers_in_the_ray_actors(
        buffer: Server, engine: Server, qwen_tokenizer_path: str, openenv_python: str) -> None:
    """OpenEnv with `--executor ray`: the servers `openenv_command` starts run under the actor that runs the
    episodes (not the buffer), the episodes' sessions on the session workers."""
    served = [w["served"] for w in workers(buffer)]
    started = httpx.post(f"{buffer.url}/start_rollout", headers=AUTH, timeout=600, json={
        "task_type": "openenv", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
        "num_repeat_per_sample": 1, "max_tokens": 4096, "openenv_resets": [{"seed": 1}, {"seed": 2}],
        "openenv_command": [openenv_python, str(OPENENV_ENVS / "arith_drill.py"), "--port", "{port}"],
        "ray_actors": 1})
    assert started.status_code == 200, started.text
    assert_ran_in_an_actor(buffer, "arith_drill.py", served)
    for rec in drain(buffer.url, headers=AUTH):
        info = rec["extra_info"]["openenv"]
        assert info["steps"] == 3 and info["done"] and rec["raw_reward"] == sum(info["step_rewards"])
        assert len(spans(rec["loss_mask"])) == 3
        assert_engine_tokens(engine, rec)
