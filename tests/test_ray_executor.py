"""`serve --executor ray`: trajectories in Ray actors, everything else as with the local executor.

One local Ray cluster per module (`ray.init(num_cpus=2)` in this process); the buffers are real `rollout-buffer
serve` subprocesses that join it with `--ray-address`, the engine is the simulated SGLang engine, the tokenizer
the real Qwen3 one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import signal
import sqlite3
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil
import pytest
import ray
from ray_cluster import NAMESPACE, answering_right
from runs import drain_batches, wait_finished
from servers import Server, free_port
from servers import sim_engine as start_sim_engine

from generators.agent.sandbox import namespaces_work
from rollout_buffer.config import ServerConfig

# The Ray buffer has a bearer token (from the environment, where it is no process's argument): its actors open
# their agent sessions with it.
TOKEN = "ray-buffer-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
# A run's wait: each run starts its pool's actors, which took over 30 s on a loaded 2-core machine.
RUN_S = 180


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with answering_right(tmp_path_factory, qwen_tokenizer_path) as srv:
        yield srv


def buffer(data_dir: Path, *extra: str) -> Server:
    port = free_port()
    return Server(["serve", "--port", str(port), "--data-dir", str(data_dir), *extra], "/healthz", port,
                  data_dir.parent / f"buffer-{port}.log")


@pytest.fixture(scope="module")
def ray_buffer(tmp_path_factory, ray_address: str) -> Iterator[Server]:
    data_dir = tmp_path_factory.mktemp("ray") / "data"
    srv = buffer(data_dir, "--executor", "ray", "--ray-address", ray_address, "--ray-actors", "2")
    srv.env["ROLLOUT_BUFFER_AUTH_TOKEN"] = TOKEN
    with srv.start():
        yield srv


def math_file(path: Path, n: int) -> Path:
    # Odd rows carry a wrong label: their groups score 0, the others 1, whichever process computes the reward.
    rows = [{"instance_id": f"m{i}", "prompt": f"What is {i + 3} + {2 * i}?", "label": str(3 * i + 3 + i % 2)}
            for i in range(n)]
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


def start(url: str, engine: str, input_file: Path, tokenizer: str, **over) -> httpx.Response:
    # Each actor reserves half a CPU (a resource hint of the run): the module's runs share one pool of two.
    payload = {"task_type": "math", "input_file": str(input_file), "num_repeat_per_sample": 4, "num_epoch": 1,
               "num_process": 8, "remote_engine_url": engine, "max_tokens": 256, "tokenizer_path": tokenizer,
               "sampling_params": {"temperature": 1.0}, "ray_num_cpus": 0.5, **over}
    return httpx.post(f"{url}/start_rollout", json=payload, headers=AUTH, timeout=30)


def metric(url: str, name: str) -> float:
    lines = httpx.get(f"{url}/metrics", headers=AUTH, timeout=10).text.splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def groups(batches: list[list[dict]]) -> dict[tuple[str, int], list[tuple]]:
    """Each delivered group: its records' uid, exact tokens, loss mask, messages, rewards and status."""
    out: dict[tuple[str, int], list[tuple]] = {}
    for batch in batches:
        for r in batch:
            key = (r["instance_id"], r["extra_info"]["epoch"])
            out.setdefault(key, []).append((r["uid"].split(":", 1)[1], tuple(r["tokens"]), tuple(r["loss_mask"]),
                                            orjson.dumps(r["messages"]), r["raw_reward"], r["reward"], r["status"]))
    return {k: sorted(v) for k, v in out.items()}


def test_a_math_run_on_ray_delivers_the_same_groups_as_locally(tmp_path, engine, ray_buffer, qwen_tokenizer_path):
    inp = math_file(tmp_path / "math.jsonl", 6)
    assert start(ray_buffer.url, engine.url, inp, qwen_tokenizer_path, num_epoch=2).status_code == 200
    with buffer(tmp_path / "local").start() as local:  # while the actors start
        assert start(local.url, engine.url, inp, qwen_tokenizer_path, num_epoch=2).status_code == 200
        local_status = wait_finished(local.url)
        locally = groups(drain_batches(local.url))
        local_tokens = metric(local.url, "rollout_buffer_tokens_generated_total")
        local_requests = metric(local.url, "rollout_buffer_engine_request_seconds_count")
    ray_status = wait_finished(ray_buffer.url, headers=AUTH, timeout_s=RUN_S)
    on_ray = groups(drain_batches(ray_buffer.url, headers=AUTH))
    assert ray_status["executor"]["kind"] == "ray" and ray_status["executor"]["actors"] == 2
    assert local_status["executor"] == {"kind": "local"}
    assert len(on_ray) == 12 and all(len(g) == 4 for g in on_ray.values())
    assert on_ray == locally
    assert {g[0][4] for g in on_ray.values()} == {0.0, 1.0}, "right and wrong answers, rewarded alike"
    for key in ("done", "failed", "skipped"):
        assert ray_status["run"]["progress"][key] == local_status["run"]["progress"][key]
    # The actors' engine metrics reach the buffer's /metrics.
    assert metric(ray_buffer.url, "rollout_buffer_tokens_generated_total") == local_tokens > 0
    assert metric(ray_buffer.url, "rollout_buffer_engine_request_seconds_count") == local_requests == 48


