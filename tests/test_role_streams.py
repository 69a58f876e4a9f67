"""Role streams (plan/act with two models): a planner trainer and an actor trainer each consume their own
role's records from one plan/act run, over real HTTP, with two simulated engines whose weight versions are
bumped independently, a kill -9 of the buffer in between, per-role normalization checked by hand and
per-role staleness."""

from __future__ import annotations

import argparse
import io
import logging
import statistics
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from rich.console import Console
from runs import wait_finished
from servers import Server, free_port

from rollout_buffer.tools import export
from rollout_buffer.tools import status as status_tool
from rollout_buffer.tools.demo import bundled_dataset
from slime_adapter import add_arguments, generate_rollout, run_control
from slime_adapter.data_buffer import DataBuffer
from slime_adapter.flags import AdapterSettings

W_PLANNER, W_ACTOR = 1.0, 0.5
# Groups of the kill -9 test: each has two episodes, whose rewards differ about half the time (the engine's correct
# rate 0.6); with this many, some group has reward variance, which its normalization check needs, but for 0.52¹².
ROWS = 12


def sim_engine(tmp: Path, tokenizer: str, seed: str) -> Server:
    port = free_port()
    args = ["sim-engine", "--port", str(port), "--tokenizer", tokenizer, "--latency-ms", "1",
            "--correct-rate", "0.6", "--seed", seed]
    return Server(args, "/health", port, tmp / f"sim-{port}.log")


def buffer_server(tmp: Path, port: int) -> Server:
    return Server(["serve", "--port", str(port), "--data-dir", str(tmp / "data")], "/healthz", port,
                  tmp / "buffer.log")


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[tuple[Server, Server]]:
    """(planner engine, actor engine)."""
    tmp = tmp_path_factory.mktemp("sim")
    with sim_engine(tmp, qwen_tokenizer_path, "1").start() as p, sim_engine(tmp, qwen_tokenizer_path, "2").start() as a:
        yield p, a


def set_engine_version(engine: Server, version: int) -> None:
    httpx.post(f"{engine.url}/update_weight_version", json={"new_version": str(version)}).raise_for_status()


def start_run(url: str, engines: tuple[Server, Server], tokenizer: str, input_file: Path, **options: Any) -> str:
    planner, actor = engines
    payload = {
        "task_type": "plan_act", "input_file": str(input_file), "num_repeat_per_sample": 2, "num_process": 8,
        "remote_engine_url": planner.url, "planner_engine_url": planner.url, "actor_engine_url": actor.url,
        "max_tokens": 2048, "tokenizer_path": tokenizer, "sampling_params": {"temperature": 1.0},
        "tokenization_sanity_check_mode": "ignore_strippable", "backoff_s": 0.05,
        "planner_reward_weight": W_PLANNER, "actor_reward_weight": W_ACTOR, **options,
    }
    resp = httpx.post(f"{url}/start_rollout", json=payload, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["run_id"]


def write_rows(path: Path, n: int) -> Path:
    """`n` rows of the bundled plan/act dataset (again under new instance ids past its end)."""
    rows = [orjson.loads(line) for line in bundled_dataset("plan_act").read_bytes().splitlines() if line.strip()]
    picked = [{**rows[i % len(rows)], "instance_id": f"{rows[i % len(rows)]['instance_id']}-{i // len(rows)}"}
              for i in range(n)]
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in picked) + b"\n")
    return path


