"""Start real server subprocesses on 127.0.0.1 for tests, with bounded waits."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import NamedTuple

import httpx

from rollout_buffer.policy import default_agent_user

ROOT = Path(__file__).resolve().parent.parent


def trusting_flags() -> list[str]:
    """`serve` flags of a server that trusts the suite as an operator trusts their own scripts: it reads input files
    in the temporary folder and the repository, runs the test agents, environments and interpreters named there
    (and the system's programs), installs requirements, passes any variable, runs agents as nobody or root. Tests of
    the default policy start `serve` without them (`Server(..., trusting=False)`)."""
    # The temporary folder, and pytest's where the suite gives it another (tests/leftovers.py).
    tmp = list(dict.fromkeys([tempfile.gettempdir(), os.environ.get("PYTEST_DEBUG_TEMPROOT", tempfile.gettempdir())]))
    code = [*tmp, str(ROOT), sys.prefix, "/usr/bin", "/usr/local/bin", "/bin"]
    users = dict.fromkeys([default_agent_user(), "nobody", "root"])
    return [*[f for t in tmp for f in ("--data-root", t)], "--data-root", str(ROOT),
            *[f for c in code for f in ("--allow-code", c)],
            "--allow-installs", "--allow-env", "*", *[f for u in users for f in ("--agent-user", u)]]


def free_port() -> int:
    """Return a TCP port that is free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_ports(n: int) -> int:
    """The first of `n` consecutive ports free on 127.0.0.1 right now."""
    for _ in range(100):
        first = free_port()
        socks = []
        try:
            for port in range(first, first + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", port))
            return first
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


def wait_http(url: str, timeout_s: float = 30.0, proc: subprocess.Popen | None = None) -> None:
    """Poll `url` until it answers 200, the process dies, or `timeout_s` passes."""
    deadline = time.monotonic() + timeout_s
    last: Exception | None = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before answering {url}")
        try:
            if httpx.get(url, timeout=1.0).status_code == 200:
                return
        except httpx.HTTPError as e:
            last = e
        time.sleep(0.05)
    raise TimeoutError(f"{url} did not answer within {timeout_s}s: {last}")


def stop_process(proc: subprocess.Popen | None) -> None:
    """SIGTERM the process group of a still running `proc`; SIGKILL it if it has not exited within 10 s."""
    if proc and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)


class Router(NamedTuple):
    """A running sglang-router: where it serves and where its Prometheus metrics are."""

    url: str
    metrics_url: str


@contextlib.contextmanager
def sglang_router(workers: list[str], log_path: Path, *extra: str, python: str = sys.executable,
                  timeout_s: float = 180.0) -> Iterator[Router]:
    """The real sglang-router (`python -m sglang_router.launch_router`, round robin, health checked every second) on
    free loopback ports, once every worker is registered and healthy: the router answers healthy a moment before
    its workers are registered, and its `/generate` fails until then. `timeout_s` bounds a failure only: on two
    loaded cores the router's start alone took 17 s, and real SGLang's `/health` generates a token."""
    port, metrics_port = free_port(), free_port()
    cmd = [python, "-m", "sglang_router.launch_router", "--worker-urls", *workers,
           "--host", "127.0.0.1", "--port", str(port), "--policy", "round_robin",
           # Its own metrics port: the default one (29000) may be another router's.
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port),
           "--health-check-interval-secs", "1", "--worker-startup-check-interval", "1",
           "--worker-startup-timeout-secs", str(int(timeout_s)), "--log-level", "warn", *extra]
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    router = Router(f"http://127.0.0.1:{port}", f"http://127.0.0.1:{metrics_port}/metrics")
    try:
        deadline = time.monotonic() + timeout_s
        while (seen := router_health(router.url)) != {w: True for w in workers}:
            assert proc.poll() is None, log_path.read_text(errors="replace")
            assert time.monotonic() < deadline, (f"router not ready within {timeout_s:g} s (its workers: {seen}):\n"
                                                 f"{log_path.read_text(errors='replace')}")
            time.sleep(0.1)
        yield router
    finally:
        stop_process(proc)