def kill_an_actor_and_finish(ray_buffer: Server, instances: int, repeats: int) -> dict[str, Any]:
    """Kill the pool's first actor mid-run; once the run finished, nothing failed and each of the `instances` ×
    `repeats` trajectories was delivered exactly once. The run's final status."""
    ray.kill(ray.get_actor(pool_workers(ray_buffer)[0], namespace=NAMESPACE))
    status = wait_finished(ray_buffer.url, headers=AUTH, timeout_s=RUN_S)
    records = [r for batch in drain_batches(ray_buffer.url, headers=AUTH) for r in batch]
    assert status["run"]["state"] == "finished"
    assert status["run"]["progress"]["failed"] == 0 and status["run"]["progress"]["done"] == instances * repeats
    assert len(records) == instances * repeats and len({r["uid"] for r in records}) == instances * repeats
    assert Counter(r["instance_id"] for r in records) == {f"m{i}": repeats for i in range(instances)}
    return status


def test_killing_an_actor_mid_run_loses_nothing(tmp_path, engine, ray_buffer, qwen_tokenizer_path):
    # 192 trajectories, 4 at a time: the run lasts well over a second after the kill, so the killed actor holds
    # some of them.
    inp = math_file(tmp_path / "math.jsonl", 48)
    assert start(ray_buffer.url, engine.url, inp, qwen_tokenizer_path, num_process=4).status_code == 200
    deadline = time.monotonic() + 30
    while httpx.get(f"{ray_buffer.url}/status", headers=AUTH).json()["groups"].get("ready", 0) < 2:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    before = httpx.get(f"{ray_buffer.url}/status", headers=AUTH).json()["executor"]
    workers = pool_workers(ray_buffer)
    status = kill_an_actor_and_finish(ray_buffer, instances=48, repeats=4)
    after = status["executor"]
    assert after["actors_lost"] == before["actors_lost"] + 1
    assert after["retried"] > before["retried"], "the killed actor's trajectories ran again"
    assert metric(ray_buffer.url, "rollout_buffer_executor_retries_total") == after["retried"]
    now = set(pool_workers(ray_buffer))
    assert workers[0] not in now and len(now - set(workers)) == 1, "a new actor was started in its place"

    # An actor lost between runs: the next run, started while the replacement actor starts, runs on it too (the
    # replacement once opened only the runs there were when it was made, then refused the new run's jobs, which
    # hung).
    lost = status["executor"]["actors_lost"]
    ray.kill(ray.get_actor(pool_workers(ray_buffer)[0], namespace=NAMESPACE))
    deadline = time.monotonic() + 30
    while httpx.get(f"{ray_buffer.url}/status", headers=AUTH).json()["executor"]["actors_lost"] == lost:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    assert start(ray_buffer.url, engine.url, math_file(tmp_path / "next.jsonl", 8), qwen_tokenizer_path,
                 num_process=8).status_code == 200
    status = wait_finished(ray_buffer.url, headers=AUTH, timeout_s=RUN_S)
    assert status["run"]["progress"]["done"] == 32 and status["run"]["progress"]["failed"] == 0
    assert len([r for batch in drain_batches(ray_buffer.url, headers=AUTH) for r in batch]) == 32


def test_a_ray_run_resumes_after_the_buffer_is_killed(tmp_path, engine, ray_buffer, qwen_tokenizer_path):
    inp = math_file(tmp_path / "math.jsonl", 48)
    generated = httpx.get(f"{engine.url}/sim/stats").json()["by_endpoint"].get("/generate", 0)
    resp = start(ray_buffer.url, engine.url, inp, qwen_tokenizer_path, num_process=4)
    assert resp.status_code == 200
    run_id = resp.json()["run_id"]
    deadline = time.monotonic() + 30
    while httpx.get(f"{ray_buffer.url}/status", headers=AUTH).json()["groups"].get("ready", 0) < 4:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    ray_buffer.kill9()  # its actors go with it
    ray_buffer.start()  # the same data dir: the run resumes on a new pool
    status = wait_finished(ray_buffer.url, headers=AUTH, timeout_s=RUN_S)
    records = [r for batch in drain_batches(ray_buffer.url, headers=AUTH) for r in batch
               if r["extra_info"]["run_id"] == run_id]
    assert status["run"]["run_id"] == run_id and status["run"]["state"] == "finished"
    assert status["executor"]["actors"] == 2
    assert len(records) == 192 and len({r["uid"] for r in records}) == 192
    # Only what was not stored at the crash ran again: at most num_process generating and as many finished ones
    # waiting for their commit.
    again = httpx.get(f"{engine.url}/sim/stats").json()["by_endpoint"]["/generate"] - generated - 192
    assert 0 <= again <= 8, f"{again} extra generations: complete groups were generated again"

