"""Fully asynchronous control end to end: the buffer and simulated SGLang engines over real HTTP, a trainer that
fetches slowly and bumps the engines' weight version (`/pause_generation`, `/update_weight_version`,
`/continue_generation`) the way slime does between steps."""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from runs import drain, math_rows, start, wait_finished, write_jsonl
from servers import Server, free_port
from servers import sim_engine as start_sim_engine

from rollout_buffer.delivery.versions import engine_version
from rollout_buffer.tools import status as status_cli
from slime_adapter import add_arguments, generate_rollout
from slime_adapter.data_buffer import DataBuffer
from slime_adapter.run_control import trainer_version


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, qwen_tokenizer_path: str) -> Iterator[Server]:
    with start_sim_engine(tmp_path_factory.mktemp("sim"), qwen_tokenizer_path, "--latency-ms", "30",
                          "--correct-rate", "0.5") as srv:
        yield srv


@pytest.fixture
def buffer(tmp_path: Path) -> Iterator[Server]:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--group-size", "2"]
    with Server(args, "/healthz", port, tmp_path / "buffer.log").start() as srv:
        yield srv


def status(url: str) -> dict[str, Any]:
    return httpx.get(f"{url}/status", timeout=10).json()


def admission(url: str) -> dict[str, Any]:
    return status(url)["control"]["admission"]


def wait_for(what: Callable[[], Any], timeout_s: float = 30, every_s: float = 0.05) -> Any:
    """Poll `what()` until it returns something truthy (bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if value := what():
            return value
        time.sleep(every_s)
    raise TimeoutError(f"condition not met in {timeout_s}s")


def settled(url: str) -> dict[str, Any]:
    """Admission once it has decided on every change reported so far (instead of waiting a while to see that
    nothing starts)."""
    return wait_for(lambda: (lambda a: a if a.get("decided_at_change") is not None
                             and a["decided_at_change"] >= a["ledger_changes"] else None)(admission(url)))


def paused_with(url: str, ready: int, state: str = "paused_staleness") -> Callable[[], dict | None]:
    """A condition: admission is in `state` and `ready` groups are complete (nothing in flight)."""

    def check() -> dict | None:
        s = status(url)
        adm = s["control"]["admission"]
        live = "started_groups" in adm  # the runner's view, not only the state the store kept
        done = s["run"]["progress"].get("in_flight") == 0 and s["groups"].get("ready", 0) == ready
        return s if live and adm.get("state") == state and done else None

    return check


# Tests that only count groups run in chat mode (no tokenizer_path): a run starts without loading a tokenizer.


def fetch(url: str, **body: Any) -> dict[str, Any]:
    """One leased fetch, acked; the answer's data."""
    r = httpx.post(f"{url}/get_rollout_data", json={"lease_s": 60, **body}, timeout=60)
    assert r.status_code == 200, r.text
    data = r.json()["data"]
    if data["meta_info"].get("batch_id"):
        httpx.post(f"{url}/ack", json={"batch_id": data["meta_info"]["batch_id"]}, timeout=10).raise_for_status()
    return data


def bump_engine(engine_url: str, version: int) -> None:
    """What slime does around a weight update: pause (aborting in-flight requests), new version, continue."""
    for path, body in (("/pause_generation", {"mode": "abort"}), ("/update_weight_version",
                       {"new_version": str(version)}), ("/continue_generation", {})):
        httpx.post(engine_url + path, json=body, timeout=10).raise_for_status()


def total_groups(url: str) -> int:
    return sum(status(url)["groups"].values())


