"""kill -9 of the buffer mid-write: nothing answered is lost, leases survive, nothing acked comes back."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
from servers import Server, free_port

LEASE_S = 10.0


def _server(tmp_path: Path, port: int) -> Server:
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--group-size", "2"]
    return Server(args, "/healthz", port, tmp_path / "buffer.log")


def _rec(uid: str, instance_id: str, reward: float) -> dict:
    return {"uid": uid, "instance_id": instance_id, "reward": reward, "extra_info": {},
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}


def test_kill9_mid_write_then_restart(tmp_path: Path) -> None:
    port = free_port()
    srv = _server(tmp_path, port).start()
    url = srv.url
    # Two complete groups before the crash: one leased and not acked, one acked.
    for k in range(2):
        httpx.post(f"{url}/buffer/write", json=_rec(f"lease-{k}", "lease", float(k))).raise_for_status()
    # The lease outlasts the next few requests however slow the machine, and has run out after the restart.
    leased = httpx.post(f"{url}/get_rollout_data", json={"lease_s": LEASE_S}).json()["data"]
    lease_ends = time.monotonic() + LEASE_S
    assert leased["meta_info"]["num_groups"] == 1
    for k in range(2):
        httpx.post(f"{url}/buffer/write", json=_rec(f"acked-{k}", "acked", float(k))).raise_for_status()
    got = httpx.post(f"{url}/get_rollout_data", json={"lease_s": 600}).json()["data"]
    assert {r["instance_id"] for r in got["data"]} == {"acked"}
    assert httpx.post(f"{url}/ack", json={"batch_id": got["meta_info"]["batch_id"]}).json()["acked_groups"] == 1

    answered: list[str] = []
    stop = threading.Event()

    def writer(worker: int) -> None:
        with httpx.Client(timeout=5) as client:
            for i in range(100_000):
                if stop.is_set():
                    return
                uid = f"w{worker}-{i}"
                try:
                    resp = client.post(f"{url}/buffer/write", json=_rec(uid, f"inst-{worker}-{i // 2}", i % 2))
                except httpx.HTTPError:
                    return  # the server died under us: this write was never answered
                if resp.status_code == 200:
                    answered.append(uid)

    threads = [threading.Thread(target=writer, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 20
    while len(answered) < 300 and time.monotonic() < deadline:
        time.sleep(0.05)
    srv.kill9()
    stop.set()
    for t in threads:
        t.join(10)
    assert len(answered) >= 300

    srv = _server(tmp_path, port).start()
    time.sleep(max(0.0, lease_ends - time.monotonic()))
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as client:
            missing = [u for u in answered if client.get(f"/trajectories/{u}").status_code != 200]
            assert missing == [], f"{len(missing)} answered writes were lost"
            delivered: list[dict] = []
            for _ in range(200):
                out = client.post("/get_rollout_data", json={"lease_s": 600, "wait_s": 1.5}).json()
                if not out["success"]:
                    break
                delivered += out["data"]["data"]
                client.post("/ack", json={"batch_id": out["data"]["meta_info"]["batch_id"]}).raise_for_status()
        uids = [r["uid"] for r in delivered]
        assert len(uids) == len(set(uids)), "a uid was delivered twice"
        instances = {r["instance_id"] for r in delivered}
        assert "lease" in instances, "a leased-but-unacked group must be delivered again after restart"
        assert "acked" not in instances, "an acked group came back"
    finally:
        srv.stop()