class RoleConsumer:
    """One role's trainer: fetches its stream with leases, acks, and reports its own weight version."""

    def __init__(self, role: str, engine: Server, url: str):
        self.role, self.engine, self.url = role, engine, url
        self.version = 0
        self.acked: list[list[dict]] = []  # the records of every acked batch
        self.metas: list[dict] = []

    def fetch(self, max_groups: int, lease_s: float = 30, wait_s: float = 0.5) -> dict | None:
        body = {"agent_id": self.role, "max_groups": max_groups, "lease_s": lease_s, "wait_s": wait_s,
                "current_version": self.version}
        out = httpx.post(f"{self.url}/get_rollout_data", json=body, timeout=30).json()
        if out["data"]["meta_info"]:
            self.metas.append(out["data"]["meta_info"])
        return out["data"] if out["success"] else None

    def step(self, max_groups: int, wait_s: float = 0.5) -> bool:
        """Fetch, ack, then train: a new weight version on this role's engine. False when nothing came."""
        data = self.fetch(max_groups, wait_s=wait_s)
        if data is None:
            return False
        batch = data["meta_info"]["batch_id"]
        httpx.post(f"{self.url}/ack", json={"batch_id": batch, "agent_id": self.role}).raise_for_status()
        self.acked.append(data["data"])
        self.version += 1
        set_engine_version(self.engine, self.version)
        return True

    def records(self) -> list[dict]:
        return [r for batch in self.acked for r in batch]


def by_group(records: list[dict]) -> dict[tuple[str, int, int], list[dict]]:
    groups: dict[tuple[str, int, int], list[dict]] = defaultdict(list)
    for r in records:
        info = r["extra_info"]
        groups[(r["instance_id"], info["epoch"], info.get("group_part", 0))].append(r)
    return groups


