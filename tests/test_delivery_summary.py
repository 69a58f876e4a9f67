"""Delivery sends the stored JSON as it is, with meta_info from per-record summaries kept at completion."""

from __future__ import annotations

from pathlib import Path

import httpx
from servers import free_port, running


def _rec(uid: str, instance_id: str, reward: float, **info: object) -> dict:
    return {"uid": uid, "instance_id": instance_id, "reward": reward, "extra_info": dict(info),
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a {uid}"}],
            "tokens": [1, 2, 3, 4], "loss_mask": [0, 0, 1, 1], "rollout_log_probs": [-0.5, -0.25],
            "response_length": 2}


def _serve(tmp_path: Path, port: int):
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--group-size", "2"]
    return running(args, "/healthz", port, tmp_path / f"buffer-{port}.log")


def test_delivered_records_and_meta_info_match_what_was_written(tmp_path: Path) -> None:
    with _serve(tmp_path, free_port()) as srv:
        httpx.post(f"{srv.url}/buffer/write", json=_rec("a", "g1", 1.0, tokenization_mismatch={"position": 3})
                   ).raise_for_status()
        httpx.post(f"{srv.url}/buffer/write", json=_rec("b", "g1", 0.0)).raise_for_status()
        data = httpx.post(f"{srv.url}/get_rollout_data", json={}).json()["data"]
    by_uid = {r["uid"]: r for r in data["data"]}
    assert by_uid["a"]["rollout_log_probs"] == [-0.5, -0.25] and by_uid["a"]["tokens"] == [1, 2, 3, 4]
    assert by_uid["a"]["raw_reward"] == 1.0 and by_uid["a"]["reward"] > 0 > by_uid["b"]["reward"]
    meta = data["meta_info"]
    assert meta["avg_reward"] == 0.5 and abs(meta["avg_normalized_reward"]) < 1e-9
    assert meta["tokenization_mismatches"] == 1 and meta["total_samples"] == 2
