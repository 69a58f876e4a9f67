"""Environment worker processes: an environment runs in its own interpreter (its venv pins its own dependencies),
one long-lived process per worker, driven over JSON lines on its stdin/stdout (see `verifiers_worker.py`); its
policy is a buffer session it reaches over HTTP.

A `ProcessPool` (pool.py) of them starts them lazily and replaces one that died: the requests it held fail with
`EnvWorkerDied` (the caller decides whether to retry).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import itertools
import logging
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

from rollout_buffer.environments.pool import EnvError
from rollout_buffer.processes import end_process, fate_shared

log = logging.getLogger(__name__)

_STDERR_TAIL_LINES = 40
_STOP_GRACE_S = 5.0
_LINE_LIMIT = 64 * 1024 * 1024  # a task list or an episode's summary on one line


class EnvLoadError(EnvError):
    """The worker could not load the environment; `field` names the run option at fault (as the worker says)."""

    def __init__(self, field: str, message: str):
        super().__init__("env_load", message)
        self.field = field


class EnvWorkerDied(EnvError):
    """The worker process ended with requests in flight (crashed, killed, out of memory)."""

    def __init__(self, message: str):
        super().__init__("env_worker_crash", message)


@dataclass(frozen=True)
class WorkerSpec:
    """How to start a worker: the environment's interpreter running `script`, the `load` request it gets first."""

    python: str
    script: Path
    load: dict[str, Any]
    env: dict[str, str] = field(default_factory=dict)
    cwd: Path | None = None
    start_timeout_s: float = 300.0
    name: str = "env"
    user: tuple[int, int] | None = None  # (uid, gid) the worker runs as, when not the buffer's

    def environ(self) -> dict[str, str]:
        """The worker's environment: ours, the venv's `bin` first on PATH (its tools, e.g. `uv`), `env` on top;
        run as another user, its home is its scratch folder (where its tools' caches go)."""
        bin_dir = str(Path(self.python).parent)
        home = {"HOME": str(self.cwd)} if self.user is not None and self.cwd is not None else {}
        return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}",
                "PYTHONUNBUFFERED": "1", **home, **self.env}

    def argv(self) -> list[str]:
        """The worker's command line, tied to the buffer and run as `user`."""
        return fate_shared([self.python, "-u", str(self.script)], self.user)