def test_in_flight_limit_holds_and_resource_hints_place_the_actors(tmp_path, ray_buffer, qwen_tokenizer_path):
    inp = math_file(tmp_path / "math.jsonl", 8)
    bad = start(ray_buffer.url, "http://127.0.0.1:9", inp, qwen_tokenizer_path, ray_num_cpus=-1)
    assert bad.status_code == 422 and "ray_num_cpus" in bad.json()["message"]
    with start_sim_engine(tmp_path, qwen_tokenizer_path, "--latency-ms", "40") as eng:
        assert start(ray_buffer.url, eng.url, inp, qwen_tokenizer_path, num_process=4,
                     ray_memory_mb=64).status_code == 200
        status = wait_finished(ray_buffer.url, headers=AUTH, timeout_s=RUN_S)
        stats = httpx.get(f"{eng.url}/sim/stats").json()
    assert status["run"]["state"] == "finished" and status["run"]["progress"]["done"] == 32
    # num_process bounds the requests at the engine however many actors run them.
    assert stats["max_in_flight"] == 4
    # The run's hints placed its actors: two of them hold half a CPU each of the cluster's two, and 64 MiB.
    assert status["executor"]["actors"] == 2
    assert status["executor"]["options"] == {"num_cpus": 0.5, "memory": 64 * 2**20, "resources": {}}
    # What no node of the cluster has is refused by name (Ray would wait for such a node forever).
    for over, named in (({"ray_resources": {"sandbox_gpu": 1}}, "ray_resources"),
                        ({"ray_memory_mb": 2**30}, "ray_memory_mb"), ({"ray_num_cpus": 3}, "ray_num_cpus")):
        refused = start(ray_buffer.url, "http://127.0.0.1:9", inp, qwen_tokenizer_path, **over)
        assert refused.status_code == 422, refused.text
        assert refused.json()["message"].startswith(f"{named}: no node of the Ray cluster has that"), refused.text
    deadline = time.monotonic() + 10  # actors of a buffer that was killed are reaped by Ray a moment later
    while ray.available_resources().get("CPU") != 1.0:
        assert time.monotonic() < deadline, ray.available_resources()
        time.sleep(0.1)


def test_failed_trajectories_are_recorded_with_their_reason(tmp_path, ray_buffer, qwen_tokenizer_path):
    inp = math_file(tmp_path / "math.jsonl", 2)
    before = metric(ray_buffer.url, 'rollout_buffer_trajectories_failed_total{reason="engine_connection"}')
    closed = f"http://127.0.0.1:{free_port()}"  # nothing listens: every trajectory fails in its actor
    assert start(ray_buffer.url, closed, inp, qwen_tokenizer_path, max_retries=0, backoff_s=0.01,
                 engine_outage_s=0).status_code == 200
    status = wait_finished(ray_buffer.url, headers=AUTH, timeout_s=RUN_S)
    assert status["run"]["state"] == "finished"
    assert status["run"]["progress"]["failures"] == {"engine_connection": 8}
    assert status["records"] == {"failed": 8} and status["groups"] == {"filtered": 2}
    # Counted by the buffer, which writes the failure records, as with the local executor.
    assert metric(ray_buffer.url, 'rollout_buffer_trajectories_failed_total{reason="engine_connection"}') - before == 8


def admission_when(url: str, started: int, ready: int, timeout_s: float = 30) -> dict:
    """Poll /status until the live admission has started `started` groups, `ready` are ready and none is in
    flight; returns the admission view."""
    deadline = time.monotonic() + timeout_s
    while True:
        s = httpx.get(f"{url}/status", headers=AUTH, timeout=10).json()
        adm = s["control"]["admission"]
        if (adm.get("started_groups") == started and s["groups"].get("ready", 0) == ready
                and s["run"]["progress"].get("in_flight") == 0):
            return adm
        assert time.monotonic() < deadline, s
        time.sleep(0.1)


