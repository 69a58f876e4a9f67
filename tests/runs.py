"""Driving a buffer's run in tests: wait for it to end, then drain every batch with acks."""

from __future__ import annotations

import time

import httpx


def wait_finished(url: str, *, headers: dict[str, str] | None = None, timeout_s: float = 60) -> dict:
    """Poll /status until the run is finished or failed; returns that status."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        status = httpx.get(f"{url}/status", headers=headers, timeout=10).json()
        if status["run"] and status["run"]["state"] in ("finished", "failed"):
            return status
        time.sleep(0.05)
    raise TimeoutError(f"run did not finish: {httpx.get(f'{url}/status', headers=headers).json()}")


def drain_batches(url: str, *, max_groups: int | None = None, wait_s: float = 0.5,
                  headers: dict[str, str] | None = None) -> list[list[dict]]:
    """Every ready batch (leased, then acked, as the slime adapter does), in delivery order."""
    body: dict = {"lease_s": 60, "wait_s": wait_s}
    if max_groups is not None:
        body["max_groups"] = max_groups
    batches: list[list[dict]] = []
    for _ in range(1000):
        out = httpx.post(f"{url}/get_rollout_data", json=body, headers=headers, timeout=30).json()
        if not out["success"]:
            return batches
        batches.append(out["data"]["data"])
        ack = {"batch_id": out["data"]["meta_info"]["batch_id"]}
        httpx.post(f"{url}/ack", json=ack, headers=headers, timeout=30).raise_for_status()
    raise AssertionError("delivery did not end")


def drain(url: str, *, headers: dict[str, str] | None = None, wait_s: float = 0.5) -> list[dict]:
    """Every ready record, acked."""
    return [r for batch in drain_batches(url, wait_s=wait_s, headers=headers) for r in batch]