def test_admission_pauses_and_resumes_with_exact_counts(tmp_path, engine, buffer, capsys, monkeypatch) -> None:
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(40))
    start(buffer.url, engine.url, inp, None, num_repeat_per_sample=2, max_staleness=1,
          rollout_batch_size=2, current_version=0)
    # (η + 1) × B = 4 groups may start before the trainer moves.
    s = wait_for(paused_with(buffer.url, ready=4))
    adm = s["control"]["admission"]
    assert (adm["started_groups"], adm["groups_ahead"], adm["capacity"]) == (4, 4, 0)
    settled(buffer.url)
    assert total_groups(buffer.url) == 4

    # The trainer takes a batch and trains on it with version 0: nothing more may start yet.
    data = fetch(buffer.url, max_groups=2, current_version=0)
    assert data["meta_info"]["num_groups"] == 2 and data["meta_info"]["admission_state"] == "paused_staleness"
    assert data["meta_info"]["trainer_version"] == 0 and data["meta_info"]["max_version_lag"] == 0
    assert settled(buffer.url)["started_groups"] == 4
    # A second batch without a new version: consumption alone counts one step, two more groups.
    fetch(buffer.url, max_groups=2, current_version=0)
    s = wait_for(paused_with(buffer.url, ready=2))
    assert (s["control"]["admission"]["started_groups"], s["control"]["admission"]["groups_ahead"]) == (6, 2)

    # A version the consumption already accounts for releases nothing; two versions more do.
    assert httpx.post(f"{buffer.url}/trainer_version", json={"current_version": 1}).json()["trainer_version"] == 1
    assert settled(buffer.url)["started_groups"] == 6
    httpx.post(f"{buffer.url}/trainer_version", json={"current_version": "3"}).raise_for_status()
    s = wait_for(paused_with(buffer.url, ready=6))
    adm = s["control"]["admission"]
    assert (adm["started_groups"], adm["groups_ahead"], adm["trainer_steps"]) == (10, 6, 3)
    assert s["control"]["trainer_version"] == 3 and s["control"]["base_version"] == 0
    scrape = httpx.get(f"{buffer.url}/metrics").text
    assert 'rollout_buffer_admission_state{state="paused_staleness"} 1.0' in scrape
    assert "rollout_buffer_groups_ahead 6.0" in scrape and "rollout_buffer_trainer_version 3.0" in scrape
    monkeypatch.setenv("COLUMNS", "160")
    status_cli.main(["--url", buffer.url])
    out = capsys.readouterr().out
    assert "trainer 3  engines " in out and "admission paused_staleness  6 groups ahead (η 1, capacity 0)" in out


def test_ready_cap_pauses_generation_until_the_trainer_takes_groups(tmp_path, engine, buffer) -> None:
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(20))
    start(buffer.url, engine.url, inp, None, num_repeat_per_sample=2, max_ready_groups=3)
    s = wait_for(paused_with(buffer.url, ready=3, state="paused_cap"))
    assert (s["control"]["admission"]["started_groups"], s["control"]["admission"]["groups_ahead"]) == (3, 3)
    settled(buffer.url)
    assert total_groups(buffer.url) == 3
    fetch(buffer.url, max_groups=2)
    s = wait_for(paused_with(buffer.url, ready=3, state="paused_cap"))
    assert s["control"]["admission"]["started_groups"] == 5


def test_no_delivered_group_lags_more_than_eta_while_versions_move(tmp_path, engine, buffer,
                                                                   qwen_tokenizer_path) -> None:
    eta, batch = 1, 2
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(60))
    httpx.post(engine.url + "/update_weight_version", json={"new_version": "0"}).raise_for_status()
    start(buffer.url, engine.url, inp, qwen_tokenizer_path, num_repeat_per_sample=2, num_process=8,
          max_staleness=eta, rollout_batch_size=batch, current_version=0)
    lags: list[int] = []
    version = 0
    for _ in range(6):  # six trainer steps
        groups = 0
        while groups < batch:
            data = fetch(buffer.url, max_groups=batch - groups, wait_s=20, current_version=version)
            groups += data["meta_info"]["num_groups"]
            lags += [version - engine_version(r["extra_info"]["weight_version_min"]) for r in data["data"]]
            assert data["meta_info"].get("max_version_lag", 0) <= eta
        time.sleep(0.3)  # training
        version += 1
        bump_engine(engine.url, version)
    assert len(lags) == 6 * batch * 2 and max(lags) <= eta and 1 in lags
    s = status(buffer.url)
    # Nothing silently lost: every group started is waiting, consumed, or dropped with a reason.
    assert set(s["filtered"]) <= {"stale"}
    assert sum(s["groups"].values()) == s["control"]["admission"]["started_groups"]


