"""The tests' Ray: a local cluster of the test module's own, the simulated engine the Ray tests compare runs on, the
test agents where Ray's actors (running them as `nobody`) can read them, and a buffer whose session workers run on
the cluster."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from readable import readable_copies
from servers import Server, free_port, free_ports, sim_engine

NAMESPACE = "rollout_buffer"
TEST_AGENTS = Path(__file__).resolve().parent / "agents"
SESSION_WORKERS_TOKEN = "ray-workers-token"
SESSION_WORKERS_AUTH = {"Authorization": f"Bearer {SESSION_WORKERS_TOKEN}"}


@pytest.fixture(scope="module")
def ray_address() -> Iterator[str]:
    import ray

    # "local": a cluster of its own, never one another test (or a buffer's head) advertised in /tmp/ray.
    info = ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False, namespace=NAMESPACE,
                    _node_ip_address="127.0.0.1")  # tests reach servers on loopback only
    try:
        yield info.address_info["gcs_address"]
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def readable_agents() -> Iterator[Path]:
    """The test agents in a folder anyone may read: subprocess agents run as `nobody` under root."""
    with readable_copies(TEST_AGENTS.glob("*.py"), "rb-ray-agents-") as folder:
        yield folder


@contextlib.contextmanager
def answering_right(tmp_path_factory: pytest.TempPathFactory, tokenizer_path: str) -> Iterator[Server]:
    """A simulated engine whose every answer is right: replies depend on the prompt only, so two runs can be
    compared record by record."""
    with sim_engine(tmp_path_factory.mktemp("sim"), tokenizer_path, "--correct-rate", "1",
                    "--latency-ms", "20") as srv:
        yield srv


def buffer_on_ray(folder: Path, address: str) -> Server:
    """`serve --executor ray --session-workers 2` joined to the Ray cluster at `address` (workers reserve no CPU)."""
    port = free_port()
    return Server(["serve", "--port", str(port), "--data-dir", str(folder / "data"), "--executor", "ray",
                   "--ray-address", address, "--session-workers", "2", "--session-worker-cpus", "0",
                   "--session-worker-port", str(free_ports(2))],
                  "/healthz", port, folder / "buffer.log", env={"ROLLOUT_BUFFER_AUTH_TOKEN": SESSION_WORKERS_TOKEN})


def workers(srv: Server) -> list[dict[str, Any]]:
    """The buffer's session workers as /status lists them."""
    found: list[dict[str, Any]] = httpx.get(f"{srv.url}/status", headers=SESSION_WORKERS_AUTH,
                                            timeout=10).json()["session_workers"]
    return found
