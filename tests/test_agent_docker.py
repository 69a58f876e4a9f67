"""The docker sandbox against a real Docker engine: a stdlib agent in a container (no network but its session
through the agent socket, as `nobody`, in its scratch folder, output capped) trains through the buffer with
exact tokens; a sleeping agent's container is killed at the time limit and removed; a crash and an image
without python3 fail with their reasons; a missing image is refused at start.

Skips when no Docker engine answers (`docker info` fails), as in CI. The base image comes from
`docker/agent-sandbox/build.sh` (Debian packages, no Docker Hub), built here once if absent (skipped if it
cannot be); the test agent is added to it as a layer (`docker create` + `cp` + `commit`, no builder needed).
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from runs import drain, wait_finished
from servers import Server, free_port, running, sim_engine
from sessions import assert_engine_continues

REPO = Path(__file__).resolve().parents[1]
BUILD_SCRIPT = REPO / "docker" / "agent-sandbox" / "build.sh"
BASE_IMAGE = "rollout-buffer/agent-sandbox:bookworm"
TEST_IMAGES = "rollout-buffer/agent-sandbox-test"
STDLIB_AGENT = REPO / "tests" / "agents" / "stdlib_agent.py"
AGENT_IN_IMAGE = "/opt/agents/stdlib_agent.py"
LABEL = "rollout-buffer.agent"
SECRET = "ROLLOUT_TEST_SECRET"
TOKEN = "buffer-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PROMPT = "What is 12 * 7 + 3? Use the calculator."


def docker(*args: str, stdin: bytes | None = None, timeout_s: float = 60) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["docker", *args], input=stdin, capture_output=True, timeout=timeout_s)


def image_exists(tag: str) -> bool:
    return docker("image", "inspect", tag).returncode == 0


def leftover_containers() -> list[str]:
    listed = docker("ps", "-a", "--filter", f"label={LABEL}", "--format", "{{.Names}}")
    assert listed.returncode == 0, listed.stderr
    return listed.stdout.decode().split()


@pytest.fixture(scope="module")
def docker_engine() -> None:
    if shutil.which("docker") is None:
        pytest.skip("no docker CLI: the docker sandbox is tested only where a Docker engine runs")
    try:
        info = docker("info", timeout_s=20)
    except subprocess.TimeoutExpired:
        pytest.skip("no Docker engine: `docker info` did not answer within 20 s")
    if info.returncode != 0:
        pytest.skip(f"no Docker engine: `docker info` fails ({info.stderr.decode().strip()[-200:]})")


@pytest.fixture(scope="module")
def agent_image(docker_engine: None) -> str:
    """The base image (built once by the project's script if absent) plus the test agent at AGENT_IN_IMAGE,
    tagged by the agent's content."""
    if not image_exists(BASE_IMAGE):
        built = subprocess.run([str(BUILD_SCRIPT), BASE_IMAGE], capture_output=True, text=True, timeout=1200)
        if built.returncode != 0:
            pytest.skip(f"the agent sandbox image cannot be built here: {built.stderr.strip()[-300:]}")
    tag = f"{TEST_IMAGES}:{hashlib.sha256(STDLIB_AGENT.read_bytes()).hexdigest()[:12]}"
    if not image_exists(tag):
        name = f"rb-test-image-{os.getpid()}"
        assert docker("create", "--name", name, BASE_IMAGE, "true").returncode == 0
        try:
            copied = docker("cp", str(STDLIB_AGENT), f"{name}:{AGENT_IN_IMAGE}")
            if copied.returncode != 0:  # older engines want the folder to exist
                tar = io.BytesIO()
                with tarfile.open(fileobj=tar, mode="w") as t:
                    t.add(STDLIB_AGENT, arcname=AGENT_IN_IMAGE.lstrip("/"))
                copied = docker("cp", "-", f"{name}:/", stdin=tar.getvalue())
            assert copied.returncode == 0, copied.stderr
            assert docker("commit", name, tag).returncode == 0
        finally:
            docker("rm", "--force", name)
    return tag


@pytest.fixture(scope="module")
def no_python_image(docker_engine: None) -> str:
    """An image holding one text file: no python3 for the sandbox's forwarder."""
    tag = f"{TEST_IMAGES}:no-python"
    if not image_exists(tag):
        tar = io.BytesIO()
        with tarfile.open(fileobj=tar, mode="w") as t:
            data = b"no python here\n"
            info = tarfile.TarInfo("README")
            info.size = len(data)
            t.addfile(info, io.BytesIO(data))
        imported = docker("import", "-", tag, stdin=tar.getvalue())
        assert imported.returncode == 0, imported.stderr
    return tag


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with sim_engine(tmp_path_factory.mktemp("docker-sim"), qwen_tokenizer_path, "--latency-ms", "5") as srv:
        yield srv


@pytest.fixture(scope="module")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The buffer's data root for input files."""
    return tmp_path_factory.mktemp("docker-inputs")


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory, docker_engine: None, inputs: Path, qwen_tokenizer_path: str
           ) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("docker-buffer")
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp / "data"), "--auth-token", TOKEN,
            "--data-root", str(inputs), "--data-root", qwen_tokenizer_path]
    with running(args, "/healthz", port, tmp / "buffer.log", env={SECRET: "do-not-leak"}) as srv:
        yield srv