def test_partial_rollout_keeps_tokens_and_segment_versions(tmp_path, buffer, qwen_tokenizer,
                                                           qwen_tokenizer_path) -> None:
    """A weight update aborts two turns mid-way; each resumes on the new weights from its partial tokens. The
    second run masks the tokens of the older weights (mask_offpolicy_in_partial_rollout)."""
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(1))
    im_end = qwen_tokenizer.convert_tokens_to_ids("<|im_end|>")
    with start_sim_engine(tmp_path, qwen_tokenizer_path, "--latency-ms", "1500", "--correct-rate", "1") as slow:
        for mask, old, new in ((False, "default", "1"), (True, "1", "2")):
            start(buffer.url, slow.url, inp, qwen_tokenizer_path, num_repeat_per_sample=2, num_process=2,
                  mask_offpolicy_in_partial_rollout=mask, max_abort_resumes=5)
            wait_for(lambda: httpx.get(slow.url + "/get_load").json()[0]["num_reqs"] == 2, every_s=0.01)
            time.sleep(0.2)
            bump_engine(slow.url, int(new))
            assert wait_finished(buffer.url)["run"]["progress"]["failed"] == 0
            records = drain(buffer.url)
            assert len(records) == 2
            for r in records:
                info = r["extra_info"]
                (s0, e0, v0), (s1, e1, v1) = info["weight_version_spans"]
                assert (v0, v1) == (old, new) and s0 < e0 == s1 < e1 and r["tokens"][e1 - 1] == im_end
                assert (info["weight_version_min"], info["weight_version_max"]) == (old, new)
                assert info["abort_resumes"] == 1 and r["status"] == "completed"
                # The tokens of both segments are the reply, unbroken.
                text = qwen_tokenizer.decode(r["tokens"][s0:e1], skip_special_tokens=True)
                assert text == r["messages"][-1]["content"]
                assert r["loss_mask"][s0:e0] == ([0] if mask else [1]) * (e0 - s0)
                assert r["loss_mask"][s1:e1] == [1] * (e1 - s1)


def test_stale_group_is_dropped_counted_and_regenerated_by_the_live_run(tmp_path, engine, buffer) -> None:
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(10))
    httpx.post(engine.url + "/update_weight_version", json={"new_version": "0"}).raise_for_status()
    start(buffer.url, engine.url, inp, None, num_repeat_per_sample=2, shuffle=False,
          max_staleness=0, rollout_batch_size=1, current_version=0, regenerate_stale=True)
    wait_for(paused_with(buffer.url, ready=1))  # group m0, generated with version 0
    httpx.post(engine.url + "/update_weight_version", json={"new_version": "2"}).raise_for_status()
    httpx.post(f"{buffer.url}/trainer_version", json={"current_version": 2}).raise_for_status()
    wait_for(paused_with(buffer.url, ready=3))  # m1 and m2, with version 2
    data = fetch(buffer.url, max_groups=2, current_version=2)
    meta = data["meta_info"]
    assert {r["instance_id"] for r in data["data"]} == {"m1", "m2"}
    assert (meta["stale_groups"], meta["regenerated_groups"], meta["filtered_groups"]) == (1, 1, {"stale": 1})
    stale = httpx.get(f"{buffer.url}/groups", params={"state": "filtered"}).json()["groups"]
    assert [(g["instance_id"], g["part"], g["reason"]) for g in stale] == [("m0", 0, "stale")]
    # The regeneration takes the next admission ahead of the schedule's m3.
    again = fetch(buffer.url, max_groups=1, wait_s=20, current_version=2)["data"]
    assert {r["instance_id"] for r in again} == {"m0"}
    assert all(r["uid"].endswith(":1") and r["extra_info"]["group_part"] == 1
               and r["extra_info"]["weight_version_min"] == "2" for r in again)
    scrape = httpx.get(f"{buffer.url}/metrics").text
    assert "rollout_buffer_groups_stale_total 1.0" in scrape and "rollout_buffer_groups_regenerated_total 1.0" in scrape
    assert status(buffer.url)["run"]["progress"]["regenerated"] == 1


