"""Driving a buffer's run in tests: start a math run from rows written as JSONL, wait for it to end, then drain
every batch with acks."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import orjson


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


def math_rows(n: int) -> list[dict]:
    return [{"instance_id": f"m{i}", "prompt": f"What is {i + 3} + {2 * i}?", "label": str(3 * i + 3)}
            for i in range(n)]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


def start(url: str, engine: str | list[str], input_file: Path, tokenizer: str | None, **over) -> str:
    payload = {
        "task_type": "math", "input_file": str(input_file), "num_repeat_per_sample": 4, "num_epoch": 1,
        "num_process": 16, "remote_engine_url": engine, "max_tokens": 256, "tokenizer_path": tokenizer,
        "sampling_params": {"temperature": 1.0, "top_p": 1.0}, "backoff_s": 0.05,
    }
    payload.update(over)
    resp = httpx.post(f"{url}/start_rollout", json=payload, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["run_id"]
