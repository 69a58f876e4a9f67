#!/usr/bin/env python
"""Record exchanges with the real SGLang server as fixtures for tests/test_sglang_exchanges.py.

Run with the venv `setup.sh` made, from the repository root:

    ~/.cache/rollout-buffer/real-sglang/current/venv/bin/python real_sglang/record_exchanges.py

It starts SGLang on checkpoint A (as tests/test_real_sglang.py does), sends the prompt the other fixtures use, and
writes tests/fixtures/sglang/real_*.json: what the engine client sends (`expect`) and what real SGLang answered.

- `real_stop_string`: greedy with the stop string "e": the text ends before it, the token holding it is kept.
- `real_abort_resume`: a request aborted by `/pause_generation` (abort) mid-answer, the weights updated to
  checkpoint B as version "1", then the resume (prompt + partial output) answered by B.
- `real_in_place_update`: a request held by an in-place pause while B is loaded as version "1" without a cache
  flush: one answer whose `weight_versions` spans both versions.
"""

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import requests

ROOT = Path(__file__).resolve().parent.parent
BUILD = Path(os.environ.get("RB_REAL_SGLANG_HOME", Path.home() / ".cache" / "rollout-buffer" / "real-sglang"))
MODELS = (BUILD / "current").resolve() / "models"
FIXTURES = ROOT / "tests" / "fixtures" / "sglang"
SOURCE = "sglang 0.5.23: recorded from the real server on CPU (real_sglang/record_exchanges.py), tiny Qwen3 checkpoints"
PROMPT = json.loads((FIXTURES / "generate_logprobs.json").read_text())["exchanges"][0]["request"]["expect"]["input_ids"]
JSON = {"content-type": "application/json"}


def start_engine(port: int, log: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(MODELS / "tiny-qwen3-a"),
               "--device", "cpu", "--dtype", "float32", "--attention-backend", "torch_native",
               "--disable-overlap-schedule", "--max-total-tokens", "8192", "--mem-fraction-static", "0.05",
               "--host", "127.0.0.1", "--port", str(port), "--sleep-on-idle"]
    out = open(log, "ab")
    proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                            env={**os.environ, "SGLANG_USE_CPU_ENGINE": "1"})
    deadline = time.monotonic() + 420
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
        try:
            if requests.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                return proc
        except requests.ConnectionError:
            pass
        time.sleep(1)


class Engine:
    def __init__(self, url: str):
        self.url = url

    def post(self, path: str, body: dict) -> requests.Response:
        return requests.post(self.url + path, json=body, timeout=120)

    def generate(self, body: dict) -> dict:
        """An exchange: the request's `expect` and the answer."""
        answer = self.post("/generate", body)
        expect = {"input_ids": body["input_ids"], "sampling_params.max_new_tokens":
                  body["sampling_params"]["max_new_tokens"]}
        return {"request": {"method": "POST", "path": "/generate", "expect": expect},
                "response": {"status": answer.status_code, "headers": JSON, "body": answer.json()}}

    def in_background(self, body: dict) -> tuple[threading.Thread, list[dict]]:
        done: list[dict] = []
        thread = threading.Thread(target=lambda: done.append(self.generate(body)))
        thread.start()
        deadline = time.monotonic() + 300
        while self.post("/flush_cache", {}).status_code == 200:  # refused once the request runs
            assert time.monotonic() < deadline, "the request never ran"
            time.sleep(0.05)
        time.sleep(1.0)  # some tokens into it
        return thread, done

    def load(self, model: str, version: str, **options) -> None:
        answer = self.post("/update_weights_from_disk", {"model_path": str(MODELS / model), "weight_version": version,
                                                         **options})
        assert answer.ok and answer.json()["success"], answer.text


def request(max_new_tokens: int, **sampling) -> dict:
    return {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0, **sampling}}


def write(name: str, description: str, exchanges: list[dict]) -> None:
    (FIXTURES / f"{name}.json").write_text(json.dumps(
        {"source": SOURCE, "description": description, "exchanges": exchanges}, indent=1) + "\n")
    print(f"wrote {name}.json: {len(exchanges)} exchanges")


def main() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = start_engine(port, Path(os.environ.get("TMPDIR", "/tmp")) / "record-exchanges-sglang.log")
    engine = Engine(f"http://127.0.0.1:{port}")
    try:
        write("real_stop_string", "Greedy with the stop string 'e': the text stops before it; the token holding it "
              "is the last output id.", [engine.generate(request(64, stop=["e"]))])

        thread, first = engine.in_background(request(160, ignore_eos=True))
        engine.post("/pause_generation", {"mode": "abort"})
        thread.join()
        engine.load("tiny-qwen3-b", "1")
        engine.post("/continue_generation", {})
        partial = first[0]["response"]["body"]["output_ids"]
        resume = request(160 - len(partial), ignore_eos=True)
        resume["input_ids"] = PROMPT + partial
        write("real_abort_resume", "Aborted by /pause_generation mid-answer; checkpoint B loaded as version 1; the "
              "resume (prompt + partial output, the rest of the tokens) answered by B.",
              [first[0], engine.generate(resume)])
        engine.load("tiny-qwen3-a", "default")

        thread, held = engine.in_background(request(160, ignore_eos=True))
        engine.post("/pause_generation", {"mode": "in_place"})
        engine.load("tiny-qwen3-b", "1", flush_cache=False)
        engine.post("/continue_generation", {})
        thread.join()
        write("real_in_place_update", "Held by an in-place pause while checkpoint B was loaded as version 1 without a "
              "cache flush: one answer, two weight versions.", held)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(30)


if __name__ == "__main__":
    main()