def test_stale_group_of_a_finished_run_is_generated_again_after_a_restart(tmp_path, engine) -> None:
    """A finished run runs again for its stale groups, also when the buffer was killed between the drop and the
    regeneration (the open parts are in the store)."""
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(2))
    httpx.post(engine.url + "/update_weight_version", json={"new_version": "0"}).raise_for_status()
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    srv = Server(args, "/healthz", port, tmp_path / "buffer.log").start()
    try:
        # Chat mode (no tokenizer to load at each start): versions come from the answers' metadata.
        start(srv.url, engine.url, inp, None, num_repeat_per_sample=2, max_staleness=1,
              rollout_batch_size=1, current_version=0, regenerate_stale=True)
        assert wait_finished(srv.url)["groups"] == {"ready": 2}
        httpx.post(engine.url + "/update_weight_version", json={"new_version": "5"}).raise_for_status()
        data = fetch(srv.url, current_version=5)  # both groups are 5 behind: dropped, queued again
        assert data["meta_info"]["num_groups"] == 0 and data["meta_info"]["stale_groups"] == 2
        srv.kill9()
        srv.start()
        records = []
        for _ in range(2):
            records += fetch(srv.url, max_groups=2, wait_s=20, current_version=5)["data"]
            if len(records) == 4:
                break
        assert sorted(r["instance_id"] for r in records) == ["m0", "m0", "m1", "m1"]
        assert {r["extra_info"]["weight_version_min"] for r in records} == {"5"}
        assert wait_finished(srv.url)["run"]["state"] == "finished"
    finally:
        srv.stop()


def test_kill9_while_paused_resumes_in_the_same_state(tmp_path, engine) -> None:
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(10))
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data")]
    srv = Server(args, "/healthz", port, tmp_path / "buffer.log").start()
    try:
        start(srv.url, engine.url, inp, None, num_repeat_per_sample=2, max_staleness=0,
              rollout_batch_size=2, current_version=4)
        before = wait_for(paused_with(srv.url, ready=2))["control"]
        srv.kill9()
        srv.start()
        assert admission(srv.url)["state"] == "paused_staleness"  # from the store, before the runner is back
        after = wait_for(paused_with(srv.url, ready=2))["control"]
        for key in ("state", "started_groups", "groups_ahead", "capacity"):
            assert after["admission"][key] == before["admission"][key], key
        assert (after["trainer_version"], after["base_version"]) == (4, 4)
        settled(srv.url)
        assert total_groups(srv.url) == 2
        fetch(srv.url, max_groups=2, current_version=5)  # the trainer moved on: generation resumes
        s = wait_for(paused_with(srv.url, ready=2))
        assert s["control"]["admission"]["started_groups"] == 4
    finally:
        srv.stop()


