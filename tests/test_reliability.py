"""Reliability: kill -9 mid-rollout, lost responses, engine faults, fuzzed API, path confinement, full store.

The default sizes are the short form CI runs; `RB_LONG=1` selects the long variants (more items and SIGKILLs,
more fuzzing examples).
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import socket
import sqlite3
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import httpx
import orjson
import pytest
from runs import wait_finished
from servers import Server, free_port, running, stopped_while_long_polling

LONG = os.environ.get("RB_LONG") == "1"


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


def math_rows(n: int) -> list[dict]:
    return [{"instance_id": f"m{i}", "prompt": f"What is {i} + 1?", "label": str(i + 1)} for i in range(n)]


def buffer(tmp_path: Path, port: int, *extra: str, trusting: bool = True) -> Server:
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), *extra]
    return Server(args, "/healthz", port, tmp_path / "buffer.log", trusting=trusting)


class Consumer:
    """A leasing consumer that counts a record only once its batch's ack is confirmed.

    When the server dies between answering an ack and the client reading it, the batch is held as
    "unconfirmed": it counts if it never comes back (the ack was committed) and once if it does.
    """

    def __init__(self) -> None:
        self.confirmed: list[dict] = []
        self.unconfirmed: dict[str, dict] = {}

    def poll(self, url: str, lease_s: float = 5.0) -> bool:
        try:
            out = httpx.post(f"{url}/get_rollout_data", json={"lease_s": lease_s, "wait_s": 0.5}, timeout=10).json()
        except (httpx.HTTPError, ValueError):
            return False
        if not out["success"]:
            return False
        records = out["data"]["data"]
        for r in records:
            self.unconfirmed.pop(r["uid"], None)
        try:
            ack = httpx.post(f"{url}/ack", json={"batch_id": out["data"]["meta_info"]["batch_id"]}, timeout=10)
            ack.raise_for_status()
        except httpx.HTTPError:
            self.unconfirmed.update({r["uid"]: r for r in records})
            return False
        self.confirmed += records
        return True

    def all(self) -> list[dict]:
        return self.confirmed + list(self.unconfirmed.values())


def test_sigkill_mid_rollout_delivers_every_trajectory_once(tmp_path: Path, qwen_tokenizer_path: str) -> None:
    rng = random.Random(1234)
    n_items, epochs, repeats, kills = (40, 2, 4, 5) if LONG else (16, 2, 4, 3)
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(n_items))
    eport, bport = free_port(), free_port()
    engine_args = ["sim-engine", "--port", str(eport), "--tokenizer", qwen_tokenizer_path, "--latency-ms", "150"]
    consumer = Consumer()
    with running(engine_args, "/health", eport, tmp_path / "sim.log") as eng:
        srv = buffer(tmp_path, bport).start()
        payload = {"task_type": "math", "input_file": str(inp), "num_repeat_per_sample": repeats,
                   "num_epoch": epochs, "num_process": 8, "remote_engine_url": eng.url,
                   "tokenizer_path": qwen_tokenizer_path, "max_tokens": 128}
        httpx.post(f"{srv.url}/start_rollout", json=payload, timeout=30).raise_for_status()
        try:
            for _ in range(kills):
                deadline = time.monotonic() + rng.uniform(0.4, 1.5)
                while time.monotonic() < deadline:
                    consumer.poll(srv.url)
                srv.kill9()
                srv = buffer(tmp_path, bport).start()
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline:
                if consumer.poll(srv.url):
                    continue
                status = httpx.get(f"{srv.url}/status").json()
                if status["run"]["state"] == "finished" and not status["groups"].get("ready"):
                    if not status["groups"].get("leased") and not consumer.poll(srv.url, lease_s=5):
                        break
            generated = httpx.get(f"{eng.url}/sim/stats").json()["by_endpoint"]["/generate"]
        finally:
            srv.stop()
    assert status["run"]["state"] == "finished", "the run finishes by itself after restarts"
    records = consumer.all()
    uids = [r["uid"] for r in consumer.confirmed]
    assert len(uids) == len(set(uids)), "a uid was delivered twice"
    seen = Counter((r["instance_id"], r["extra_info"]["epoch"], r["extra_info"]["repeat"]) for r in records)
    expected = {(f"m{i}", e, k) for i in range(n_items) for e in range(epochs) for k in range(repeats)}
    assert set(seen) == expected and set(seen.values()) == {1}
    total = n_items * epochs * repeats
    # Only the trajectories in flight at each kill (num_process 8) may be generated twice.
    assert generated <= total + kills * 8, f"{generated - total} regenerations: complete groups came back"


def _raw_post(port: int, path: str, body: bytes) -> None:
    """Send a request and hang up without reading the answer (a client that died)."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
        s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        time.sleep(0.3)