def test_two_role_consumers_each_get_their_records_once_across_a_kill9(
        tmp_path: Path, engines: tuple[Server, Server], qwen_tokenizer_path: str) -> None:
    planner_engine, actor_engine = engines
    for e in engines:
        set_engine_version(e, 0)
    port = free_port()
    srv = buffer_server(tmp_path, port).start()
    try:
        run_id = start_run(srv.url, engines, qwen_tokenizer_path, write_rows(tmp_path / "in.jsonl", ROWS))
        planner = RoleConsumer("planner", planner_engine, srv.url)
        actor = RoleConsumer("actor", actor_engine, srv.url)

        # Different speeds while the run generates: the planner takes 2 groups a step, the actor 1 and rests.
        def consume(consumer: RoleConsumer, batches: int, max_groups: int, rest_s: float) -> None:
            deadline = time.monotonic() + 30
            while len(consumer.acked) < batches and time.monotonic() < deadline:
                consumer.step(max_groups, wait_s=5)
                time.sleep(rest_s)

        threads = [threading.Thread(target=consume, args=(planner, 2, 2, 0.0)),
                   threading.Thread(target=consume, args=(actor, 1, 1, 0.3))]

        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        # The actor takes one more batch and dies before acking it.
        lost = actor.fetch(1, lease_s=1.5, wait_s=10)
        assert lost is not None and {r["extra_info"]["agent_id"] for r in lost["data"]} == {"actor"}
        srv.kill9()

        srv = buffer_server(tmp_path, port).start()
        status = wait_finished(srv.url, timeout_s=60)
        assert status["run"]["run_id"] == run_id and status["run"]["state"] == "finished"
        assert status["run"]["progress"]["failed"] == 0
        # Both trainers drain what is left; the actor's unacked batch comes back after its lease.
        while planner.step(3):
            pass
        time.sleep(1.6)
        while actor.step(2):
            pass

        status = httpx.get(f"{srv.url}/status").json()
        groups = httpx.get(f"{srv.url}/groups", params={"run_id": run_id}).json()["groups"]
        metrics_text = httpx.get(f"{srv.url}/metrics").text
    finally:
        srv.stop()

    # Every stored record of a role reached its role's consumer exactly once, and nothing else did.
    for g in groups:
        assert g["state"] == "ready", "the default stream was never read: its groups stay ready"
    got = {c.role: Counter(r["uid"] for r in c.records()) for c in (planner, actor)}
    for c in (planner, actor):
        assert {r["extra_info"]["agent_id"] for r in c.records()} == {c.role}
        assert set(got[c.role].values()) == {1}, f"{c.role}: a record was delivered twice"
    assert len(groups) == ROWS
    assert sum(g["roles"]["planner"]["records"] for g in groups) == sum(got["planner"].values()) == 2 * ROWS
    assert sum(g["roles"]["actor"]["records"] for g in groups) == sum(got["actor"].values())
    assert set(got["planner"]) | set(got["actor"]) == {u for g in groups for u in g["uids"]}
    assert all(role["state"] == "delivered" for g in groups for role in g["roles"].values())
    # Whole groups: each delivered group holds the role's records of all its episodes.
    planner_groups, actor_groups = by_group(planner.records()), by_group(actor.records())
    assert len(planner_groups) == ROWS and all(len({r["extra_info"]["episode_id"] for r in g}) == 2
                                            for g in planner_groups.values())
    for key, records in actor_groups.items():
        group = next(g for g in groups if (g["instance_id"], g["epoch"], g["part"]) == key)
        assert len(records) == group["roles"]["actor"]["records"]

    # Per-role normalization, by hand: GRPO over the group's episode rewards, times the role's weight.
    for key, planners in planner_groups.items():
        rewards = {r["extra_info"]["episode_id"]: r["extra_info"]["episode_reward"] for r in planners}
        mean, std = statistics.fmean(rewards.values()), statistics.pstdev(rewards.values())

        def expected(episode: str, weight: float) -> float:
            return 0.0 if std < 1e-8 else (rewards[episode] - mean) / (std + 1e-6) * weight  # noqa: B023

        for r in planners:
            assert r["reward"] == pytest.approx(expected(r["extra_info"]["episode_id"], W_PLANNER))
            assert r["raw_reward"] == pytest.approx(r["extra_info"]["episode_reward"] * W_PLANNER)
        for r in actor_groups.get(key, []):
            assert r["reward"] == pytest.approx(expected(r["extra_info"]["episode_id"], W_ACTOR))
    assert any(statistics.pstdev(r["reward"] for r in g) > 0 for g in planner_groups.values()), \
        "some group must have reward variance for the check to mean anything"

    # Each stream's meta_info: its own role, its trainer's version, and lags against its own engine's versions.
    for c in (planner, actor):
        delivered = [m for m in c.metas if m.get("num_groups")]
        assert all(m["agent_id"] == c.role for m in delivered)
        assert sum(m["finished_groups_count"] for m in delivered) >= 1
    assert planner.metas[-1]["trainer_version"] == planner.version
    assert actor.metas[-1]["trainer_version"] == actor.version
    # Per-role counts in /status and /metrics.
    roles = status["roles"]
    assert roles["planner"] == {"groups": {"delivered": ROWS}, "records": 2 * ROWS, "trainer_version": planner.version}
    assert roles["actor"]["groups"] == {"delivered": len(actor_groups)}
    assert roles["actor"]["trainer_version"] == actor.version
    assert status["control"]["roles"]["planner"]["consumed_groups"] == ROWS
    assert f'rollout_buffer_role_groups{{agent_id="planner",state="delivered"}} {ROWS}.0' in metrics_text
    assert f'rollout_buffer_role_records{{agent_id="actor"}} {float(roles["actor"]["records"])}' in metrics_text
    console = Console(width=160, record=True, file=io.StringIO())
    console.print(status_tool.render(status, "http://buffer"))
    assert f"role planner  delivered {ROWS}  records {2 * ROWS}  trainer v{planner.version}" in console.export_text()
    # Export: per-role counts, and what one role's stream consumed.
    out = io.BytesIO()
    summary = export.export(tmp_path / "data", out, delivered_only=False)
    assert summary.by_role == {"planner": 2 * ROWS, "actor": roles["actor"]["records"]}
    out = io.BytesIO()
    summary = export.export(tmp_path / "data", out, agent_id="actor")
    assert summary.by_role == {"actor": roles["actor"]["records"]}
    assert [orjson.loads(line)["uid"] for line in out.getvalue().splitlines()] == [r["uid"] for r in actor.records()]