def test_trajectory_aborted_beyond_its_resumes_goes_back_to_the_queue(tmp_path, engine, buffer,
                                                                       qwen_tokenizer_path) -> None:
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(1))
    httpx.post(engine.url + "/sim/faults", json={"next": ["abort", "abort"]}).raise_for_status()
    start(buffer.url, engine.url, inp, qwen_tokenizer_path, num_repeat_per_sample=2, num_process=1,
          max_abort_resumes=1)
    s = wait_finished(buffer.url)
    assert s["run"]["progress"]["requeued"] == 1 and s["run"]["progress"]["failed"] == 0
    records = drain(buffer.url)
    assert len(records) == 2 and {r["status"] for r in records} == {"completed"}
    assert "rollout_buffer_trajectories_requeued_total 1.0" in httpx.get(f"{buffer.url}/metrics").text


def test_bad_versions_and_bounds_get_4xx_naming_the_field(tmp_path, engine, buffer) -> None:
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(2))
    httpx.post(engine.url + "/update_weight_version", json={"new_version": "default"}).raise_for_status()
    assert httpx.post(f"{buffer.url}/trainer_version", json={"current_version": 1}).status_code == 409
    base = {"task_type": "math", "input_file": str(inp), "remote_engine_url": engine.url}
    for bad, field in (({"max_staleness": -1, "rollout_batch_size": 2}, "max_staleness"),
                       ({"max_staleness": 1.5, "rollout_batch_size": 2}, "max_staleness"),
                       ({"max_staleness": "x", "rollout_batch_size": 2}, "max_staleness"),
                       ({"max_staleness": True, "rollout_batch_size": 2}, "max_staleness"),
                       ({"max_staleness": 1}, "rollout_batch_size"),
                       ({"max_staleness": 1, "rollout_batch_size": 0}, "rollout_batch_size"),
                       ({"current_version": "v3"}, "current_version")):
        r = httpx.post(f"{buffer.url}/start_rollout", json={**base, **bad})
        assert r.status_code == 422 and field in r.json()["message"], (bad, r.text)
    start(buffer.url, engine.url, inp, None, num_repeat_per_sample=2)
    wait_finished(buffer.url)
    for body in ({"current_version": "abc"}, {"current_version": -2}, {"current_version": 1.5},
                 {"current_version": False}, {"order": "random"}):
        r = httpx.post(f"{buffer.url}/get_rollout_data", json=body)
        assert r.status_code == 422 and next(iter(body)) in r.json()["message"], (body, r.text)
    assert httpx.post(f"{buffer.url}/trainer_version", json={"current_version": "7"}).status_code == 200
    for path in ("/trainer_version", "/get_rollout_data"):
        r = httpx.post(f"{buffer.url}{path}", json={"current_version": 6})
        assert r.status_code == 409 and "current_version: 6 is older than the trainer version 7" in r.json()["message"]
    r = httpx.post(f"{buffer.url}/trainer_version", json={"current_version": 6, "rewind": True})
    assert r.status_code == 200 and r.json()["trainer_version"] == 6
    # A trainer far ahead of the engines is shown and logged, not refused.
    assert httpx.post(f"{buffer.url}/trainer_version", json={"current_version": 50}).status_code == 200
    control = status(buffer.url)["control"]
    assert (control["engine_version"], control["trainer_lead"]) == (0, 50)
    assert "50 versions ahead of the newest engine version" in buffer.log()