def start(buffer: Server, engine: Server, tokenizer: str, inputs: Path, items: list[dict[str, Any]],
          **payload: Any) -> httpx.Response:
    path = inputs / f"rows-{len(list(inputs.glob('rows-*')))}.jsonl"
    path.write_text("".join(json.dumps(i) + "\n" for i in items))
    body = {"task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": tokenizer, "max_tokens": 2048,
            "input_file": str(path), "num_repeat_per_sample": 1, "agent_sandbox": "docker", **payload}
    return httpx.post(f"{buffer.url}/start_rollout", json=body, timeout=60, headers=AUTH)


def stored(buffer: Server, run_id: str, instance: str) -> dict[str, Any]:
    return httpx.get(f"{buffer.url}/trajectories/{run_id}:{instance}:0:0", timeout=10, headers=AUTH).json()


def test_agents_in_containers_reach_only_their_session_and_are_killed_at_the_time_limit(
        buffer: Server, engine: Server, inputs: Path, qwen_tokenizer_path: str, agent_image: str) -> None:
    items = [{"instance_id": "ok", "prompt": PROMPT, "label": "87"},
             {"instance_id": "slow", "prompt": PROMPT, "label": "87", "mode": "sleep"},
             {"instance_id": "crash", "prompt": PROMPT, "label": "87", "mode": "crash"},
             # Its own prompt: the engine's answer to a repeated prefix would be the latest of either row's.
             {"instance_id": "chatty", "prompt": "What is 5 * 6 + 1? Use the calculator.", "label": "31",
              "mode": "chatty"}]
    started = start(buffer, engine, qwen_tokenizer_path, inputs, items, agent_command=[AGENT_IN_IMAGE],
                    agent_image=agent_image, agent_timeout_s=6, agent_max_output_bytes=65536,
                    agent_env={"PROBE_PORTS": f"{buffer.port},{engine.port}"})
    assert started.status_code == 200, started.text
    run_id = started.json()["run_id"]
    status = wait_finished(buffer.url, timeout_s=60, headers=AUTH)
    assert status["run"]["progress"]["failures"] == {"agent_timeout": 1, "agent_exited": 1}
    assert leftover_containers() == [], "every container is removed, the killed one too"

    delivered = {r["instance_id"]: r for r in drain(buffer.url, headers=AUTH) if r["status"] == "completed"}
    assert sorted(delivered) == ["chatty", "ok"]
    ok, chatty = delivered["ok"], delivered["chatty"]
    assert ok["status"] == "completed" and ok["raw_reward"] == 1.0 and ok["extra_info"]["scorer"] == "math"
    assert ok["extra_info"]["branch_turns"] == 2 and ok["extra_info"]["tool_calls"] == 1
    assert_engine_continues(engine, ok)
    agent = ok["extra_info"]["agent"]
    report = json.loads(next(line for line in agent["stderr_tail"].splitlines() if line.startswith("REPORT "))[7:])
    assert agent["exit_code"] == 0 and agent["network"] == "none"
    assert not Path(report["cwd"]).exists(), "the scratch folder (mounted at its own path) is removed"
    assert SECRET not in report["env"] and "OPENAI_BASE_URL" in report["env"]
    if os.geteuid() == 0:
        assert (agent["user"], report["uid"]) == ("nobody", 65534)
    # No network but loopback; on it only the forwarder to the agent socket, which serves nothing but the
    # session's own API and that only with the session's key. The engine's port is out of reach.
    assert report["interfaces"] == ["lo"] and report["reachable"] == [buffer.port]
    assert (report["buffer_status"], report["models_with_wrong_key"]) == (403, 401)

    # Output past agent_max_output_bytes is cut (its tail kept) and the agent still trains.
    assert chatty["extra_info"]["agent"]["output_truncated"] and not agent["output_truncated"]

    slow, crash = stored(buffer, run_id, "slow"), stored(buffer, run_id, "crash")
    assert slow["status"] == "failed" and slow["extra_info"]["error_kind"] == "agent_timeout"
    assert "agent_timeout_s=6" in slow["extra_info"]["error"]
    assert crash["status"] == "failed" and crash["extra_info"]["error_kind"] == "agent_exited"
    assert "exited with code 3" in crash["extra_info"]["error"] and "boom" in crash["extra_info"]["error"]


def test_images_that_cannot_run_agents_fail_with_the_reason(buffer: Server, engine: Server, inputs: Path,
                                                            qwen_tokenizer_path: str, no_python_image: str) -> None:
    row = [{"instance_id": "x", "prompt": PROMPT, "label": "87"}]
    absent = start(buffer, engine, qwen_tokenizer_path, inputs, row, agent_command=[AGENT_IN_IMAGE],
                   agent_image=f"{TEST_IMAGES}:absent")
    assert absent.status_code == 422 and "agent_image" in absent.json()["message"]
    assert "not on the Docker engine" in absent.json()["message"]
    host = start(buffer, engine, qwen_tokenizer_path, inputs, row, agent_command=[AGENT_IN_IMAGE],
                 agent_image=no_python_image, agent_network="host")
    assert host.status_code == 422 and "agent_network host" in host.json()["message"]

    started = start(buffer, engine, qwen_tokenizer_path, inputs, row, agent_command=[AGENT_IN_IMAGE],
                    agent_image=no_python_image)
    assert started.status_code == 200, started.text
    status = wait_finished(buffer.url, timeout_s=60, headers=AUTH)
    assert status["run"]["progress"]["failures"] == {"agent_sandbox": 1}
    failed = stored(buffer, started.json()["run_id"], "x")
    assert failed["status"] == "failed" and failed["extra_info"]["error_kind"] == "agent_sandbox"
    assert "cannot run python3" in failed["extra_info"]["error"] and no_python_image in failed["extra_info"]["error"]
    assert leftover_containers() == []
