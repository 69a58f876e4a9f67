"""The benchmark workload: synthetic arithmetic tasks for the math generator, and the run's start payload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path

GROUP_SIZE = 8
MAX_TOKENS = 256
SAMPLING = {"temperature": 1.0, "top_p": 1.0}


def math_rows(n: int) -> list[dict[str, Any]]:
    """`n` arithmetic questions the simulated engine answers (right or wrong) and math-verify scores."""
    ops = ("+", "-", "*")
    rows = []
    for i in range(n):
        a, b, op = 10 + i % 89, 2 + (i * 7) % 53, ops[i % 3]
        value = a + b if op == "+" else a - b if op == "-" else a * b
        rows.append({"instance_id": f"q{i}", "prompt": f"What is {a} {op} {b}? Put the final answer in \\boxed{{}}.",
                     "label": str(value)})
    return rows


def write_tasks(path: Path, n: int) -> Path:
    """Write `n` tasks as JSONL and return the path."""
    path.write_bytes(b"\n".join(orjson.dumps(r) for r in math_rows(n)) + b"\n")
    return path


def start_payload(input_file: Path, engine_url: str, num_process: int, mode: str,
                  sanity_check: str = "strict") -> dict[str, Any]:
    """slime's `/start_rollout` payload for a math run in `mode` ("token": exact tokens, "chat": messages)."""
    return {
        "task_type": "math",
        "input_file": str(input_file),
        "num_repeat_per_sample": GROUP_SIZE,
        "num_epoch": 1,
        "num_process": num_process,
        "remote_engine_url": engine_url,
        "max_tokens": MAX_TOKENS,
        "sampling_params": dict(SAMPLING),
        "tokenizer_path": bundled_tokenizer_path(),
        "engine_mode": mode,
        "tokenization_sanity_check_mode": sanity_check,
        "shuffle": False,
    }
