"""Session workers on a Ray cluster of two nodes (`ray.cluster_utils.Cluster`: two raylets on this machine, each a
node of its own with its own id): a worker on each node, and the sessions of subprocess agents (`agent_command`)
running in a Ray actor pinned to one node (a custom resource only that node has) are served by the worker on that
node; a harness naming a node gets a session there."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import ray
from masks import spans
from ray.cluster_utils import Cluster
from ray_cluster import NAMESPACE, answering_right, buffer_on_ray, workers
from ray_cluster import SESSION_WORKERS_AUTH as AUTH
from runs import drain, wait_finished
from servers import Server
from sessions import assert_engine_tokens

from generators.agent.sandbox import namespaces_work


@pytest.fixture(scope="module")
def cluster() -> Iterator[dict[str, str]]:
    """Two nodes: the head (2 CPUs) and `b` (1 CPU and the resource `node_b`); the address and each node's id."""
    nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "include_dashboard": False})
    try:
        nodes.add_node(num_cpus=1, resources={"node_b": 1})
        ray.init(address=nodes.address, namespace=NAMESPACE, log_to_driver=False)
        nodes.wait_for_nodes()
        ids = {("b" if n["Resources"].get("node_b") else "head"): n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert set(ids) == {"head", "b"}, ray.nodes()
        yield {"address": nodes.address, **ids}
    finally:
        ray.shutdown()
        nodes.shutdown()
        # Its head advertised itself to every `ray.init()` on this machine: no longer.
        advert = Path(os.environ.get("RAY_TMPDIR", tempfile.gettempdir())) / "ray" / "ray_current_cluster"
        with contextlib.suppress(OSError):
            if advert.read_text().strip() == nodes.address:
                advert.unlink()


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with answering_right(tmp_path_factory, qwen_tokenizer_path) as srv:
        yield srv


@pytest.fixture(scope="module")
def buffer(tmp_path_factory: pytest.TempPathFactory, cluster: dict[str, str]) -> Iterator[Server]:
    with buffer_on_ray(tmp_path_factory.mktemp("ray-nodes"), cluster["address"]).start(timeout_s=120) as srv:
        yield srv


def test_sessions_go_to_the_worker_on_the_node_of_their_agent(
        buffer: Server, cluster: dict[str, str], engine: Server, qwen_tokenizer_path: str,
        readable_agents: Path, tmp_path: Path) -> None:
    placed = workers(buffer)
    assert all(w["up"] for w in placed) and sorted(w["node_id"] for w in placed) == sorted(
        [cluster["head"], cluster["b"]]), placed  # one worker on each node (the workers' actors are spread)
    on_b = next(w["worker"] for w in placed if w["node_id"] == cluster["b"])

    # Subprocess agents (`agent_command`) in one actor that only node b can host (ray_resources): every session on
    # b's worker, though the other worker holds fewer.
    rows = tmp_path / "tasks.jsonl"
    rows.write_text("".join(json.dumps({"instance_id": f"node-{i}", "prompt": "What is 12 * 7 + 3? Use the "
                                        "calculator.", "label": "87"}) + "\n" for i in range(3)))
    started = httpx.post(f"{buffer.url}/start_rollout", headers=AUTH, timeout=60, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path,
        "input_file": str(rows), "agent_command": [str(readable_agents / "stdlib_agent.py")],
        "num_repeat_per_sample": 2,
        "max_tokens": 2048, "ray_actors": 1, "ray_num_cpus": 0.5, "ray_resources": {"node_b": 0.5}})
    assert started.status_code == 200, started.text
    status = wait_finished(buffer.url, headers=AUTH, timeout_s=180)
    assert status["run"]["progress"]["failed"] == 0, status["run"]["progress"]
    served = {w["worker"]: w["served"] for w in workers(buffer)}
    assert served[on_b] == 6 and sum(served.values()) == 6, served
    records = drain(buffer.url, headers=AUTH)
    assert len(records) == 6
    for r in records:
        info = r["extra_info"]
        assert r["status"] == "completed" and info["tool_calls"] == 1 and len(spans(r["loss_mask"])) == 2
        if namespaces_work():  # sandboxed without a network, through the agent socket of b's worker
            assert info["agent"]["network"] == "isolated", info["agent"]
        assert_engine_tokens(engine, r)

    # A harness that names its node (by Ray id) gets a session there; one naming no node of the cluster, the least
    # loaded worker.
    started = httpx.post(f"{buffer.url}/start_rollout", headers=AUTH, timeout=60, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path})
    assert started.status_code == 200, started.text
    for near, expected in ((cluster["b"], on_b), (cluster["b"], on_b), (cluster["head"], 1 - on_b),
                           ("10.9.9.9", 1 - on_b)):
        opened = httpx.post(f"{buffer.url}/sessions", json={"instance_id": "near", "node": near}, headers=AUTH,
                            timeout=60)
        assert opened.status_code == 200 and opened.json()["worker"] == expected, (near, opened.text)