def test_staleness_admission_and_weight_update_aborts_behave_as_locally(tmp_path, ray_buffer, qwen_tokenizer_path):
    inp = math_file(tmp_path / "math.jsonl", 40)
    # Earlier runs' groups would be delivered first (oldest first, across runs).
    drain_batches(ray_buffer.url, headers=AUTH)
    # Requests long enough that the update below lands while all eight are running, on a loaded machine too.
    with start_sim_engine(tmp_path, qwen_tokenizer_path, "--latency-ms", "2000") as eng:
        httpx.post(f"{eng.url}/update_weight_version", json={"new_version": "0"}, timeout=10).raise_for_status()
        assert start(ray_buffer.url, eng.url, inp, qwen_tokenizer_path, num_repeat_per_sample=2, max_staleness=1,
                     rollout_batch_size=2, current_version=0).status_code == 200
        # A weight update while the first groups generate: their requests are aborted and resumed on the actors.
        deadline = time.monotonic() + 20
        while httpx.get(f"{eng.url}/sim/stats", timeout=10).json()["in_flight"] < 8:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        time.sleep(0.1)
        for path, body in (("/pause_generation", {"mode": "abort"}), ("/update_weight_version",
                           {"new_version": "1"}), ("/continue_generation", {})):
            httpx.post(eng.url + path, json=body, timeout=10).raise_for_status()
        # (η + 1) × B = 4 groups may start before the trainer moves, as with the local executor.
        adm = admission_when(ray_buffer.url, started=4, ready=4)
        assert (adm["state"], adm["groups_ahead"], adm["capacity"]) == ("paused_staleness", 4, 0)
        r = httpx.post(f"{ray_buffer.url}/get_rollout_data", json={"max_groups": 2, "current_version": 1}, headers=AUTH,
                       timeout=30).json()
        records = r["data"]["data"]
        assert r["data"]["meta_info"]["num_groups"] == 2
        assert all(rec["status"] == "completed" for rec in records)
        # Turns cut by the update carry both versions (0 then 1, within η of the trainer's 1); none failed.
        versions = {(rec["extra_info"]["weight_version_min"], rec["extra_info"]["weight_version_max"])
                    for rec in records}
        assert ("0", "1") in versions, versions
        # The trainer at version 1 with one batch consumed: one step, so B = 2 groups more may start.
        adm = admission_when(ray_buffer.url, started=6, ready=4)
        assert adm["state"] == "paused_staleness"


# ---- agent runs on Ray: the agent (callable or subprocess) in the actor, its session in the buffer's proxy -------


def start_agents(url: str, engine: str, input_file: Path, tokenizer: str, **over) -> httpx.Response:
    drain_batches(url, headers=AUTH, wait_s=0)  # earlier runs' groups would be delivered first
    payload = {"task_type": "agent", "input_file": str(input_file), "num_repeat_per_sample": 2, "num_epoch": 1,
               "num_process": 8, "remote_engine_url": engine, "max_tokens": 512, "tokenizer_path": tokenizer,
               "ray_num_cpus": 0.5, **over}
    return httpx.post(f"{url}/start_rollout", json=payload, headers=AUTH, timeout=30)


