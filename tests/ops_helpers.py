"""Helpers of the operations tests: start a math run, wait for it, drain it, read /metrics."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import orjson
from prometheus_client.parser import text_string_to_metric_families


def math_rows(n: int) -> list[dict[str, Any]]:
    """n arithmetic tasks the sim engine answers (right or wrong)."""
    return [{"instance_id": f"m{i}", "prompt": f"What is {i + 3} + {2 * i}?", "label": str(3 * i + 3)}
            for i in range(n)]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in rows) + b"\n")
    return path


def start_run(url: str, engine: str | list[str], input_file: Path, tokenizer: str | None,
              headers: dict[str, str] | None = None, **over: Any) -> str:
    """POST /start_rollout for a math run (4 repeats, 1 epoch) and return its run id."""
    payload = {
        "task_type": "math", "input_file": str(input_file), "num_repeat_per_sample": 4, "num_epoch": 1,
        "num_process": 16, "remote_engine_url": engine, "max_tokens": 256, "tokenizer_path": tokenizer,
        "sampling_params": {"temperature": 1.0}, "backoff_s": 0.05, **over,
    }
    resp = httpx.post(f"{url}/start_rollout", json=payload, headers=headers, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()["run_id"]




def scrape(url: str, headers: dict[str, str] | None = None) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """GET /metrics parsed: {(sample name, sorted labels): value}."""
    resp = httpx.get(f"{url}/metrics", headers=headers, timeout=10)
    assert resp.status_code == 200, resp.text
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """One sample's value, 0 when the series does not exist yet (a counter never incremented)."""
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def delta(after: dict[tuple[str, tuple[tuple[str, str], ...]], float],
          before: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str) -> float:
    """How much one series grew between two scrapes."""
    return value(after, name, **labels) - value(before, name, **labels)
