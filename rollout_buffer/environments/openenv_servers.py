"""OpenEnv servers for a run: one the user runs (a URL), or processes the buffer starts from a command (one per
pool slot, on a free loopback port), each serving a bounded number of sessions."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import signal
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from rollout_buffer.environments.openenv_client import fetch_schema
from rollout_buffer.environments.pool import EnvError
from rollout_buffer.processes import end_process, fate_shared

log = logging.getLogger(__name__)

PORT_PLACEHOLDER = "{port}"
_STDERR_TAIL_LINES = 40
_STOP_GRACE_S = 5.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass(frozen=True)
class ServerSpec:
    """How to reach or start a run's OpenEnv servers."""

    url: str | None = None
    command: list[str] | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    start_timeout_s: float = 120.0
    user: tuple[int, int] | None = None  # (uid, gid) started servers run as, when not the buffer's


class OpenEnvServer:
    """One server: started from `spec.command` (`{port}` replaced by a free port) or, with `spec.url`, the user's."""

    def __init__(self, spec: ServerSpec, number: int, http: httpx.AsyncClient):
        self.spec, self.number, self.http = spec, number, http
        self.url = spec.url.rstrip("/") if spec.url else ""
        self.proc: asyncio.subprocess.Process | None = None
        self.output_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self.schema: dict[str, Any] = {}
        self.dead = False
        self.leases = 0
        self._tasks: list[asyncio.Task[None]] = []

    @property
    def label(self) -> str:
        if self.proc is None:
            return f"OpenEnv server {self.url}"
        return f"OpenEnv server {self.number} (pid {self.proc.pid}, {self.url})"

    async def start(self) -> None:
        """Start it (for a command) and wait until it answers `/schema`; EnvError with the reason if it does not."""
        if self.spec.command is not None:
            port = _free_port()
            self.url = f"http://127.0.0.1:{port}"
            argv = [a.replace(PORT_PLACEHOLDER, str(port)) for a in self.spec.command]
            try:
                self.proc = await asyncio.create_subprocess_exec(
                    *fate_shared(argv, self.spec.user), stdin=asyncio.subprocess.DEVNULL,
                    stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT, env=self._environ(port),
                    cwd=self.spec.cwd, start_new_session=True)
            except OSError as e:
                raise EnvError("openenv_start", f"openenv_command: cannot start {argv[0]}: {e.strerror or e}"
                               ) from None
            self._tasks = [asyncio.create_task(self._read_output(), name=f"{self.label} output")]
        deadline = time.monotonic() + self.spec.start_timeout_s
        while True:
            if self.proc is not None and self.proc.returncode is not None:
                await self.stop()
                raise EnvError("openenv_start", f"{self.label} exited with code {self.proc.returncode} before "
                               f"serving; output: {self.output_text()!r}")
            try:
                self.schema = await fetch_schema(self.http, self.url)
                break
            except EnvError as e:
                if self.proc is None or time.monotonic() > deadline:
                    await self.stop()
                    raise EnvError("openenv_start", f"{e}; output: {self.output_text()!r}") from None
            await asyncio.sleep(0.2)
        log.info("%s ready", self.label)

    def _environ(self, port: int) -> dict[str, str]:
        home = {"HOME": str(self.spec.cwd)} if self.spec.user is not None and self.spec.cwd is not None else {}
        return {**os.environ, "PORT": str(port), **home, **self.spec.env}

    async def settle(self, wait_s: float = 3.0) -> None:
        """After a session broke: a started server that exits within `wait_s` is marked dead (and replaced at the
        next lease)."""
        if self.proc is None:
            return
        try:
            await asyncio.wait_for(asyncio.shield(self.proc.wait()), wait_s)
        except TimeoutError:
            return
        self.dead = True

    def output_text(self) -> str:
        """The last lines the server printed."""
        return "\n".join(self.output_tail)[-2000:]

    async def stop(self) -> None:
        """Terminate a started server (its process group), then kill what is left."""
        self.dead = True
        proc = self.proc
        if proc is not None:
            await end_process(proc, lambda: os.killpg(proc.pid, signal.SIGTERM), _STOP_GRACE_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _read_output(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        while line := await self.proc.stdout.readline():
            text = line.decode(errors="replace").rstrip()
            self.output_tail.append(text)
            log.debug("%s: %s", self.label, text)
        code = await self.proc.wait()
        if not self.dead:
            log.error("%s exited with code %s; output: %s", self.label, code, self.output_text())
        self.dead = True