def worker_pid(pid: int) -> bool:
    """True when `pid` is a live Ray actor of the pool (Ray names its process after the actor's class)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().startswith(b"ray::TrajectoryWorker")
    except OSError:
        return False


def test_subprocess_agents_run_in_the_actors_with_sessions_in_the_buffer(tmp_path, engine, ray_buffer,
                                                                         readable_agents, qwen_tokenizer_path):
    prompt = "What is 12 * 7 + 3? Use the calculator."
    rows = [{"instance_id": f"c{i}", "prompt": prompt, "label": "87" if i % 2 == 0 else "86"} for i in range(3)]
    inp = tmp_path / "calc.jsonl"
    inp.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    started = start_agents(ray_buffer.url, engine.url, inp, qwen_tokenizer_path,
                           agent_command=[str(readable_agents / "stdlib_agent.py")])
    assert started.status_code == 200, started.text
    status = wait_finished(ray_buffer.url, headers=AUTH, timeout_s=RUN_S)
    assert status["run"]["state"] == "finished" and status["executor"]["kind"] == "ray"
    assert status["run"]["progress"]["failed"] == 0 and status["run"]["progress"]["done"] == 6
    batches = drain_batches(ray_buffer.url, headers=AUTH)
    records = [r for batch in batches for r in batch]
    assert len(records) == 6 and len({r["uid"] for r in records}) == 6, "each trajectory stored once"
    assert {(r["instance_id"], r["raw_reward"]) for r in records} == {("c0", 1.0), ("c1", 0.0), ("c2", 1.0)}
    buffer_pid = ray_buffer.proc.pid
    for r in records:
        info = r["extra_info"]
        assert r["status"] == "completed" and info["scorer"] == "math" and info["tool_calls"] == 1
        # Exact tokens: the prompt and the engine's own output ids, the output's log-probs, loss on the output.
        assert len(r["tokens"]) == len(r["loss_mask"]) and len(r["rollout_log_probs"]) == r["response_length"] > 0
        assert 0 < sum(r["loss_mask"]) < r["response_length"], "the tool's result is in the response, loss 0"
        assert "tokenization_mismatch" not in info, "the tokens re-tokenize to the messages exactly"
        report = orjson.loads(next(line for line in info["agent"]["stderr_tail"].splitlines()
                                   if line.startswith("REPORT "))[7:])
        parent_pids = [pid for pid, _ in report["parents"]]
        assert buffer_pid not in parent_pids and any(worker_pid(pid) for pid in parent_pids), report["parents"]
        if namespaces_work():  # the buffer's agent socket is on this machine: the actors' agents are sandboxed
            assert info["agent"]["network"] == "isolated" and report["buffer_status"] == 403
    assert httpx.get(f"{ray_buffer.url}/sessions", headers=AUTH).json() == {"sessions": []}


def pid_agent_rows(tmp_path: Path, n: int, pause_s: float) -> tuple[Path, Path]:
    """A math input of `n` rows for `pid_agent.py` (it notes its process and times in the folder, and holds its
    session `pause_s` after its first turn): (the input file, that folder)."""
    pid_dir = tmp_path / "pids"
    pid_dir.mkdir()
    inp = math_file(tmp_path / "math.jsonl", n)
    rows = [{**orjson.loads(line), "pid_dir": str(pid_dir), "pause_s": pause_s}
            for line in inp.read_bytes().splitlines()]
    inp.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return inp, pid_dir


def test_a_callable_agent_runs_in_the_actors_at_most_agent_max_running_at_once(tmp_path, engine, ray_buffer,
                                                                               readable_agents, qwen_tokenizer_path):
    inp, pid_dir = pid_agent_rows(tmp_path, 4, pause_s=0.05)
    started = start_agents(ray_buffer.url, engine.url, inp, qwen_tokenizer_path,
                           agent=f"{readable_agents / 'pid_agent.py'}:agent", agent_max_running=1)
    assert started.status_code == 200, started.text
    status = wait_finished(ray_buffer.url, headers=AUTH, timeout_s=RUN_S)
    assert status["run"]["progress"]["failed"] == 0 and status["run"]["progress"]["done"] == 8
    records = [r for batch in drain_batches(ray_buffer.url, headers=AUTH) for r in batch]
    assert len(records) == 8 and len({r["uid"] for r in records}) == 8
    assert {r["instance_id"]: r["raw_reward"] for r in records} == {"m0": 1.0, "m1": 0.0, "m2": 1.0, "m3": 0.0}
    assert all(r["extra_info"]["scorer"] == "math" and r["response_length"] > 0 for r in records)
    runs = [p.read_text().split() for p in pid_dir.iterdir()]
    assert len(runs) == 8 and {r["extra_info"]["session_id"] for r in records} == {p.name for p in pid_dir.iterdir()}
    pids = {int(pid) for pid, _, _ in runs}
    assert ray_buffer.proc.pid not in pids and all(worker_pid(pid) for pid in pids), pids
    # agent_max_running 1: one agent at a time in each actor, though num_process lets 8 in.
    for pid in pids:
        spans = sorted((float(start), float(end)) for p, start, end in runs if int(p) == pid)
        assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans)), spans


def test_killing_an_actor_while_agents_run_loses_nothing_and_leaks_no_session(tmp_path, engine, ray_buffer,
                                                                                readable_agents, qwen_tokenizer_path):
    # Each agent holds its open session 0.3 s after its first turn: the killed actor has sessions open.
    inp, _ = pid_agent_rows(tmp_path, 12, pause_s=0.3)
    discarded = metric(ray_buffer.url, 'rollout_buffer_proxy_sessions_closed_total{outcome="discarded"}')
    before = httpx.get(f"{ray_buffer.url}/status", headers=AUTH).json()["executor"]
    started = start_agents(ray_buffer.url, engine.url, inp, qwen_tokenizer_path,
                           agent=f"{readable_agents / 'pid_agent.py'}:agent")
    assert started.status_code == 200, started.text
    # 8 in flight, 4 on each actor (the pool gives each job to the actor holding fewest): with 6 sessions open, both
    # actors hold some.
    deadline = time.monotonic() + 30
    while len(httpx.get(f"{ray_buffer.url}/sessions", headers=AUTH).json()["sessions"]) < 6:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    status = kill_an_actor_and_finish(ray_buffer, instances=12, repeats=2)
    assert status["executor"]["actors_lost"] == before["actors_lost"] + 1
    assert status["executor"]["retried"] > before["retried"]
    # The lost actor's open sessions were discarded when their trajectories ran again; none is left open.
    assert metric(ray_buffer.url, 'rollout_buffer_proxy_sessions_closed_total{outcome="discarded"}') > discarded
    assert httpx.get(f"{ray_buffer.url}/sessions", headers=AUTH).json() == {"sessions": []}


def pool_workers(srv: Server) -> list[str]:
    """The names of the live actors of `srv`'s pool (their names carry the pool's id)."""
    pool_id = httpx.get(f"{srv.url}/status", headers=AUTH).json()["executor"]["pool_id"]
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["namespace"] == NAMESPACE and a["name"].startswith(f"trajectory-worker-{pool_id}-"))


def test_the_actor_session_endpoints_refuse_bad_input_naming_the_field(engine, ray_buffer, qwen_tokenizer_path):
    url = ray_buffer.url

    def post(path: str, body: object, headers: dict[str, str] = AUTH) -> httpx.Response:
        return httpx.post(f"{url}{path}", json=body, headers=headers, timeout=30)

    ident = {"kind": "generator", "run_id": "r", "uid": "r:0:0:0", "instance_id": "0", "epoch": 0, "repeat": 0}
    assert post("/sessions", ident, headers={}).status_code == 401, "bearer-protected like the rest"
    for bad, field in (({k: v for k, v in ident.items() if k != "uid"}, "uid"), ({**ident, "epoch": -1}, "epoch"),
                       ({**ident, "repeat": True}, "repeat"), ({**ident, "uid": "other:0:0:0"}, "uid"),
                       ({**ident, "kind": "robot"}, "kind")):
        resp = post("/sessions", bad)
        assert resp.status_code == 422 and field in resp.json()["message"], (field, resp.text)
    # A harness-only run (it runs no agents, so it stays in the buffer): actors may not open sessions in it.
    started = httpx.post(f"{url}/start_rollout", headers=AUTH, timeout=30, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path})
    assert started.status_code == 200, started.text
    run_id = started.json()["run_id"]
    unknown = post("/sessions", {**ident, "run_id": "nope", "uid": "nope:0:0:0"})
    assert unknown.status_code == 409 and "run_id" in unknown.json()["message"]
    harness_only = post("/sessions", {**ident, "run_id": run_id, "uid": f"{run_id}:0:0:0"})
    assert harness_only.status_code == 409 and "run_id" in harness_only.json()["message"]
    opened = post("/sessions", {"instance_id": "h"})
    assert opened.status_code == 200, opened.text
    harness = opened.json()["session_id"]
    wrong_kind = post(f"/sessions/{harness}/close", {"reward": 1.0})
    assert wrong_kind.status_code == 409 and "session_id" in wrong_kind.json()["message"]
    assert post(f"/sessions/{harness}/discard", {"reason": "x"}).status_code == 409
    assert post("/sessions/s-nope/close", {"reward": 1.0}).status_code == 404
    assert "session_id" in post("/sessions/s-nope/discard", {"reason": "x"}).json()["message"]
    assert httpx.get(f"{url}/sessions/s-nope/transcript", headers=AUTH).status_code == 404
    assert httpx.get(f"{url}/sessions/{harness}/transcript", headers=AUTH).json()["messages"] == []
    not_a_number = post(f"/sessions/{harness}/close", {"reward": "high"})
    assert not_a_number.status_code == 422 and "reward" in not_a_number.json()["message"]
    no_reason = post(f"/sessions/{harness}/discard", {})
    assert no_reason.status_code == 422 and "reason" in no_reason.json()["message"]
    finished = post(f"/sessions/{harness}/finish", {"reward": 0.0})
    assert finished.status_code == 200 and finished.json()["status"] == "empty"


def test_replacing_an_agent_run_on_ray_leaves_none_of_its_sessions_open(tmp_path, engine, ray_buffer, readable_agents,
                                                                       qwen_tokenizer_path):
    inp, _ = pid_agent_rows(tmp_path, 4, pause_s=5)

    def closed() -> tuple[float, float]:
        name = "rollout_buffer_proxy_sessions_closed_total"
        return (metric(ray_buffer.url, f'{name}{{outcome="discarded"}}'),
                metric(ray_buffer.url, f'{name}{{outcome="finished"}}'))

    discarded, finished = closed()
    started = start_agents(ray_buffer.url, engine.url, inp, qwen_tokenizer_path,
                           agent=f"{readable_agents / 'pid_agent.py'}:agent")
    assert started.status_code == 200, started.text
    old_run = started.json()["run_id"]
    deadline = time.monotonic() + RUN_S
    # Every agent has opened its session (on a loaded machine the first may have finished before the last opens).
    while len(httpx.get(f"{ray_buffer.url}/sessions", headers=AUTH).json()["sessions"]) + closed()[1] - finished < 8:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    # A new run replaces it while its agents run in the actors: its sessions are closed by the time it answers.
    replaced = httpx.post(f"{ray_buffer.url}/start_rollout", headers=AUTH, timeout=30, json={
        "task_type": "agent", "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path})
    assert replaced.status_code == 200, replaced.text
    assert httpx.get(f"{ray_buffer.url}/sessions", headers=AUTH, params={"run_id": old_run}).json() == {"sessions": []}
    # Those still open were discarded; on a loaded machine an agent may have finished its pause before.
    now_discarded, now_finished = closed()
    assert now_discarded - discarded >= 1 and (now_discarded - discarded) + (now_finished - finished) == 8


def test_the_actors_reach_the_buffer_at_its_public_url_or_its_local_one():
    assert ServerConfig(port=9000).buffer_url == "http://127.0.0.1:9000"
    assert ServerConfig(host="0.0.0.0", port=9000, auth_token="t").buffer_url == "http://127.0.0.1:9000"
    assert ServerConfig(host="10.0.0.5", port=9000, auth_token="t").buffer_url == "http://10.0.0.5:9000"
    assert ServerConfig(port=9000, public_url="http://buffer:9000/").buffer_url == "http://buffer:9000"
    with pytest.raises(ValueError, match="public_url"):
        ServerConfig(public_url="buffer:9000")


# ---- the buffer's token on Ray, and a buffer with a Ray of its own ------------------------------------------------
def processes_with(needle: str) -> list[int]:
    """The ids of the processes whose command line holds `needle`."""
    return [p.info["pid"] for p in psutil.process_iter(["pid", "cmdline"])
            if needle in " ".join(p.info["cmdline"] or ())]


def memory_holds(pid: int, needle: bytes) -> bool | None:
    """Whether process `pid`'s readable memory holds `needle`; None when it may not be read here."""
    try:
        with open(f"/proc/{pid}/maps") as maps, open(f"/proc/{pid}/mem", "rb", 0) as mem:
            for line in maps:
                span, perms = line.split()[:2]
                start, end = (int(x, 16) for x in span.split("-"))
                if "r" not in perms or end - start > 1 << 30:
                    continue
                try:
                    mem.seek(start)
                    if needle in mem.read(end - start):
                        return True
                except (OSError, OverflowError, ValueError):  # guard pages, [vvar]
                    continue
    except PermissionError:
        return None
    return False


