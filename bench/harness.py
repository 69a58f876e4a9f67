"""Servers under test as subprocesses on 127.0.0.1, and a meter of their CPU time and memory.

Every benchmark starts what it measures through here: the simulated engine and the buffer via the
`rollout-buffer` CLI, the baseline via its own module. Waits are bounded; processes are stopped by
process group so a server's children (the baseline's workers) go with it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil

from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path

REPO = Path(__file__).resolve().parent.parent


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of `n` consecutive TCP ports free on 127.0.0.1 right now."""
    for _ in range(100):
        first = free_port()
        with contextlib.ExitStack() as stack:
            try:
                for port in range(first, first + n):
                    stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)).bind(("127.0.0.1", port))
            except OSError:
                continue
            return first
    raise RuntimeError(f"no {n} consecutive free ports")


class Service:
    """One server subprocess (`python -m <module> <args>`) with its log in `log_path`, run from the source tree
    `src` (this checkout by default)."""

    def __init__(self, module: str, args: list[str], port: int, health_path: str, log_path: Path, src: Path = REPO):
        self.module = module
        self.args = args
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.health_url = self.url + health_path
        self.log_path = log_path
        self.src = src
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self.proc is not None, "service not started"
        return self.proc.pid

    def start(self, timeout_s: float = 60.0) -> Service:
        """Launch and wait until the health URL answers 200."""
        env = {**os.environ, "PYTHONPATH": str(self.src), "TOKENIZERS_PARALLELISM": "false"}
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", self.module, *self.args], stdout=log,
                                         stderr=subprocess.STDOUT, env=env, cwd=self.src, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.module} exited with {self.proc.returncode}; log:\n{self.log_tail()}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(self.health_url, timeout=1.0).status_code == 200:
                    return self
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"{self.module} did not answer {self.health_url} in {timeout_s}s")

    def log_tail(self, chars: int = 3000) -> str:
        """The end of the service's log."""
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def stop(self) -> None:
        """SIGTERM the process group; then SIGKILL whatever is left of it (forked workers included)."""
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(15)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(15)

    def __enter__(self) -> Service:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class Running:
    """A server started by someone else (a real SGLang): where it answers, and its process for the CPU meter."""

    url: str
    pid: int


def sim_engine(workdir: Path, latency_ms: float, seed: int = 0, *extra: str) -> Service:
    """`rollout-buffer sim-engine` with the bundled Qwen3 tokenizer, the given per-request latency and `extra`
    arguments."""
    port = free_port()
    args = ["sim-engine", "--port", str(port), "--tokenizer", bundled_tokenizer_path(), "--latency-ms",
            str(latency_ms), "--correct-rate", "0.5", "--seed", str(seed), *extra]
    return Service("rollout_buffer", args, port, "/health", workdir / f"sim-{port}.log")


def ray_actors_cpu_s() -> float:
    """CPU seconds used so far by the Ray executor's actors (processes titled `ray::TrajectoryWorker`)."""
    total = 0.0
    for proc in psutil.process_iter(["cmdline"]):
        if any("ray::TrajectoryWorker" in part for part in proc.info["cmdline"] or ()):
            with contextlib.suppress(psutil.NoSuchProcess):
                t = proc.cpu_times()
                total += t.user + t.system
    return total


def rollout_buffer(workdir: Path, src: Path = REPO, *extra: str) -> Service:
    """`rollout-buffer serve` with a fresh data dir under `workdir`, from the source tree `src`, with `extra`
    arguments; the bench's runs read their inputs from `workdir` (`--data-root`)."""
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(workdir / f"data-{port}"), "--log-level", "WARNING",
            "--data-root", str(workdir), *extra]
    return Service("rollout_buffer", args, port, "/healthz", workdir / f"buffer-{port}.log", src)


@dataclass
class Usage:
    """What a process tree used: CPU seconds (user + system) in a window, peak PSS over the run."""

    cpu_s: float
    peak_pss_mb: float
    processes: int