def _group(url: str, instance_id: str) -> None:
    for k in range(2):
        rec = {"uid": f"{instance_id}-{k}", "instance_id": instance_id, "reward": float(k), "extra_info": {},
               "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
        httpx.post(f"{url}/buffer/write", json=rec).raise_for_status()


def test_lost_responses_come_back_after_the_lease(tmp_path: Path) -> None:
    port = free_port()
    with buffer(tmp_path, port, "--group-size", "2").start() as srv:
        _group(srv.url, "g1")
        _raw_post(port, "/get_rollout_data", b'{"lease_s": 3.0}')  # answered into a closed socket
        lease_ends = time.monotonic() + 3
        for _ in range(100):  # the hung-up request is served, however late, before the next one is asked
            if httpx.get(f"{srv.url}/status").json()["groups"].get("leased"):
                break
            time.sleep(0.02)
        assert httpx.post(f"{srv.url}/get_rollout_data", json={"lease_s": 1}).json()["success"] is False
        time.sleep(max(0.0, lease_ends - time.monotonic()) + 0.2)
        again = httpx.post(f"{srv.url}/get_rollout_data", json={"lease_s": 30}).json()
        assert {r["instance_id"] for r in again["data"]["data"]} == {"g1"}
        # A client that never acks gets the same group again too (after its lease); once acked it never returns.
        assert httpx.post(f"{srv.url}/get_rollout_data", json={"lease_s": 30}).json()["success"] is False
        httpx.post(f"{srv.url}/ack", json={"batch_id": again["data"]["meta_info"]["batch_id"]}).raise_for_status()
        assert httpx.post(f"{srv.url}/get_rollout_data", json={"wait_s": 1.5}).json()["success"] is False


def test_hung_up_long_poll_takes_nothing(tmp_path: Path) -> None:
    port = free_port()
    with buffer(tmp_path, port, "--group-size", "2").start() as srv:
        # slime's original client (no lease) gives up on a long-poll; the group completing later must stay.
        _raw_post(port, "/get_rollout_data", b'{"wait_s": 3}')
        _group(srv.url, "late")
        deadline = time.monotonic() + 30  # the long-poll ends: its client gone, or its 3 s over
        while "rollout_buffer_long_polls 0.0" not in httpx.get(f"{srv.url}/metrics").text:
            assert time.monotonic() < deadline, "the long-poll ended"
            time.sleep(0.05)
        out = httpx.post(f"{srv.url}/get_rollout_data", json={}).json()
        assert {r["instance_id"] for r in out["data"]["data"]} == {"late"}


def test_engine_faults_end_in_completed_or_failed_with_reason(tmp_path: Path, qwen_tokenizer_path: str) -> None:
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(12))
    eport, bport = free_port(), free_port()
    engine_args = ["sim-engine", "--port", str(eport), "--tokenizer", qwen_tokenizer_path, "--error-rate", "0.5",
                   "--abort-rate", "0.1", "--error-kinds", "http_500,reset,truncated_json,hang", "--hang-s", "30",
                   "--seed", "7"]
    with running(engine_args, "/health", eport, tmp_path / "sim.log") as eng, buffer(tmp_path, bport).start() as srv:
        payload = {"task_type": "math", "input_file": str(inp), "num_repeat_per_sample": 4, "num_process": 16,
                   "remote_engine_url": eng.url, "tokenizer_path": qwen_tokenizer_path, "max_tokens": 128,
                   "max_retries": 2, "backoff_s": 0.05, "timeout_s": 1.0, "engine_outage_s": 0}
        httpx.post(f"{srv.url}/start_rollout", json=payload, timeout=30).raise_for_status()
        deadline = time.monotonic() + 120
        while (status := httpx.get(f"{srv.url}/status").json())["run"]["state"] == "running":
            assert time.monotonic() < deadline
            assert httpx.get(f"{srv.url}/healthz").status_code == 200, "the buffer keeps serving"
            time.sleep(0.2)
        faults = httpx.get(f"{eng.url}/sim/stats").json()["faults"]
        exposition = httpx.get(f"{srv.url}/metrics").text
        failed = [httpx.get(f"{srv.url}/trajectories/{status['run']['run_id']}:m{i}:0:{k}").json()
                  for i in range(12) for k in range(4)]
    progress = status["run"]["progress"]
    assert sum(faults.values()) > 0
    assert progress["done"] + progress["failed"] == 48, "every trajectory ends completed or failed"
    assert progress["done"] > 0 and progress["failed"] > 0, "retries absorb most faults, not all"
    assert status["records"].get("failed", 0) == progress["failed"] == sum(progress["failures"].values())
    from prometheus_client.parser import text_string_to_metric_families

    by_reason = {s.labels["reason"]: s.value for fam in text_string_to_metric_families(exposition)
                 if fam.name == "rollout_buffer_trajectories_failed" for s in fam.samples
                 if s.name.endswith("_total")}
    assert {k: v for k, v in by_reason.items() if v} == {k: float(v) for k, v in progress["failures"].items()}
    for rec in failed:
        assert rec["status"] in ("completed", "failed", "aborted")
        if rec["status"] == "failed":
            assert rec["extra_info"]["error_kind"].startswith("engine_") and rec["extra_info"]["error"]