def test_delivery_order_oldest_or_newest(buffer) -> None:
    def group(iid: str) -> list[dict]:
        return [{"uid": f"{iid}-{k}", "instance_id": iid, "reward": float(k),
                 "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
                for k in range(2)]

    for iid in ("a", "b", "c"):
        httpx.post(f"{buffer.url}/buffer/write", json=group(iid)).raise_for_status()
    take = lambda order: {r["instance_id"] for r in fetch(buffer.url, max_groups=1, order=order)["data"]}  # noqa: E731
    assert (take("newest"), take("oldest"), take("newest")) == ({"c"}, {"a"}, {"b"})


def test_slime_adapter_drives_a_bounded_run(tmp_path, engine, buffer, qwen_tokenizer_path, caplog) -> None:
    """slime's loop through the adapter: the start payload carries the bound, every fetch the rollout's version,
    and the engines move to the next version after each training step."""
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(40))
    host, port = engine.url.removeprefix("http://").split(":")
    cli = ["--agent-rollout-buffer-url", buffer.url, "--rollout-task-type", "math", "--rollout-max-staleness", "1",
           "--rollout-buffer-wait-s", "10", "--rollout-buffer-lease-s", "30", "--rollout-num-process", "8"]
    args = add_arguments(argparse.ArgumentParser()).parse_args(cli)
    slime = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "prompt_data": str(inp), "sglang_router_ip": host,
             "sglang_router_port": int(port), "rollout_max_response_len": 256, "hf_checkpoint": qwen_tokenizer_path,
             "num_epoch": 1, "use_wandb": False, "use_tensorboard": False}
    for key, value in slime.items():
        setattr(args, key, value)
    bump_engine(engine.url, 0)
    data_buffer = DataBuffer(2)
    with caplog.at_level(logging.INFO, logger="slime_adapter.meta_info"):
        for rollout_id in range(3):
            batch = generate_rollout(args, rollout_id, data_buffer)
            assert len(batch) == 2 and data_buffer.get_buffer_length() == 0  # no surplus held by the trainer
            assert all(rollout_id - engine_version(s.weight_versions[0]) <= 1 for g in batch for s in g)
            bump_engine(engine.url, trainer_version(args, rollout_id + 1))  # slime's weight update
    s = status(buffer.url)
    assert {k: s["run"]["config"][k] for k in ("max_staleness", "rollout_batch_size", "current_version")} == {
        "max_staleness": 1, "rollout_batch_size": 2, "current_version": 0}
    assert (s["control"]["trainer_version"], s["control"]["base_version"]) == (2, 0)
    assert "rollout/staleness/max_version_lag" in caplog.text and "rollout/staleness/admission_" in caplog.text


def test_weights_swapped_under_an_unchanged_version_are_noticed(tmp_path, engine, buffer) -> None:
    """A weight load that does not set a version (or whose cache flush failed) leaves the engine reporting the old
    one: the run's weight watch sees the probe's log-probs move under it, and says so in /status and to the
    trainer; a versioned update is not taken for one."""
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(40))
    base = {"task_type": "math", "input_file": str(inp), "remote_engine_url": engine.url}
    for bad in ({"weight_probe_s": -1}, {"weight_probe_tolerance": 0}, {"weight_probe_s": "often"}):
        r = httpx.post(f"{buffer.url}/start_rollout", json={**base, **bad})
        assert r.status_code == 422 and next(iter(bad)) in r.json()["message"], (bad, r.text)
    # Admission holds the run after its first groups: it stays running while the engine's weights change.
    start(buffer.url, engine.url, inp, None, num_repeat_per_sample=2, max_staleness=0, rollout_batch_size=1,
          current_version=0, weight_probe_s=0.2)
    rounds = lambda: status(buffer.url)["control"].get("weights", {}).get("rounds", 0)  # noqa: E731
    wait_for(lambda: rounds() >= 2)
    for name, version in (("b", "77"), ("c", None)):
        (tmp_path / name).mkdir()
        load = {"model_path": str(tmp_path / name), **({"weight_version": version} if version else {})}
        httpx.post(f"{engine.url}/update_weights_from_disk", json=load, timeout=10).raise_for_status()
        seen = rounds()
        weights = wait_for(lambda: (lambda w: w if w["rounds"] > seen + 1 else None)(  # noqa: B023
            status(buffer.url)["control"]["weights"]))
        assert weights["unversioned_swaps"] == (0 if version else 1), weights
    [swap] = weights["swaps"]
    assert swap["engine"] == engine.url and swap["version"] == "77" and swap["moved"] > weights["tolerance"]
    assert "its weights changed while it kept reporting version 77" in buffer.log()
    assert fetch(buffer.url, max_groups=1)["meta_info"]["unversioned_weight_swaps"] == 1
