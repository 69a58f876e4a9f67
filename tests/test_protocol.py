"""slime's rollout-buffer protocol over real HTTP: writes, whole-group delivery, long-poll, leases, auth."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from ops_helpers import math_rows, start_run, write_jsonl
from servers import Server, free_port, running


def record(uid: str, instance_id: str, reward: float, epoch: int | None = None, content: str = "ok") -> dict:
    extra = {} if epoch is None else {"epoch": epoch}
    return {
        "uid": uid,
        "instance_id": instance_id,
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}],
        "reward": reward,
        "extra_info": extra,
    }


def write_group(url: str, instance_id: str, rewards: list[float], epoch: int | None = None, **kw) -> None:
    for k, r in enumerate(rewards):
        resp = httpx.post(f"{url}/buffer/write", json=record(f"{instance_id}-{epoch}-{k}", instance_id, r, epoch, **kw))
        assert resp.status_code == 200, resp.text


def get(url: str, body: dict | None = None, **kw) -> dict:
    resp = httpx.post(f"{url}/get_rollout_data", json=body if body is not None else {}, timeout=30, **kw)
    assert resp.status_code == 200, resp.text
    return resp.json()


def test_slime_client_round_trip(buffer_server: Server) -> None:
    url = buffer_server.url
    empty = get(url)
    assert empty["success"] is False and empty["data"]["data"] == []
    write_group(url, "a", [1.0, 0.0, 1.0])  # 3 of 4: not complete yet
    assert get(url)["success"] is False
    write_group(url, "b", [1.0, 1.0, 0.0, 0.0])
    out = get(url)
    assert out["success"] is True
    data, meta = out["data"]["data"], out["data"]["meta_info"]
    assert {r["instance_id"] for r in data} == {"b"}
    assert meta["total_samples"] == 4 and meta["num_groups"] == 1 and meta["avg_group_size"] == 4
    assert meta["avg_reward"] == pytest.approx(0.5)
    assert meta["finished_groups"] == ["b"] and meta["finished_groups_count"] == 1
    for r in data:
        assert set(r) >= {"uid", "instance_id", "messages", "reward", "raw_reward", "extra_info"}
    # Without lease_s delivery is consumption (slime's original client).
    assert get(url)["success"] is False


def test_raw_body_and_empty_body_accepted(buffer_server: Server) -> None:
    resp = httpx.post(f"{buffer_server.url}/get_rollout_data", content=b"")
    assert resp.status_code == 200 and resp.json()["success"] is False


def test_groups_are_per_epoch_and_oldest_first_one_per_instance(buffer_server: Server) -> None:
    url = buffer_server.url
    write_group(url, "x", [1, 0, 0, 0], epoch=1)
    write_group(url, "x", [1, 1, 1, 0], epoch=0)
    write_group(url, "y", [0, 0, 0, 1], epoch=0)
    # slime's client groups an answer by instance_id: x's second epoch waits for the next read.
    out = get(url, {"max_groups": 2})
    groups = [(r["instance_id"], r["extra_info"]["epoch"]) for r in out["data"]["data"]]
    assert groups == [("x", 1)] * 4 + [("y", 0)] * 4
    rest = get(url)["data"]["data"]
    assert [(r["instance_id"], r["extra_info"]["epoch"]) for r in rest] == [("x", 0)] * 4


def test_grpo_normalization_and_raw_reward(buffer_server: Server) -> None:
    url = buffer_server.url
    write_group(url, "n", [1.0, 0.0, 0.0, 0.0])
    write_group(url, "z", [1.0, 1.0, 1.0, 1.0])
    by_inst: dict[str, list[dict]] = {}
    for r in get(url)["data"]["data"]:
        by_inst.setdefault(r["instance_id"], []).append(r)
    n = sorted(by_inst["n"], key=lambda r: -r["raw_reward"])
    # mean 0.25, population std sqrt(3)/4
    std = (3**0.5) / 4
    assert n[0]["reward"] == pytest.approx(0.75 / (std + 1e-6))
    assert n[1]["reward"] == pytest.approx(-0.25 / (std + 1e-6))
    assert [r["raw_reward"] for r in n] == [1.0, 0.0, 0.0, 0.0]
    assert all(r["reward"] == 0.0 and r["raw_reward"] == 1.0 for r in by_inst["z"])


def test_empty_response_group_is_filtered_and_counted(buffer_server: Server) -> None:
    url = buffer_server.url
    write_group(url, "e", [1.0, 0.0, 1.0])
    httpx.post(f"{url}/buffer/write", json=record("e-last", "e", 1.0, content="  ")).raise_for_status()
    write_group(url, "g", [1.0, 0.0, 1.0, 0.0])
    out = get(url)
    assert {r["instance_id"] for r in out["data"]["data"]} == {"g"}
    assert out["data"]["meta_info"]["filtered_groups"] == {"empty_response": 1}
    status = httpx.get(f"{url}/status").json()
    assert status["groups"]["filtered"] == 1 and status["filtered"] == {"empty_response": 1}


def test_duplicate_uid_is_ignored(buffer_server: Server) -> None:
    url = buffer_server.url
    rec = record("dup", "d", 1.0)
    first = httpx.post(f"{url}/buffer/write", json=rec).json()
    second = httpx.post(f"{url}/buffer/write", json=rec).json()
    assert first["duplicate"] is False and second["duplicate"] is True
    assert httpx.get(f"{url}/status").json()["records"] == {"completed": 1}


def test_long_poll_returns_when_group_completes(buffer_server: Server) -> None:
    url = buffer_server.url
    write_group(url, "lp", [1, 0, 1])

    def finish() -> None:
        time.sleep(0.5)
        httpx.post(f"{url}/buffer/write", json=record("lp-last", "lp", 0.0)).raise_for_status()

    t = threading.Thread(target=finish)
    start = time.monotonic()
    t.start()
    out = get(url, {"wait_s": 20})
    elapsed = time.monotonic() - start
    t.join()
    assert out["success"] is True and out["data"]["meta_info"]["num_groups"] == 1
    assert elapsed < 5, "long-poll must answer as soon as the group is complete, not at wait_s"
    start = time.monotonic()
    assert get(url, {"wait_s": 0.3})["success"] is False
    assert time.monotonic() - start >= 0.25


def test_lease_expiry_redelivers_and_ack_stops_it(buffer_server: Server) -> None:
    url = buffer_server.url
    write_group(url, "l1", [1, 0, 0, 1])
    write_group(url, "l2", [1, 1, 0, 1])
    # A lease long enough that the next request comes inside it however busy the machine (a write's fsync can
    # stall for a second), short enough to wait out.
    first = get(url, {"lease_s": 3, "max_groups": 1})
    lease_ends = time.monotonic() + 3
    batch = first["data"]["meta_info"]["batch_id"]
    assert batch and first["data"]["meta_info"]["num_groups"] == 1
    uids = {r["uid"] for r in first["data"]["data"]}
    second = get(url, {"lease_s": 30})  # l2 only: l1 is leased
    assert {r["instance_id"] for r in second["data"]["data"]} == {"l2"}
    time.sleep(max(0.0, lease_ends - time.monotonic()) + 0.2)
    again = get(url, {"lease_s": 30, "ack": second["data"]["meta_info"]["batch_id"]})
    assert {r["uid"] for r in again["data"]["data"]} == uids, "unacked batch must come back after its lease"
    assert again["data"]["meta_info"]["acked_groups"] == 1
    assert again["data"]["meta_info"]["redelivered_groups"] == 1
    ack = httpx.post(f"{url}/ack", json={"batch_id": again["data"]["meta_info"]["batch_id"]}).json()
    assert ack == {"success": True, "acked_groups": 1}
    assert get(url, {"lease_s": 0.1, "wait_s": 0.5})["success"] is False


def test_long_poll_wakes_for_expired_lease(buffer_server: Server) -> None:
    url = buffer_server.url
    write_group(url, "w", [1, 0, 0, 1])
    get(url, {"lease_s": 0.5})
    start = time.monotonic()
    out = get(url, {"lease_s": 10, "wait_s": 10})
    assert out["success"] is True and time.monotonic() - start < 3


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"instance_id": "i", "messages": [], "reward": 1.0}, "uid"),
        ({"uid": "u", "messages": [], "reward": 1.0}, "instance_id"),
        ({"uid": "u", "instance_id": "i", "reward": 1.0}, "messages"),
        ({"uid": "u", "instance_id": "i", "messages": [], "reward": "high"}, "reward"),
        ({"uid": "u", "instance_id": "i", "messages": "hello", "reward": 1.0}, "messages"),
        ({"uid": "u", "instance_id": "i", "messages": [], "reward": 1.0, "extra_info": []}, "extra_info"),
    ],
)
def test_bad_write_names_the_field(buffer_server: Server, body: dict, field: str) -> None:
    resp = httpx.post(f"{buffer_server.url}/buffer/write", json=body)
    assert resp.status_code == 422
    assert field in resp.json()["message"]
    assert httpx.get(f"{buffer_server.url}/healthz").status_code == 200


def test_bad_bodies_get_4xx_and_server_keeps_serving(buffer_server: Server) -> None:
    url = buffer_server.url
    bad = [
        b"{not json",
        b"\xff\xfe\x00garbage",
        b"[" * 5000 + b"]" * 5000,
        b'{"uid": "u", "instance_id": "i", "messages": [], "reward": NaN}',
    ]
    for body in bad:
        resp = httpx.post(f"{url}/buffer/write", content=body, headers={"content-type": "application/json"})
        assert 400 <= resp.status_code < 500, (body[:20], resp.status_code, resp.text)
    resp = httpx.post(f"{url}/get_rollout_data", json={"wait_s": -1})
    assert resp.status_code == 422 and "wait_s" in resp.json()["message"]
    resp = httpx.post(f"{url}/get_rollout_data", content=b"{oops", headers={"content-type": "application/json"})
    assert resp.status_code == 422
    assert httpx.get(f"{url}/status").json()["records"] == {}
    assert httpx.get(f"{url}/healthz").json() == {"ok": True}


def test_body_size_cap(tmp_path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "d"), "--max-body-bytes", "2048"]
    with running(args, "/healthz", port, tmp_path / "log") as srv:
        big = record("big", "i", 1.0, content="x" * 5000)
        resp = httpx.post(f"{srv.url}/buffer/write", json=big)
        assert resp.status_code == 413 and "2048" in resp.json()["message"]
        assert httpx.post(f"{srv.url}/buffer/write", json=record("small", "i", 1.0)).status_code == 200


def test_auth_token(tmp_path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "d"), "--auth-token", "s3cret"]
    with running(args, "/healthz", port, tmp_path / "log") as srv:
        assert httpx.get(f"{srv.url}/healthz").status_code == 200
        for path in ("/status", "/openapi.json"):
            assert httpx.get(f"{srv.url}{path}").status_code == 401
            assert httpx.get(f"{srv.url}{path}", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert httpx.post(f"{srv.url}/get_rollout_data", json={}).status_code == 401
        ok = {"Authorization": "Bearer s3cret"}
        assert httpx.get(f"{srv.url}/status", headers=ok).status_code == 200
        assert httpx.post(f"{srv.url}/get_rollout_data", json={}, headers=ok).status_code == 200


def test_auth_token_from_env(tmp_path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "d")]
    with running(args, "/healthz", port, tmp_path / "log", env={"ROLLOUT_BUFFER_AUTH_TOKEN": "envtok"}) as srv:
        assert httpx.get(f"{srv.url}/status").status_code == 401
        assert httpx.get(f"{srv.url}/status", headers={"Authorization": "Bearer envtok"}).status_code == 200


def test_openapi_docs_list_the_protocol(buffer_server: Server) -> None:
    spec = httpx.get(f"{buffer_server.url}/openapi.json").json()
    for path in ("/start_rollout", "/get_rollout_data", "/buffer/write", "/ack", "/status", "/healthz"):
        assert path in spec["paths"]
    assert httpx.get(f"{buffer_server.url}/docs").status_code == 200


def test_groups_endpoint_lists_groups_by_state(buffer_server: Server) -> None:
    url = buffer_server.url
    write_group(url, "done", [1, 0, 0, 1])
    write_group(url, "half", [1, 0])
    ready = httpx.get(f"{url}/groups", params={"state": "ready"}).json()["groups"]
    assert [(g["instance_id"], g["episodes"], g["size"]) for g in ready] == [("done", 4, 4)]
    assert sorted(ready[0]["uids"]) == [f"done-None-{k}" for k in range(4)]
    open_groups = httpx.get(f"{url}/groups", params={"state": "open"}).json()["groups"]
    assert [g["instance_id"] for g in open_groups] == ["half"]
    assert len(httpx.get(f"{url}/groups").json()["groups"]) == 2
    resp = httpx.get(f"{url}/groups", params={"state": "bogus"})
    assert resp.status_code == 422 and "state" in resp.json()["message"]


def start_failing_run(url: str, tmp_path, repeats: int) -> str:
    """A math run against an engine that is not there: it starts (and becomes the latest run), its own
    trajectories fail at once."""
    data = write_jsonl(tmp_path / "math.jsonl", math_rows(1))
    return start_run(url, f"http://127.0.0.1:{free_port()}", data, None, num_repeat_per_sample=repeats,
                     num_process=1, max_retries=0, backoff_s=0.01)


def test_writes_follow_the_latest_run(tmp_path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "d"), "--group-size", "4"]
    with running(args, "/healthz", port, tmp_path / "log") as srv:
        # A burst of first writes with no run yet: every one lands in the one default run.
        def first(i: int) -> int:
            return httpx.post(f"{srv.url}/buffer/write", json=record(f"b{i}", f"burst{i % 8}", 1.0),
                              timeout=30).status_code

        threads, codes = [], []
        for i in range(32):
            threads.append(threading.Thread(target=lambda i=i: codes.append(first(i))))
            threads[-1].start()
        for t in threads:
            t.join(30)
        assert codes == [200] * 32
        groups = httpx.get(f"{srv.url}/groups").json()["groups"]
        assert len({g["run_id"] for g in groups}) == 1 and len(groups) == 8

        # After /start_rollout, writes belong to the new run.
        run_id = start_failing_run(srv.url, tmp_path, repeats=4)
        assert httpx.post(f"{srv.url}/buffer/write", json=record("late", "late", 1.0)).status_code == 200
        late = httpx.get(f"{srv.url}/groups", params={"run_id": run_id}).json()["groups"]
        assert "late" in {g["instance_id"] for g in late}


def test_a_fetch_gets_its_own_runs_groups(tmp_path) -> None:
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "d"), "--group-size", "2"]
    with running(args, "/healthz", port, tmp_path / "log") as srv:
        write_group(srv.url, "old", [1.0, 0.0])  # left ready by an earlier run (here: the default run)
        old_run = httpx.get(f"{srv.url}/status").json()["run"]["run_id"]
        new_run = start_failing_run(srv.url, tmp_path, repeats=2)
        write_group(srv.url, "new", [1.0, 0.0])

        out = get(srv.url, {"lease_s": 30})
        assert {r["instance_id"] for r in out["data"]["data"]} == {"new"}
        assert out["data"]["meta_info"]["run_id"] == new_run
        assert get(srv.url)["success"] is False, "the earlier run's leftovers are never mixed in"
        status = httpx.get(f"{srv.url}/status").json()
        assert status["run"]["run_id"] == new_run and status["earlier_runs"] == {old_run: 1}

        named = get(srv.url, {"run_id": old_run})
        assert {r["instance_id"] for r in named["data"]["data"]} == {"old"}
        assert named["data"]["meta_info"]["run_id"] == old_run
        assert httpx.get(f"{srv.url}/status").json()["earlier_runs"] == {}
        unknown = httpx.post(f"{srv.url}/get_rollout_data", json={"run_id": "no-such-run"})
        assert unknown.status_code == 404 and "run_id" in unknown.json()["message"]