def ray_records(address: str) -> list[Any]:
    """What the GCS at `address` holds of the actors, jobs and tasks, and the state API's listings of them when it
    answers."""
    from ray.util.state import list_actors, list_jobs, list_tasks
    from ray.util.state.exception import ServerUnavailable

    state = ray._private.state.state
    records = [state.actor_table(None), state.job_table(), state._get_all_task_events()]
    try:
        return [*records, *(ls(address=address, detail=True) for ls in (list_actors, list_jobs, list_tasks))]
    except ServerUnavailable:  # no dashboard (Ray without its `default` extra)
        return records


def test_the_token_reaches_the_actors_in_no_command_line_and_no_ray_record(tmp_path, engine, ray_address, ray_buffer,
                                                                          readable_agents, qwen_tokenizer_path):
    # An agent run: its trajectories open their sessions in the buffer with the token, so it completes only if the
    # actors hold it.
    inp, _ = pid_agent_rows(tmp_path, 2, pause_s=0)
    started = start_agents(ray_buffer.url, engine.url, inp, qwen_tokenizer_path,
                           agent=f"{readable_agents / 'pid_agent.py'}:agent")
    assert started.status_code == 200, started.text
    status = wait_finished(ray_buffer.url, headers=AUTH, timeout_s=RUN_S)
    assert status["run"]["progress"]["done"] == 4 and status["run"]["progress"]["failed"] == 0
    assert processes_with(TOKEN) == []
    # Ray's records of the actors, jobs and tasks, which its state API serves (where Ray's dashboard runs).
    assert TOKEN not in str(ray_records(ray_address))
    # Nor anywhere in the memory of Ray's GCS and raylet, which keep an actor's constructor arguments.
    ray_system = [p.pid for p in psutil.Process().children() if p.name() in ("gcs_server", "raylet")]
    assert len(ray_system) == 2
    assert all(memory_holds(pid, TOKEN.encode()) in (False, None) for pid in ray_system)