def test_staleness_applies_per_role(tmp_path: Path, engines: tuple[Server, Server], qwen_tokenizer_path: str
                                    ) -> None:
    planner_engine, actor_engine = engines
    set_engine_version(planner_engine, 3)
    set_engine_version(actor_engine, 7)
    with buffer_server(tmp_path, free_port()).start() as srv:
        start_run(srv.url, engines, qwen_tokenizer_path, write_rows(tmp_path / "in.jsonl", 1), max_staleness=1,
                  rollout_batch_size=1)
        wait_finished(srv.url, timeout_s=30)
        # The planner's trainer is 2 versions past its engine's data: stale for the planner, and only for it.
        planner = RoleConsumer("planner", planner_engine, srv.url)
        planner.version = 5
        assert planner.fetch(4, wait_s=0) is None
        assert planner.metas[-1]["stale_groups"] == 1 and planner.metas[-1]["trainer_version"] == 5
        actor = RoleConsumer("actor", actor_engine, srv.url)
        actor.version = 8
        data = actor.fetch(4, wait_s=0)
        assert data is not None and data["meta_info"]["max_version_lag"] == 1
        assert {r["extra_info"]["agent_id"] for r in data["data"]} == {"actor"}
        bad = httpx.post(f"{srv.url}/get_rollout_data", json={"agent_id": ""})
        assert bad.status_code == 422 and "agent_id" in bad.json()["message"]
        # An ack names its stream: the actor's batch cannot be acked as the planner's.
        bad = httpx.post(f"{srv.url}/ack", json={"batch_id": data["meta_info"]["batch_id"], "agent_id": "planner"})
        assert bad.status_code == 409 and "agent_id" in bad.json()["message"]
        [group] = httpx.get(f"{srv.url}/groups").json()["groups"]
        assert group["roles"]["planner"]["state"] == "filtered" and group["roles"]["planner"]["reason"] == "stale"
        assert group["roles"]["actor"]["state"] == "leased"
        # Without agent_id the default stream is as before: the whole group, both roles, untouched by the roles.
        whole = httpx.post(f"{srv.url}/get_rollout_data", json={}).json()["data"]["data"]
        assert {r["extra_info"]["agent_id"] for r in whole} == {"planner", "actor"}
        status = httpx.get(f"{srv.url}/status").json()
        assert status["roles"]["planner"]["groups"] == {"filtered": 1}
        assert status["roles"]["actor"]["groups"] == {"leased": 1}
        assert status["groups"] == {"delivered": 1}


def slime_args(url: str, engine: Server, input_file: Path, tokenizer: str, *flags: str, interval: int = 1
               ) -> argparse.Namespace:
    # A (loose) staleness bound makes every rollout fetch just what it needs, so each one reports its version.
    cli = ["--agent-rollout-buffer-url", url, "--rollout-task-type", "plan_act", "--rollout-buffer-wait-s", "2",
           "--rollout-buffer-lease-s", "60", "--fetch-trajectory-retry-times", "3", "--rollout-max-staleness", "100",
           *flags]
    args = add_arguments(argparse.ArgumentParser()).parse_args(cli)
    host, port = engine.url.removeprefix("http://").rsplit(":", 1)
    slime = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "prompt_data": str(input_file),
             "sglang_router_ip": host, "sglang_router_port": int(port), "rollout_max_response_len": 1024,
             "rollout_temperature": 1.0, "rollout_top_p": 1.0, "hf_checkpoint": tokenizer, "num_epoch": 1,
             "update_weights_interval": interval, "use_wandb": False, "use_tensorboard": False}
    for key, value in slime.items():
        setattr(args, key, value)
    return args