def router_health(router_url: str) -> dict[str, bool]:
    """Each worker the router lists, and whether it counts it healthy ({} while it does not answer)."""
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
        listed = httpx.get(router_url + "/workers", timeout=2).json()["workers"]
        return {w["url"]: w["is_healthy"] for w in listed}
    return {}


class Server:
    """A CLI subcommand of `rollout-buffer` running as a subprocess."""

    def __init__(self, args: list[str], health_path: str, port: int, log_path: Path, env: dict | None = None,
                 trusting: bool = True):
        self.args = [*args, *trusting_flags()] if trusting and args[:1] == ["serve"] else args
        self.port = port
        self.url = f"http://127.0.0.1:{port}"
        self.health_url = self.url + health_path
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.proc: subprocess.Popen | None = None

    def start(self, timeout_s: float = 60.0) -> Server:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_buffer", *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        try:
            wait_http(self.health_url, timeout_s, self.proc)
        except Exception:
            self.stop()
            raise RuntimeError(f"server failed to start; log:\n{self.log()}") from None
        return self

    def __enter__(self) -> Server:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def kill9(self) -> None:
        """SIGKILL the server: no shutdown hooks run."""
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        stop_process(self.proc)


@contextlib.contextmanager
def running(args: list[str], health_path: str, port: int, log_path: Path, env: dict | None = None,
            trusting: bool = True) -> Iterator[Server]:
    """Context manager: start a `rollout-buffer` subcommand, stop it on exit (`serve` with `trusting_flags()`
    unless `trusting` is False)."""
    srv = Server(args, health_path, port, log_path, env, trusting).start()
    try:
        yield srv
    finally:
        srv.stop()


@contextlib.contextmanager
def sim_engine(log_dir: Path, tokenizer: str, *extra: str) -> Iterator[Server]:
    """A `rollout-buffer sim-engine` subprocess on a free port with the given extra flags."""
    port = free_port()
    args = ["sim-engine", "--port", str(port), "--tokenizer", tokenizer, *extra]
    with running(args, "/health", port, log_dir / f"sim-{port}.log") as srv:
        yield srv


@contextlib.contextmanager
def buffer_server(log_dir: Path, *extra: str, trusting: bool = True) -> Iterator[Server]:
    """A `rollout-buffer serve` subprocess on a free port, its store and log in `log_dir`, with the extra flags
    (and `trusting_flags()` unless `trusting` is False)."""
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(log_dir / "data"), *extra]
    with running(args, "/healthz", port, log_dir / "buffer.log", trusting=trusting) as srv:
        yield srv


@contextlib.contextmanager
def session_host(log_dir: Path, engine_url: str, tokenizer: str, *extra: str, **run: object) -> Iterator[Server]:
    """A buffer (`serve` with the extra flags) holding an agent run that hosts sessions on `engine_url`; `run`
    adds to or overrides the run's `/start_rollout` payload."""
    with buffer_server(log_dir, *extra) as srv:
        start = httpx.post(f"{srv.url}/start_rollout", timeout=30, json={
            "task_type": "agent", "remote_engine_url": engine_url, "tokenizer_path": tokenizer, **run})
        assert start.status_code == 200 and start.json()["num_items"] == 0, start.text
        yield srv


def stopped_while_long_polling(srv: Server, also: Callable[[], object] | None = None, polls: int = 1
                               ) -> tuple[httpx.Response, float]:
    """SIGTERM `srv` while a client long-polls `/get_rollout_data` (and whatever `also` opens, `polls` in all);
    the answer that client got and the seconds from the signal to the exit."""
    answers: list[httpx.Response] = []
    listening = threading.Thread(target=lambda: answers.append(httpx.post(
        f"{srv.url}/get_rollout_data", json={"wait_s": 600, "lease_s": 60}, timeout=120)))
    listening.start()
    if also is not None:
        also()
    deadline = time.monotonic() + 30
    while f"rollout_buffer_long_polls {polls:.1f}" not in httpx.get(f"{srv.url}/metrics").text:
        assert time.monotonic() < deadline, f"{polls} long-polls wait"
        time.sleep(0.05)
    assert srv.proc is not None
    stopped = time.monotonic()
    srv.proc.send_signal(signal.SIGTERM)
    listening.join(60)
    assert answers, "the long-poll was answered"
    srv.proc.wait(60)
    return answers[0], time.monotonic() - stopped