def test_a_token_given_on_the_command_line_is_masked_in_the_ray_job(tmp_path, ray_address, qwen_tokenizer_path):
    # Ray records the command line of the buffer (its driver) as its job's entrypoint.
    secret = "command-line-token"
    port = free_port()
    with Server(["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--executor", "ray",
                 "--ray-address", ray_address, "--ray-actors", "1", "--auth-token", secret], "/healthz", port,
                tmp_path / "buffer.log").start() as srv:
        closed = f"http://127.0.0.1:{free_port()}"  # the run fails at once; it only makes the buffer join Ray
        resp = httpx.post(f"{srv.url}/start_rollout", headers={"Authorization": f"Bearer {secret}"}, timeout=30, json={
            "task_type": "math", "input_file": str(math_file(tmp_path / "math.jsonl", 1)), "num_repeat_per_sample": 1,
            "remote_engine_url": closed, "tokenizer_path": qwen_tokenizer_path, "max_retries": 0, "engine_outage_s": 0,
            "ray_num_cpus": 0.5})
        assert resp.status_code == 200, resp.text
        wait_finished(srv.url, headers={"Authorization": f"Bearer {secret}"}, timeout_s=RUN_S)
        job = next(j for j in ray._private.state.state.job_table() if j["DriverPid"] == srv.proc.pid)
        assert "--auth-token ***" in job["Entrypoint"] and secret not in job["Entrypoint"]
        assert secret not in " ".join(psutil.Process(srv.proc.pid).cmdline()), "ps shows no token either"
        assert secret not in str(ray_records(ray_address))


def descendants(pid: int) -> list[psutil.Process]:
    return psutil.Process(pid).children(recursive=True)


