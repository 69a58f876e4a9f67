"""Simulated SGLang engines (`python -m rollout_sim.server`) as subprocesses on 127.0.0.1."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from servers import free_port, stop_process, wait_http


class SimEngineProcess:
    """One sim engine subprocess with helpers for its `/sim/*` control endpoints."""

    def __init__(self, args: list[str], log_path: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.args = ["--port", str(self.port), *args]
        self.log_path = log_path
        self.proc: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "rollout_sim.server", *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        try:
            wait_http(self.url + "/health", timeout_s, self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"sim engine failed to start; log:\n{self.log()}") from None

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def stats(self) -> dict[str, Any]:
        return httpx.get(self.url + "/sim/stats", timeout=5).json()

    def requests(self) -> list[dict[str, Any]]:
        return httpx.get(self.url + "/sim/requests", timeout=5).json()

    def generate_count(self) -> int:
        return self.stats()["by_endpoint"].get("/generate", 0)

    def queue_faults(self, *kinds: str) -> None:
        httpx.post(self.url + "/sim/faults", json={"next": list(kinds)}, timeout=5).raise_for_status()

    def stop(self) -> None:
        stop_process(self.proc)


@contextlib.contextmanager
def sim_engines(log_dir: Path, *arg_lists: list[str]) -> Iterator[list[SimEngineProcess]]:
    """Start one sim engine per argument list (in parallel), stop them all on exit."""
    engines = [SimEngineProcess(args, log_dir / f"sim-engine-{i}.log") for i, args in enumerate(arg_lists)]
    try:
        for engine in engines:
            engine.launch()
        for engine in engines:
            engine.wait_ready()
        yield engines
    finally:
        for engine in engines:
            engine.stop()
