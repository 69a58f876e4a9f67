"""The buffer against the real SGLang engine on this CPU (`real_sglang/`: SGLang 0.5.23 on a tiny float32 Qwen3
checkpoint): a native math run's records hold the engine's own tokens, and the trainer's log-probs — a transformers
float32 forward of the same checkpoint over each record's tokens — equal the log-probs the record holds at every
loss-1 position.

The tolerance is 1e-4: the engine and the forward compute the same float32 model and differ only in kernels
(SGLang's native attention against transformers' eager one, another order of the sums), which measured 1.2e-5 at
most; a record whose tokens or mask are off by one position is off by several nats (checked below, so the check
itself is checked)."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from runs import drain, math_rows, start, wait_finished, write_jsonl
from servers import buffer_server, free_port, stop_process

ROOT = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("RB_REAL_SGLANG_HOME", Path.home() / ".cache" / "rollout-buffer" / "real-sglang"))
TOLERANCE = 1e-4
READY_S = 420  # measured 109–155 s on two quiet cores


@pytest.fixture(scope="module")
def build() -> Path:
    """The venv and checkpoints of `real_sglang/setup.sh` (built the first time, then cached)."""
    done = subprocess.run(["bash", str(ROOT / "real_sglang" / "setup.sh")], capture_output=True, text=True,
                          timeout=1800)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return BUILD / "current"


@pytest.fixture(scope="module")
def engine(build: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """Real SGLang serving checkpoint A on a free port, until the module's tests are done."""
    port = free_port()
    folder = tmp_path_factory.mktemp("real-sglang")
    log = folder / "sglang.log"
    command = [str(build / "venv" / "bin" / "python"), "-m", "sglang.launch_server", "--model-path",
               str(build / "models" / "tiny-qwen3-a"), "--device", "cpu", "--dtype", "float32",
               "--attention-backend", "torch_native", "--disable-overlap-schedule", "--max-total-tokens", "8192",
               "--mem-fraction-static", "0.05", "--host", "127.0.0.1", "--port", str(port)]
    with open(log, "ab") as out:
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1", "OMP_NUM_THREADS": "2",
                                     "TMPDIR": str(folder)})  # its IPC sockets, with its log
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + READY_S
        while True:  # /health answers 503 until SGLang's own warm-up request is done
            assert proc.poll() is None, f"SGLang exited with {proc.returncode}: {log.read_text()[-3000:]}"
            assert time.monotonic() < deadline, f"SGLang not ready in {READY_S} s: {log.read_text()[-3000:]}"
            try:
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(1)
        yield url
    finally:
        stop_process(proc)


def trainer_logprobs(build: Path, model: str, sequences: list[list[int]]) -> list[list[float]]:
    """Each sequence's log-probs from a transformers float32 forward (`real_sglang/forward_logprobs.py`)."""
    done = subprocess.run([str(build / "venv" / "bin" / "python"), str(ROOT / "real_sglang" / "forward_logprobs.py")],
                          input=json.dumps({"model": model, "sequences": sequences}), capture_output=True, text=True,
                          timeout=600, env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr[-3000:]
    result: list[list[float]] = json.loads(done.stdout)
    return result


def worst_difference(record: dict[str, Any], forward: list[float], shift: int = 0) -> tuple[float, int]:
    """The largest |record − forward| log-prob over the record's loss-1 tokens, and its position in `tokens`
    (`shift` moves the record's log-probs that many tokens along, as a mistake of alignment would)."""
    prompt = len(record["tokens"]) - record["response_length"]
    response_mask = record["loss_mask"][-record["response_length"]:]  # `loss_mask` is as long as `tokens`
    worst, where = 0.0, -1
    for k, (mask, logprob) in enumerate(zip(response_mask, record["rollout_log_probs"], strict=True)):
        position = prompt + k + shift
        if mask and 0 < position < len(record["tokens"]):
            difference = abs(logprob - forward[position - 1])
            if difference > worst:
                worst, where = difference, position
    return worst, where


def test_a_math_run_on_real_sglang_has_the_trainers_log_probs(
        engine: str, build: Path, tmp_path: Path) -> None:
    model = str(build / "models" / "tiny-qwen3-a")
    with buffer_server(tmp_path, "--data-root", str(build.resolve())) as buffer:
        start(buffer.url, engine, write_jsonl(tmp_path / "math.jsonl", math_rows(4)), model, num_repeat_per_sample=2,
              num_process=4, max_tokens=24)
        status = wait_finished(buffer.url, timeout_s=600)
        assert status["run"]["progress"]["failed"] == 0, status
        records = drain(buffer.url)
    assert len(records) == 8
    forward = trainer_logprobs(build, model, [r["tokens"] for r in records])
    for record, logprobs in zip(records, forward, strict=True):
        # A random model's answer runs to max_tokens or stops at its end-of-turn token: either is kept whole. Its
        # random tokens do not survive decoding and encoding again, which the record notes
        # (`tokenization_mismatch`); what it trains on are the engine's tokens.
        assert record["status"] in ("completed", "truncated")
        assert len(record["loss_mask"]) == len(record["tokens"])
        assert sum(record["loss_mask"]) == record["response_length"] == len(record["rollout_log_probs"]) > 0
        worst, where = worst_difference(record, logprobs)
        assert worst <= TOLERANCE, (f"{record['uid']}: the engine's log-prob differs from the trainer's by {worst:.2e}"
                                    f" at token {where} ({record['tokens'][where]})")
        # The check sees a record off by one token: its log-probs are then those of other tokens.
        assert worst_difference(record, logprobs, shift=1)[0] > 1.0