class MachineCpu:
    """Cores the whole machine kept busy between `mark()` and `busy_cores()` (every process, not one tree)."""

    def __init__(self) -> None:
        self._at_mark = (time.monotonic(), _busy_cpu_s())

    def mark(self) -> None:
        self._at_mark = (time.monotonic(), _busy_cpu_s())

    def busy_cores(self) -> float:
        start, busy = self._at_mark
        return (_busy_cpu_s() - busy) / max(time.monotonic() - start, 1e-9)


def _busy_cpu_s() -> float:
    t = psutil.cpu_times()
    return sum(t) - t.idle - getattr(t, "iowait", 0.0)


def proc_cpu_s(pid: int, tid: int | str | None = None) -> float:
    """User + system CPU seconds of thread `tid` of process `pid` (the whole process when None), from /proc."""
    path = f"/proc/{pid}/stat" if tid is None else f"/proc/{pid}/task/{tid}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (clock ticks)


class ThreadCpu:
    """CPU of a process's threads of one OS name (`/proc/PID/task/*/comm`) between a mark and now, e.g. the
    buffer's `store` thread beside its event loop."""

    def __init__(self, pid: int, name: str):
        self.pid, self.name = pid, name
        self._at_mark = self._cpu_s()

    def _cpu_s(self) -> float:
        total = 0.0
        for tid in os.listdir(f"/proc/{self.pid}/task"):
            with contextlib.suppress(OSError):
                if Path(f"/proc/{self.pid}/task/{tid}/comm").read_text().strip() == self.name:
                    total += proc_cpu_s(self.pid, tid)
        return total

    def mark(self) -> None:
        self._at_mark = self._cpu_s()

    def cpu_s(self) -> float:
        return self._cpu_s() - self._at_mark


class Meter:
    """Samples a process and its children in a thread: CPU time between marks, peak PSS.

    PSS (proportional set size) splits shared pages between the processes sharing them, so the sum over
    a tree of forked workers is the memory they really cost.
    """

    def __init__(self, pid: int, interval_s: float = 0.5, children: bool = True):
        self.root = psutil.Process(pid)
        self.children = children  # False: the process alone (a buffer's session workers are metered apart)
        self.interval_s = interval_s
        self._peak_pss = 0
        self._max_procs = 1
        self._cpu_dead = 0.0  # CPU of children that exited since the mark
        self._last_cpu: dict[int, float] = {}
        self._cpu_at_mark = 0.0
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="meter", daemon=True)

    def __enter__(self) -> Meter:
        self.mark()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)

    def _tree(self) -> list[psutil.Process]:
        try:
            return [self.root, *(self.root.children(recursive=True) if self.children else [])]
        except psutil.NoSuchProcess:
            return []

    def _sample(self, with_memory: bool) -> float:
        """Total CPU of the tree now (exited children included); updates the PSS peak."""
        procs = self._tree()
        cpu: dict[int, float] = {}
        pss = 0
        for p in procs:
            with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, FileNotFoundError):
                t = p.cpu_times()
                cpu[p.pid] = t.user + t.system
                if with_memory:
                    pss += p.memory_full_info().pss
        with self._lock:
            self._cpu_dead += sum(v for k, v in self._last_cpu.items() if k not in cpu)
            self._last_cpu = cpu
            if with_memory:
                self._peak_pss = max(self._peak_pss, pss)
            self._max_procs = max(self._max_procs, len(procs))
            return self._cpu_dead + sum(cpu.values())

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample(with_memory=True)

    def mark(self) -> None:
        """Start the measured window: CPU counts from now (the PSS peak covers the whole run)."""
        total = self._sample(with_memory=False)
        with self._lock:
            self._cpu_at_mark = total

    def usage(self) -> Usage:
        """CPU since the mark, peak PSS and most processes since the meter started."""
        total = self._sample(with_memory=True)
        with self._lock:
            return Usage(total - self._cpu_at_mark, self._peak_pss / 2**20, self._max_procs)