class EnvWorker:
    """One worker process and its requests in flight."""

    _ids = itertools.count()

    def __init__(self, spec: WorkerSpec, number: int):
        self.spec, self.number = spec, number
        self.proc: asyncio.subprocess.Process | None = None
        self.pending: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self.ready: dict[str, Any] = {}
        self.stderr_tail: collections.deque[str] = collections.deque(maxlen=_STDERR_TAIL_LINES)
        self._tasks: list[asyncio.Task[None]] = []
        self._started: asyncio.Future[dict[str, Any]] | None = None
        self.dead = False
        self.leases = 0

    @property
    def label(self) -> str:
        pid = self.proc.pid if self.proc is not None else "-"
        return f"{self.spec.name} worker {self.number} (pid {pid})"

    async def start(self) -> None:
        """Start the process and wait until it loaded the environment; EnvError with its reason if not."""
        spec = self.spec
        try:
            self.proc = await asyncio.create_subprocess_exec(
                *spec.argv(), stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=spec.environ(),
                cwd=spec.cwd, limit=_LINE_LIMIT, start_new_session=True)
        except OSError as e:
            raise EnvError("env_start", f"cannot start {spec.python}: {e.strerror or e}") from None
        self._started = asyncio.get_running_loop().create_future()
        self._tasks = [asyncio.create_task(self._read_answers(), name=f"{self.label} answers"),
                       asyncio.create_task(self._read_stderr(), name=f"{self.label} stderr")]
        self._write({"op": "load", "env": spec.load})
        try:
            self.ready = await asyncio.wait_for(asyncio.shield(self._started), spec.start_timeout_s)
        except TimeoutError:
            await self.stop()
            raise EnvError("env_start", f"{self.label} did not load the environment within "
                                 f"{spec.start_timeout_s:g} s; stderr: {self.stderr_text()!r}") from None
        except EnvError:
            await self.stop()
            raise
        log.info("%s ready: %s", self.label, self.ready)

    async def request(self, message: dict[str, Any], timeout_s: float | None = None) -> dict[str, Any]:
        """Send one request and wait for its answer; on timeout the worker is told to cancel it."""
        if self.dead:
            raise EnvWorkerDied(f"{self.label} is gone")
        rid = f"r{next(self._ids)}"
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self.pending[rid] = future
        try:
            self._write({**message, "id": rid})
            return await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            self._cancel(rid)
            raise EnvError("env_timeout", f"no answer within {timeout_s:g} s; the episode was cancelled"
                                 ) from None
        except asyncio.CancelledError:
            self._cancel(rid)
            raise
        finally:
            self.pending.pop(rid, None)

    def stderr_text(self) -> str:
        """The last lines the worker wrote to stderr (its logs, a traceback)."""
        return "\n".join(self.stderr_tail)[-2000:]

    async def stop(self) -> None:
        """Close its stdin (it ends its episodes and exits), then terminate and kill what is left."""
        proc = self.proc
        self.dead = True
        if proc is not None and proc.stdin is not None:
            await end_process(proc, proc.stdin.close, _STOP_GRACE_S)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._fail_pending(EnvWorkerDied(f"{self.label} was stopped"))

    def _cancel(self, rid: str) -> None:
        with contextlib.suppress(EnvError, OSError, RuntimeError):
            self._write({"op": "cancel", "target": rid, "id": f"{rid}-cancel"})

    def _write(self, message: dict[str, Any]) -> None:
        proc = self.proc
        if proc is None or proc.stdin is None or proc.stdin.is_closing():
            raise EnvWorkerDied(f"{self.label} is gone")
        proc.stdin.write(orjson.dumps(message) + b"\n")

    async def _read_answers(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        stdout = self.proc.stdout
        try:
            while line := await stdout.readline():
                self._answer(orjson.loads(line))
        except (ValueError, asyncio.LimitOverrunError) as e:  # not our protocol: the worker is unusable
            log.error("%s wrote a line that is not an answer (%s); stopping it", self.label, e)
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        code = await self.proc.wait()
        self.dead = True
        reason = f"{self.label} exited with code {code}; stderr: {self.stderr_text()!r}"
        if self._started is not None and not self._started.done():
            self._started.set_exception(EnvError("env_start", reason))
        if self.pending:
            log.error("%s with %d requests in flight", reason, len(self.pending))
        self._fail_pending(EnvWorkerDied(reason))

    def _answer(self, message: dict[str, Any]) -> None:
        started = self._started
        if started is not None and not started.done():
            if "fatal" in message:
                log.error("%s cannot load the environment:\n%s", self.label, message.get("traceback", ""))
                started.set_exception(EnvLoadError(str(message.get("field") or "env_id"), str(message["fatal"])))
            else:
                started.set_result(message)
            return
        future = self.pending.get(str(message.get("id")))
        if future is None or future.done():
            return  # answered after its caller stopped waiting (time limit, cancel)
        if "error" in message:
            future.set_exception(EnvError(str(message.get("kind") or "env_error"), str(message["error"])))
        else:
            future.set_result(message.get("result") or {})

    async def _read_stderr(self) -> None:
        assert self.proc is not None and self.proc.stderr is not None
        stderr = self.proc.stderr
        while line := await stderr.readline():
            text = line.decode(errors="replace").rstrip()
            self.stderr_tail.append(text)
            log.debug("%s: %s", self.label, text)

    def _fail_pending(self, error: EnvError) -> None:
        for future in self.pending.values():
            if not future.done():
                future.set_exception(error)
                future.exception()  # retrieved: a caller that stopped waiting leaves no warning


def worker_script(name: str) -> Path:
    """The path of a worker script shipped beside this module (run by the environment's interpreter)."""
    return Path(__file__).with_name(f"{name}_worker.py")


def python_env_paths(paths: Sequence[str]) -> dict[str, str]:
    """PYTHONPATH for a worker that imports environments from these folders as well as its venv."""
    joined = os.pathsep.join([*paths, *filter(None, [os.environ.get("PYTHONPATH")])])
    return {"PYTHONPATH": joined} if joined else {}
