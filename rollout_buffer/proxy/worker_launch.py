"""Where session workers run: the processes `serve --session-workers` starts, here on the buffer's machine
(`LocalLauncher`) or on a Ray cluster's nodes (`executors.ray_session_workers.RayLauncher`, with `--executor
ray`). A launcher starts worker `index` with the arguments and secrets the pool gives it, says where it answers,
and reports when it exits; the pool (`proxy.worker_pool`) does the rest — health, recovery, placement."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys
from typing import Any, Protocol
from urllib.parse import urlsplit, urlunsplit

from rollout_buffer.config import ServerConfig
from rollout_buffer.processes import end_process

WORKER_COMMAND = (sys.executable, "-m", "rollout_buffer", "session-worker")
_STOP_GRACE_S = 15.0  # how long a worker has to end after SIGTERM (its turns in flight) before it is killed


# Where a started worker answers: its URL as the buffer reaches it, as agents do, and which process it is (for
# /status: pid, node).
WorkerAddress = tuple[str, str, dict[str, Any]]


class WorkerLauncher(Protocol):
    """Starts and stops session worker processes."""

    buffer_url: str  # the buffer as the workers reach it

    async def start(self, index: int, args: list[str], secrets: dict[str, str]) -> WorkerAddress:
        """Start worker `index` (`rollout-buffer session-worker` with `args`, `secrets` in its environment only)."""
        ...

    async def wait(self, index: int) -> int | None:
        """Return when worker `index` exited: its exit code (None when unknown: its host is gone)."""
        ...

    async def stop(self, index: int) -> None:
        """Stop worker `index` (SIGTERM, then SIGKILL)."""

    async def aclose(self) -> None:
        """Every worker is stopped: free what the launcher holds."""


def fate_shared_command(args: list[str]) -> list[str]:
    """The worker's command line, killed with the process that starts it, even by SIGKILL (`setpriv`)."""
    argv = [*WORKER_COMMAND, *args]
    setpriv = shutil.which("setpriv")
    return [setpriv, "--pdeathsig", "KILL", "--", *argv] if setpriv is not None else argv


class LocalLauncher:
    """Workers as the buffer's child processes, on consecutive ports from `session_worker_port`, bound where the
    buffer is; they die with it. A worker started again gets the same port: its sessions' URLs stay valid."""

    def __init__(self, config: ServerConfig):
        self.config = config
        self.buffer_url = config.local_url
        self._procs: dict[int, asyncio.subprocess.Process] = {}

    async def start(self, index: int, args: list[str], secrets: dict[str, str]) -> WorkerAddress:
        """Start worker `index` on its port."""
        port = self.config.first_worker_port + index
        argv = fate_shared_command(["--host", self.config.host, "--port", str(port), *args])
        proc = self._procs[index] = await asyncio.create_subprocess_exec(
            *argv, env={**os.environ, **secrets}, start_new_session=True, stdin=asyncio.subprocess.DEVNULL)
        return with_port(self.config.local_url, port), with_port(self.config.buffer_url, port), {"pid": proc.pid}

    async def wait(self, index: int) -> int | None:
        """Its exit code."""
        return await self._procs[index].wait()

    async def stop(self, index: int) -> None:
        """SIGTERM (its sessions stay stored), then SIGKILL its group past `_STOP_GRACE_S`."""
        proc = self._procs.get(index)
        if proc is not None:
            await end_process(proc, proc.terminate, _STOP_GRACE_S)

    async def aclose(self) -> None:
        """Nothing left to free."""


def with_port(url: str, port: int) -> str:
    """`url` with its port replaced."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    return urlunsplit(parts._replace(netloc=f"[{host}]:{port}" if ":" in host else f"{host}:{port}"))