def session_and_environ(proc: psutil.Process) -> tuple[int, dict[str, str]] | None:
    """The session id and the environment of `proc`; None once it exited."""
    try:
        return os.getsid(proc.pid), proc.environ()
    except (ProcessLookupError, psutil.NoSuchProcess):
        return None


def wait_gone(procs: list[psutil.Process], timeout_s: float = 30) -> None:
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    assert not alive, [" ".join(p.cmdline()[:3]) for p in alive]


def test_a_buffer_with_a_ray_of_its_own_stops_in_order_on_sigterm_to_its_process_group(tmp_path,
                                                                                       qwen_tokenizer_path):
    data_dir = tmp_path / "data"
    secret = "local-ray-buffer-token"
    auth = {"Authorization": f"Bearer {secret}"}

    def local_ray_buffer() -> Server:
        srv = buffer(data_dir, "--executor", "ray", "--ray-actors", "2")
        srv.env["ROLLOUT_BUFFER_AUTH_TOKEN"] = secret  # not on its command line
        for name in ("RAY_ADDRESS", "RAY_AUTH_MODE"):  # as in production: no cluster, Ray's auth left to Ray
            srv.env.pop(name, None)
        return srv.start()

    def post(url: str, inp: Path, **over: Any) -> str:
        payload = {"task_type": "math", "input_file": str(inp), "num_repeat_per_sample": 2, "num_process": 4,
                   "remote_engine_url": eng.url, "max_tokens": 64, "tokenizer_path": qwen_tokenizer_path,
                   "ray_num_cpus": 0.5, **over}
        resp = httpx.post(f"{url}/start_rollout", json=payload, headers=auth, timeout=60)
        assert resp.status_code == 200, resp.text
        return resp.json()["run_id"]

    def progress(url: str) -> dict[str, Any]:
        return httpx.get(f"{url}/status", headers=auth, timeout=10).json()["run"]["progress"]

    with start_sim_engine(tmp_path, qwen_tokenizer_path, "--correct-rate", "1", "--latency-ms", "100") as eng:
        srv = local_ray_buffer()
        try:
            first = post(srv.url, math_file(tmp_path / "first.jsonl", 2))
            assert wait_finished(srv.url, headers=auth, timeout_s=120)["run"]["progress"]["done"] == 4
            second = post(srv.url, math_file(tmp_path / "second.jsonl", 48))
            deadline = time.monotonic() + 60
            while progress(srv.url)["done"] < 4:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            # Ray's processes are the buffer's children in a session of their own; none has the token in its
            # command line or its environment.
            ray_procs = descendants(srv.proc.pid)
            assert any(p.name() == "gcs_server" for p in ray_procs)
            seen = [s for s in map(session_and_environ, ray_procs) if s is not None]
            assert seen and all(sid != srv.proc.pid and secret not in str(env) for sid, env in seen)
            assert processes_with(secret) == []
            done = progress(srv.url)["done"]
            os.killpg(srv.proc.pid, signal.SIGTERM)  # the buffer's group, as a supervisor stopping it does
            returncode = srv.proc.wait(60)
        finally:
            srv.stop()
        log = srv.log()
        # The buffer shut down in order (uvicorn then exits with the signal it got, as with the local executor):
        # actors stopped, Ray stopped, the store closed (SQLite took its write-ahead log back into the database).
        assert returncode == -signal.SIGTERM, log[-3000:]
        steps = ("actors stopped, left the cluster", "local Ray head stopped", "Application shutdown complete")
        assert all(step in log for step in steps), log[-3000:]
        assert [log.index(step) for step in steps] == sorted(log.index(step) for step in steps)
        assert not list(data_dir.glob("*-wal")), "the store was not closed"
        wait_gone(ray_procs)
        # The store holds all that was written: the first run's records and those the second had done.
        with contextlib.closing(sqlite3.connect(data_dir / "buffer.sqlite")) as db:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            stored = dict(db.execute("SELECT run_id, count(*) FROM trajectories GROUP BY run_id").fetchall())
        assert stored[first] == 4 and stored[second] >= done

        # It opens again, and the second run resumes on a new Ray of the buffer's own.
        srv = local_ray_buffer()
        try:
            assert httpx.get(f"{srv.url}/status", headers=auth, timeout=10).json()["run"]["run_id"] == second
            deadline = time.monotonic() + 120
            while httpx.get(f"{srv.url}/status", headers=auth, timeout=10).json()["executor"]["actors"] < 2:
                assert time.monotonic() < deadline
                time.sleep(0.1)
            # A buffer killed outright takes its Ray along (a parent-death signal: Ray is in a session of its own).
            ray_procs = descendants(srv.proc.pid)
            srv.kill9()
            wait_gone(ray_procs)
        finally:
            srv.stop()
            # The buffer keeps its Ray's logs for the operator; the test's are of no use once it passed.
            for folder in re.findall(r"local Ray head \(pid \d+, logs in (\S+)\)", log + srv.log()):
                shutil.rmtree(folder, ignore_errors=True)