def test_fuzzed_get_rollout_data_bodies(tmp_path: Path) -> None:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as hs

    scalars = hs.none() | hs.booleans() | hs.integers() | hs.floats(allow_nan=True) | hs.text(max_size=20)
    values = hs.recursive(scalars, lambda c: hs.lists(c, max_size=4) | hs.dictionaries(hs.text(max_size=8), c,
                                                                                         max_size=4), max_leaves=12)
    field = hs.sampled_from(["max_groups", "wait_s", "lease_s", "ack", "other"])
    bodies = hs.dictionaries(field, values, max_size=5) | values
    port = free_port()
    with buffer(tmp_path, port, "--group-size", "1").start() as srv, httpx.Client(timeout=10) as client:
        _group_of_one = {"uid": "only", "instance_id": "i", "reward": 1.0, "extra_info": {},
                         "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
        client.post(f"{srv.url}/buffer/write", json=_group_of_one).raise_for_status()

        @settings(max_examples=300 if LONG else 80, deadline=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(bodies)
        def check(body: object) -> None:
            if isinstance(body, dict) and isinstance(body.get("wait_s"), int | float):
                body["wait_s"] = min(abs(body["wait_s"]), 0.1) if body["wait_s"] == body["wait_s"] else 0
            # stdlib json writes what orjson refuses (NaN, integers beyond 64 bits): a client may send those.
            resp = client.post(f"{srv.url}/get_rollout_data", content=json.dumps(body).encode(),
                               headers={"content-type": "application/json"})
            assert resp.status_code < 500, resp.text

        check()
        assert client.get(f"{srv.url}/healthz").json() == {"ok": True}


@pytest.mark.parametrize(
    "body",
    [
        b'{"uid": "u", "instance_id": "i", "messages": [], "reward": Infinity}',
        b'{"uid": "u", "instance_id": "i", "messages": [], "reward": 1e999}',
        b'{"uid": "u", "instance_id": "i", "reward": 1.0}',
        b'{"uid": "", "instance_id": "i", "messages": [], "reward": 1.0}',
        b'{"uid": "u", "instance_id": "i", "messages": [], "reward": 1.0, "tokens": [1, 2], "loss_mask": [1],'
        b' "response_length": 5}',
        b'\xc3\x28',
        b'{"a": ' * 3000 + b"1" + b"}" * 3000,
    ],
)
def test_bad_records_are_refused_and_nothing_is_stored(tmp_path: Path, body: bytes) -> None:
    port = free_port()
    with buffer(tmp_path, port).start() as srv:
        resp = httpx.post(f"{srv.url}/buffer/write", content=body, headers={"content-type": "application/json"})
        assert 400 <= resp.status_code < 500 and resp.json()["message"]
        assert httpx.get(f"{srv.url}/status").json()["records"] == {}


def test_paths_are_confined_to_data_roots(tmp_path: Path) -> None:
    root = tmp_path / "root"
    root.mkdir()
    inside = write_jsonl(root / "in.jsonl", math_rows(1))
    outside = write_jsonl(tmp_path / "secret.jsonl", math_rows(1))
    (root / "escape.jsonl").symlink_to(outside)
    port = free_port()
    with buffer(tmp_path, port, "--data-root", str(root), trusting=False).start() as srv:
        def start(path: str, **over) -> httpx.Response:
            return httpx.post(f"{srv.url}/start_rollout",
                              json={"task_type": "math", "input_file": path, **over}, timeout=30)

        for path in (str(outside), str(root / ".." / "secret.jsonl"), str(root / "escape.jsonl"), "/etc/passwd"):
            resp = start(path)
            assert resp.status_code == 403 and "input_file" in resp.json()["message"], path
        resp = start(str(inside), tokenizer_path="/usr")
        assert resp.status_code == 403 and "tokenizer_path" in resp.json()["message"]
        resp = start(str(inside), task_type="tool_call", tool_config_path=str(outside))
        assert resp.status_code == 403 and "tool_config_path" in resp.json()["message"]
        assert start(str(inside), remote_engine_url=f"http://127.0.0.1:{free_port()}", max_retries=0).status_code == 200


def test_default_bind_is_loopback() -> None:
    from rollout_buffer.config import ServerConfig

    assert ServerConfig().host == "127.0.0.1"


def test_full_store_answers_503_and_keeps_what_it_had(tmp_path: Path) -> None:
    port = free_port()
    with buffer(tmp_path, port, "--group-size", "2", "--max-db-mb", "0.3").start() as srv:
        answered, refused = [], None
        for i in range(2000):
            rec = {"uid": f"u{i}", "instance_id": f"i{i // 2}", "reward": 1.0, "extra_info": {"pad": "x" * 2000},
                   "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
            resp = httpx.post(f"{srv.url}/buffer/write", json=rec)
            if resp.status_code != 200:
                refused = resp
                break
            answered.append(rec["uid"])
        assert refused is not None and refused.status_code == 503
        assert "full" in refused.json()["message"]
        assert httpx.get(f"{srv.url}/healthz").status_code == 200
        for uid in answered[-5:]:
            assert httpx.get(f"{srv.url}/trajectories/{uid}").status_code == 200
        # Reads (and acks, which free nothing but need no new pages) still work.
        out = httpx.post(f"{srv.url}/get_rollout_data", json={"max_groups": 2}).json()
        assert out["success"] is True


def test_a_run_whose_store_fills_stops_saying_so_and_resumes_after_a_restart_with_room(
        tmp_path: Path, qwen_tokenizer_path: str) -> None:
    n_items, repeats = 64, 4
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(n_items))
    eport, bport = free_port(), free_port()
    engine_args = ["sim-engine", "--port", str(eport), "--tokenizer", qwen_tokenizer_path]
    with running(engine_args, "/health", eport, tmp_path / "sim.log") as eng:
        payload = {"task_type": "math", "input_file": str(inp), "num_repeat_per_sample": repeats,
                   "remote_engine_url": eng.url, "tokenizer_path": qwen_tokenizer_path, "max_tokens": 256}
        with buffer(tmp_path, bport, "--max-db-mb", "0.3").start() as srv:
            run_id = httpx.post(f"{srv.url}/start_rollout", json=payload, timeout=30).json()["run_id"]
            deadline = time.monotonic() + 60
            while (run := httpx.get(f"{srv.url}/status").json()["run"])["state"] == "running":
                assert time.monotonic() < deadline, run["progress"]
                time.sleep(0.1)
            # The trainer's client, the dashboard and the metrics see the run stopped and why, though the
            # full store could not record it.
            assert run["state"] == "failed", run
            assert "full" in run["error"] and "the run resumes where it stopped" in run["error"], run["error"]
            assert f'rollout_buffer_run_info{{run_id="{run_id}",state="failed",task_type="math"}} 1.0' in \
                httpx.get(f"{srv.url}/metrics").text
            status = httpx.get(f"{srv.url}/status").json()
            assert "full" in status["store"]["last_refusal"]["error"]
            assert status["control"]["admission"]["state"] == "ended", status["control"]  # not its gate's last state
            shown = subprocess.run([sys.executable, "-m", "rollout_buffer", "status", "--url", srv.url],
                                   capture_output=True, text=True, timeout=60,
                                   env={**os.environ, "COLUMNS": "300"}).stdout
            assert "failed" in shown and "refused a write" in shown and "resumes where it stopped" in shown, shown
            assert "admission ended" in shown and "admission running" not in shown, shown
        with contextlib.closing(sqlite3.connect(tmp_path / "data" / "buffer.sqlite")) as db:
            stored_before = db.execute("SELECT count(*) FROM trajectories").fetchone()[0]
        assert 0 < stored_before < n_items * repeats
        # With room, the next start resumes the run: every trajectory stored once, every group whole.
        with buffer(tmp_path, bport).start() as srv:
            status = wait_finished(srv.url, timeout_s=120)
        assert status["run"]["run_id"] == run_id and status["run"]["state"] == "finished", status["run"]
        with contextlib.closing(sqlite3.connect(tmp_path / "data" / "buffer.sqlite")) as db:
            assert db.execute("PRAGMA integrity_check").fetchone() == ("ok",)
            assert db.execute("SELECT count(*), count(DISTINCT instance_id) FROM trajectories").fetchone() == \
                (n_items * repeats, n_items)
            assert dict(db.execute("SELECT state, count(*) FROM groups GROUP BY state").fetchall()) == \
                {"ready": n_items}


POISON_AGENT = '''#!/usr/bin/python3
"""One turn through its session, then a reward no float sum survives in result.json."""
import json, os, urllib.request

request = urllib.request.Request(os.environ["OPENAI_BASE_URL"] + "/chat/completions", data=json.dumps(
    {"model": "m", "messages": [{"role": "user", "content": "What is 2 + 2?"}], "max_tokens": 8}).encode(),
    headers={"content-type": "application/json", "authorization": "Bearer " + os.environ["OPENAI_API_KEY"]})
urllib.request.urlopen(request, timeout=60).read()
with open("result.json", "w") as f:
    f.write('{"reward": 1e308}')
'''


def test_a_poisoned_reward_drops_its_own_group_and_the_store_still_starts(tmp_path: Path,
                                                                          qwen_tokenizer_path: str) -> None:
    """1e308 passes a finiteness check and overflows a group's normalization: it is refused at the edge (422 naming
    the field), dropped with its group where it arrives inside (an agent's result file, an episode reward), and a
    restart finishes and serves everything as before."""
    from readable import readable_copies
    from servers import sim_engine

    script = tmp_path / "poison_agent.py"
    script.write_text(POISON_AGENT)
    port = free_port()
    with sim_engine(tmp_path, qwen_tokenizer_path) as engine, readable_copies([script], "rb-poison-") as agents:
        srv = buffer(tmp_path, port, "--group-size", "2", "--allow-code", str(agents), trusting=False).start()
        try:
            for poison in (1e308, -1e308, 2e6):
                answer = httpx.post(f"{srv.url}/buffer/write", timeout=30, json={
                    "uid": "p", "instance_id": "p", "reward": poison, "messages": []})
                assert answer.status_code == 422 and "body.reward" in answer.json()["message"], answer.text
            for k in range(2):  # a well-formed record with an episode reward beyond any sum
                httpx.post(f"{srv.url}/buffer/write", timeout=30, json={
                    "uid": f"e{k}", "instance_id": "episodes", "reward": 0.5, "extra_info": {
                        "episode_id": f"ep{k}", "episode_reward": 1e308},
                    "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                }).raise_for_status()
            started = httpx.post(f"{srv.url}/start_rollout", timeout=60, json={
                "task_type": "agent", "input_file": str(Path(__file__).parent.parent / "generators" / "data" /
                                                        "tool_call_demo.jsonl"),
                "agent_command": [str(agents / script.name)], "remote_engine_url": engine.url,
                "tokenizer_path": qwen_tokenizer_path, "num_repeat_per_sample": 2, "num_epoch": 1,
                "failure_window": 1000})  # every trajectory is poisoned: the run must not fail for it (run_health)
            assert started.status_code == 200, started.text
            run_id = started.json()["run_id"]
            status = wait_finished(srv.url, timeout_s=180)
            assert status["run"]["state"] == "finished", (status["run"]["error"], status["run"]["progress"])
            groups = httpx.get(f"{srv.url}/groups", params={"state": "filtered", "limit": 1000}).json()["groups"]
            reasons = {g["instance_id"]: g["reason"] for g in groups}
            assert reasons.pop("episodes").startswith("reward_out_of_range"), reasons
            assert reasons and all(r == "failed_trajectory" for r in reasons.values()), reasons
            record = httpx.get(f"{srv.url}/trajectories/{run_id}:{next(iter(reasons))}:0:0").json()
            assert record["status"] == "failed" and "reward_out_of_range" in record["extra_info"]["error"], record
            srv.kill9()
            again = buffer(tmp_path, port, "--group-size", "2", trusting=False).start()
            try:
                assert httpx.get(f"{again.url}/groups", params={"state": "filtered", "limit": 1000}
                                 ).json()["groups"] == groups
                assert httpx.get(f"{again.url}/status").json()["run"]["state"] == "finished"
            finally:
                again.stop()
        finally:
            srv.stop()


def test_sigterm_answers_open_long_polls_and_exits_within_its_bound(tmp_path: Path) -> None:
    """A long-poll waits up to 10 minutes; a stop signal answers it (no batch) and the server exits in seconds,
    whether its client still listens or went away."""
    import signal

    from rollout_buffer.shortcuts.quiet_server import SHUTDOWN_GRACE_S

    port = free_port()
    srv = buffer(tmp_path, port, "--group-size", "2").start()
    try:
        answer, took = stopped_while_long_polling(
            srv, also=lambda: _raw_post(port, "/get_rollout_data", b'{"wait_s": 600}'), polls=2)  # a client gone
        assert answer.status_code == 200 and answer.json()["success"] is False, answer.text
        # uvicorn ends by raising the signal it caught again, after a clean shutdown.
        assert srv.proc is not None and srv.proc.returncode in (0, -signal.SIGTERM)
        assert took < SHUTDOWN_GRACE_S + 20, (took, srv.log()[-2000:])
        assert "Application shutdown complete" in srv.log()
        assert "stopping: open long-polls answered" in srv.log()
    finally:
        srv.stop()
    again = buffer(tmp_path, port, "--group-size", "2").start()  # and it starts again as it was
    try:
        assert httpx.get(f"{again.url}/status").status_code == 200
    finally:
        again.stop()


def test_an_engine_restart_pauses_the_run_and_loses_nothing(tmp_path: Path, qwen_tokenizer_path: str) -> None:
    """kill -9 of the engine mid-run, restarted well past the client's quick retries: the run waits (its outage on
    `/status` and `/metrics`), then every group is delivered; nothing failed or was dropped for the outage."""
    from runs import drain

    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(16))
    eport = free_port()
    engine_args = ["sim-engine", "--port", str(eport), "--tokenizer", qwen_tokenizer_path, "--latency-ms", "100"]
    engine = Server(engine_args, "/health", eport, tmp_path / "sim.log").start()
    with buffer(tmp_path, free_port(), "--group-size", "4").start() as srv:
        try:
            httpx.post(f"{srv.url}/start_rollout", timeout=30, json={
                "task_type": "math", "input_file": str(inp), "num_repeat_per_sample": 4, "num_process": 8,
                "remote_engine_url": engine.url, "tokenizer_path": qwen_tokenizer_path, "max_tokens": 64,
                "max_retries": 1, "backoff_s": 0.05}).raise_for_status()
            deadline = time.monotonic() + 60
            while httpx.get(f"{srv.url}/status").json()["run"]["progress"]["done"] < 8:
                assert time.monotonic() < deadline, "the run got going"
                time.sleep(0.05)
            engine.kill9()
            deadline = time.monotonic() + 60
            while True:  # the outage shows, and lasts well past the retries (two, 50 ms apart)
                outage = httpx.get(f"{srv.url}/status").json()["run"]["progress"].get("engine_outage")
                if outage is not None and outage["seconds"] >= 3:
                    break
                assert time.monotonic() < deadline, "the outage shows"
                time.sleep(0.1)
            assert outage["engines"] == [engine.url] and "connection" in outage["error"], outage
            metric = next(line for line in httpx.get(f"{srv.url}/metrics").text.splitlines()
                          if line.startswith("rollout_buffer_engine_outage_seconds "))
            assert float(metric.split()[1]) >= 3
            in_flight = httpx.get(f"{srv.url}/status").json()["run"]["progress"]["in_flight"]
            engine = Server(engine_args, "/health", eport, tmp_path / "sim.log").start()
            status = wait_finished(srv.url, timeout_s=180)
            records = drain(srv.url)
        finally:
            engine.stop()
    progress = status["run"]["progress"]
    assert status["run"]["state"] == "finished" and "engine_outage" not in progress, status["run"]
    assert progress["failed"] == 0 and progress["failures"] == {} and status["filtered"] == {}, progress
    assert in_flight > 0, "trajectories were waiting in flight, not failed"
    assert len(records) == 64 and {r["status"] for r in records} <= {"completed", "truncated"}
    prompts: dict[str, list[int]] = {}
    for r in records:  # exact tokens: log-probs for every response token, one prompt per instance
        response = r["response_length"]
        assert len(r["rollout_log_probs"]) == response > 0 and len(r["loss_mask"]) in (len(r["tokens"]), response)
        prompt = r["tokens"][:len(r["tokens"]) - response]
        assert prompts.setdefault(r["instance_id"], prompt) == prompt


def test_an_engine_that_never_answers_fails_the_run_with_the_reason(tmp_path: Path, qwen_tokenizer_path: str
                                                                     ) -> None:
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(4))
    with buffer(tmp_path, free_port()).start() as srv:
        started = httpx.post(f"{srv.url}/start_rollout", timeout=30, json={
            "task_type": "math", "input_file": str(inp), "remote_engine_url": f"http://127.0.0.1:{free_port()}",
            "tokenizer_path": qwen_tokenizer_path, "engine_outage_s": 2, "max_retries": 1, "backoff_s": 0.05})
        assert started.status_code == 200 and "did not answer /get_server_info" in started.json()["warnings"][0]
        status = wait_finished(srv.url, timeout_s=60)
        answer = httpx.post(f"{srv.url}/get_rollout_data", json={}).json()
    run = status["run"]
    assert run["state"] == "failed" and "did not answer for" in run["error"], run
    assert "engine_outage_s=2" in run["error"] and "failed:" in answer["message"], answer


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a tmpfs needs root")
def test_a_server_restarted_on_a_full_disk_serves_reads_and_refuses_writes(tmp_path: Path) -> None:
    """A tmpfs store filled to its last byte, the server killed and started again on it: it starts, serves what
    is stored (reads, trajectories, exports), refuses writes with 503 naming the cause, and takes them again once
    the disk has room."""
    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("no tmpfs can be mounted here")
    try:
        port = free_port()
        args = ["serve", "--port", str(port), "--data-dir", str(disk / "data"), "--group-size", "2"]
        srv = Server(args, "/healthz", port, tmp_path / "full.log").start()
        for g in range(10):
            _group(srv.url, f"g{g}")
        filler = disk / "filler"
        with open(filler, "wb") as f:  # the disk full to its last byte
            with contextlib.suppress(OSError):
                while True:
                    f.write(b"\0" * 65536)
                    f.flush()
        refused = None
        for k in range(200):
            answer = httpx.post(f"{srv.url}/buffer/write", timeout=30, json={
                "uid": f"x{k}", "instance_id": f"x{k}", "reward": 1.0, "extra_info": {"pad": "y" * 4000},
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
            if answer.status_code != 200:
                refused = answer
                break
        assert refused is not None and refused.status_code == 503 and "full" in refused.json()["message"]
        srv.kill9()
        srv = Server(args, "/healthz", port, tmp_path / "full.log").start()  # starts on the full disk
        try:
            status = httpx.get(f"{srv.url}/status").json()
            assert status["groups"].get("ready", 0) >= 10, status
            assert httpx.get(f"{srv.url}/trajectories/g3-1").json()["uid"] == "g3-1"
            exported = subprocess.run([sys.executable, "-m", "rollout_buffer", "export", "--data-dir",
                                       str(disk / "data"), "--out", "-", "--all"], capture_output=True, timeout=60)
            assert exported.returncode == 0 and exported.stdout.count(b"\n") >= 20
            answer = httpx.post(f"{srv.url}/buffer/write", timeout=30, json={
                "uid": "late", "instance_id": "late", "reward": 1.0, "extra_info": {"pad": "y" * 100_000},
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
            assert answer.status_code == 503 and "full" in answer.json()["message"], answer.text
            filler.unlink()  # room again: writes are taken, no restart
            again = httpx.post(f"{srv.url}/buffer/write", timeout=30, json={
                "uid": "late", "instance_id": "late", "reward": 1.0, "extra_info": {"pad": "y" * 100_000},
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})
            assert again.status_code == 200, again.text
        finally:
            srv.stop()
    finally:
        subprocess.run(["umount", "-l", str(disk)], check=False)


def test_a_tokenizer_that_does_not_load_is_refused_at_the_start(tmp_path: Path) -> None:
    """A wrong `tokenizer_path` answered 200 and yielded records without tokens: now a 422 naming it (a model hub
    id explained: the buffer reads local checkpoints only)."""
    inp = write_jsonl(tmp_path / "math.jsonl", math_rows(2))
    empty = tmp_path / "checkpoint"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with buffer(tmp_path, free_port()).start() as srv:
        def start(tokenizer: str) -> str:
            answer = httpx.post(f"{srv.url}/start_rollout", timeout=60, json={
                "task_type": "math", "input_file": str(inp), "remote_engine_url": "http://127.0.0.1:9",
                "tokenizer_path": tokenizer})
            assert answer.status_code == 422, answer.text
            return str(answer.json()["message"])

        assert "tokenizer_path" in start(str(tmp_path / "missing")) and "not a local folder" in start(
            str(tmp_path / "missing"))
        assert "tokenizer_path" in start(str(empty)) and "cannot load a tokenizer" in start(str(empty))
        hub = start("Qwen/Qwen3-4B")
        assert "model hub id" in hub and "huggingface-cli download Qwen/Qwen3-4B" in hub, hub
        assert httpx.get(f"{srv.url}/status").json()["run"] is None, "nothing started"


def test_start_up_faults_are_one_line_and_an_exit_status(tmp_path: Path) -> None:
    def serve(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "rollout_buffer", "serve", *args], capture_output=True,
                              text=True, timeout=120)

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        in_use = serve("--port", str(taken.getsockname()[1]), "--data-dir", str(tmp_path / "a"))
    a_file = tmp_path / "not-a-folder"
    a_file.write_text("x")
    for answer, status, words in ((in_use, 3, "cannot listen on"), (serve("--data-dir", str(a_file)), 4, str(a_file)),
                                  (serve("--port", "0"), 2, "port")):
        assert answer.returncode == status, (answer.returncode, answer.stderr)
        assert answer.stderr.count("\n") == 1 and "Traceback" not in answer.stderr, answer.stderr
        assert answer.stderr.startswith("rollout-buffer serve: ") and words in answer.stderr, answer.stderr