def test_two_slime_adapters_train_one_role_each(tmp_path: Path, engines: tuple[Server, Server],
                                                qwen_tokenizer_path: str, monkeypatch: pytest.MonkeyPatch,
                                                caplog: pytest.LogCaptureFixture) -> None:
    planner_engine, actor_engine = engines
    monkeypatch.setattr(run_control, "LEAD_POLL_S", 0.05)
    inp = write_rows(tmp_path / "in.jsonl", 4)
    with buffer_server(tmp_path, free_port()).start() as srv:
        planner_args = slime_args(srv.url, planner_engine, inp, qwen_tokenizer_path, "--rollout-buffer-role",
                                  "planner", "--rollout-buffer-role-engine-url", f"actor={actor_engine.url}")
        # The actor's trainer updates its weights every second step: its own versions.
        actor_args = slime_args(srv.url, actor_engine, inp, qwen_tokenizer_path, "--rollout-buffer-role", "actor",
                                interval=2)
        batches: dict[str, list[list[list[Any]]]] = {"planner": [], "actor": []}

        def train(role: str, args: argparse.Namespace) -> None:
            data_buffer = DataBuffer(2)
            for rollout_id in (1, 2):
                batches[role].append(generate_rollout(args, rollout_id, data_buffer))

        # The actor's trainer comes up first: it waits for the planner's to start the run.
        with caplog.at_level(logging.INFO, logger="slime_adapter.run_control"):
            actor = threading.Thread(target=train, args=("actor", actor_args))
            actor.start()
            deadline = time.monotonic() + 60
            while "actor trainer: waiting for the planner trainer to start the run" not in caplog.text:
                assert time.monotonic() < deadline and actor.is_alive(), caplog.text
                time.sleep(0.05)
        assert httpx.get(f"{srv.url}/status").json()["run"] is None
        train("planner", planner_args)
        actor.join(60)
        status = httpx.get(f"{srv.url}/status").json()
    assert status["run"]["config"]["planner_engine_url"] == planner_engine.url
    assert status["run"]["config"]["actor_engine_url"] == actor_engine.url
    for role, engine in (("planner", planner_engine), ("actor", actor_engine)):
        assert len(batches[role]) == 2 and all(len(b) == 2 for b in batches[role])
        samples = [s for batch in batches[role] for group in batch for s in group]
        assert {s.metadata["agent_id"] for s in samples} == {role}
        assert {e for s in samples for e in s.metadata["engines"]} == {engine.url}
        assert len({s.index for batch in batches[role] for group in batch for s in group}) == 4
    # Each trainer reported its own version: rollout 2 is version 2 for the planner, 1 for the actor.
    assert status["roles"]["planner"]["trainer_version"] == 2
    assert status["roles"]["actor"]["trainer_version"] == 1
    assert status["roles"]["planner"]["groups"] == {"delivered": 4}
    assert status["roles"]["actor"]["groups"] == {"delivered": 4}


def test_episode_id_is_the_session_and_a_down_engine_fails_the_episode(
        tmp_path: Path, engines: tuple[Server, Server], qwen_tokenizer_path: str) -> None:
    planner_engine, actor_engine = engines
    inp = write_rows(tmp_path / "in.jsonl", 1)
    with buffer_server(tmp_path, free_port()).start() as srv:
        # Actor turns may go to either engine: every turn of one episode goes to the same one.
        start_run(srv.url, engines, qwen_tokenizer_path, inp, actor_engine_url=[actor_engine.url, planner_engine.url])
        wait_finished(srv.url, timeout_s=30)
        actors = drain_role(srv.url, "actor")
        by_episode: dict[str, set[str]] = defaultdict(set)
        for r in actors:
            by_episode[r["extra_info"]["episode_id"]].update(r["extra_info"]["engines"])
        assert len(by_episode) == 2 and all(len(urls) == 1 for urls in by_episode.values())

        down = f"http://127.0.0.1:{free_port()}"
        start_run(srv.url, engines, qwen_tokenizer_path, write_rows(tmp_path / "one.jsonl", 1), actor_engine_url=down,
                  max_retries=1, engine_outage_s=0)
        status = wait_finished(srv.url, timeout_s=30)
        assert status["run"]["progress"]["failures"] == {"actor_engine_connection": 2}
        [group] = httpx.get(f"{srv.url}/groups", params={"run_id": status["run"]["run_id"]}).json()["groups"]
        assert group["state"] == "filtered" and group["reason"] == "failed_trajectory" and group["roles"] == {}
        record = httpx.get(f"{srv.url}/trajectories/{group['uids'][0]}").json()
        assert record["extra_info"]["error_kind"] == "actor_engine_connection"
        assert record["extra_info"]["error"].startswith(f"the actor engine is down: engine {down}")


def drain_role(url: str, role: str) -> list[dict]:
    records: list[dict] = []
    for _ in range(100):
        out = httpx.post(f"{url}/get_rollout_data", json={"agent_id": role}).json()
        if not out["success"]:
            return records
        records += out["data"]["data"]
    raise AssertionError("delivery did not end")


def test_role_flags_and_the_lead_trainers_start_payload() -> None:
    parser = add_arguments(argparse.ArgumentParser())
    base = ["--agent-rollout-buffer-url", "http://127.0.0.1:8889", "--rollout-task-type", "plan_act"]
    args = parser.parse_args([*base, "--rollout-buffer-role", "planner", "--rollout-buffer-role-engine-url",
                              "actor=http://10.0.0.2:30000"])
    for key, value in {"prompt_data": "in.jsonl", "n_samples_per_prompt": 2, "sglang_router_ip": "10.0.0.1",
                       "sglang_router_port": 30000, "rollout_batch_size": 2}.items():
        setattr(args, key, value)
    settings = AdapterSettings.from_args(args)
    assert settings.buffer_url == "http://127.0.0.1:8889" and settings.starts_run
    payload = run_control.start_payload(args, settings, [])
    assert payload["planner_engine_url"] == payload["remote_engine_url"] == "http://10.0.0.1:30000"
    assert payload["actor_engine_url"] == "http://10.0.0.2:30000"
    actor = AdapterSettings.from_args(parser.parse_args([*base, "--rollout-buffer-role", "actor"]))
    assert not actor.starts_run and actor.lead_role == "planner"
    with pytest.raises(ValueError, match="--rollout-buffer-role-engine-url: 'actor' is not ROLE=http"):
        AdapterSettings.from_args(parser.parse_args([*base, "--rollout-buffer-role-engine-url", "actor"]))


def wait_admission(url: str, state: str, started: int) -> dict:
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/status").json()
        admission = status["control"]["admission"]
        if admission["state"] == state and admission["started_groups"] == started:
            return status
        time.sleep(0.05)
    raise AssertionError(f"admission never reached {state} with {started} started: {status['control']}")


def test_generation_waits_for_the_slowest_role(tmp_path: Path, engines: tuple[Server, Server],
                                               qwen_tokenizer_path: str) -> None:
    for e in engines:
        set_engine_version(e, 0)
    with buffer_server(tmp_path, free_port()).start() as srv:
        # η = 0, one group per step: generation stays one group ahead of the slower trainer.
        start_run(srv.url, engines, qwen_tokenizer_path, write_rows(tmp_path / "in.jsonl", 3), max_staleness=0,
                  rollout_batch_size=1)
        wait_admission(srv.url, "paused_staleness", 1)
        for role in ("planner", "actor"):
            body = {"agent_id": role, "wait_s": 20, "lease_s": 60, "current_version": 0}
            assert httpx.post(f"{srv.url}/get_rollout_data", json=body, timeout=30).json()["success"]
        # The planner's trainer moves on; the actor's has not: still paused.
        version = {"current_version": 1, "agent_id": "planner"}
        assert httpx.post(f"{srv.url}/trainer_version", json=version).json()["trainer_version"] == 1
        status = wait_admission(srv.url, "paused_staleness", 1)
        assert status["control"]["roles"]["planner"]["trainer_steps"] == 1
        assert status["control"]["roles"]["actor"]["trainer_steps"] == 0
        # Once the actor's trainer updates too, the next group starts.
        httpx.post(f"{srv.url}/trainer_version", json={"current_version": 1, "agent_id": "actor"}).raise_for_status()
        wait_admission(srv.url, "paused_staleness", 2)
