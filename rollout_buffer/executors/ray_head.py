"""The buffer's own Ray head (`serve --executor ray` without `--ray-address`): `ray start --head --block` in a
session of its own.

`ray.init()` would start the head's processes (GCS, raylet, agents) in the buffer's process group. A SIGTERM to that
group (`kill -- -PGID`, a supervisor stopping the group) then killed them along with the buffer, and the buffer's
Ray driver aborted the process while it was shutting down, before the store was closed. In a session of its own
the head gets no signal sent to the buffer's group; the buffer stops it last, after its actors. A parent-death
signal takes it down with a buffer that is SIGKILLed. Its output goes to the buffer's, as `ray.init()`'s did.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_RAY_CLI = (sys.executable, "-m", "ray.scripts.scripts")


class LocalHead:
    """A running `ray start --head --block`; `temp_dir` holds its sessions (logs) and its address file."""

    def __init__(self, proc: asyncio.subprocess.Process, temp_dir: Path):
        self.proc = proc
        self.temp_dir = temp_dir

    @classmethod
    async def start(cls, secret: str | None) -> LocalHead:
        """Start the head from the event loop's thread, which lives as long as the buffer (the parent-death signal
        follows the thread that started the process). Variables holding `secret` (the buffer's token) are not
        passed on to Ray's processes and the actors they start."""
        # Short: Ray's Unix sockets live under it. Its own, so `ray.init()` elsewhere on the machine does not
        # find this head as "the current cluster" (an address file in /tmp/ray would say so).
        temp_dir = Path(tempfile.mkdtemp(prefix="rb-ray-"))
        env = {k: v for k, v in os.environ.items() if not secret or v != secret}
        env["RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S"] = "0"  # nothing to drain: the buffer stopped its actors first
        # Ray's token authentication on unless RAY_AUTH_MODE says otherwise, with a token made when there is none,
        # as a local `ray.init()` does (`ray start` alone turns it on only when a token exists). Ray versions
        # without it know neither the variable nor the command.
        env["RAY_AUTH_MODE"] = env.get("RAY_AUTH_MODE", "token")
        if env["RAY_AUTH_MODE"].lower() == "token":
            made = await asyncio.create_subprocess_exec(
                *_RAY_CLI, "get-auth-token", "--generate", stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL, env=env)
            await made.wait()
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up before the fork: the child only calls it

        def die_with_parent() -> None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)

        proc = await asyncio.create_subprocess_exec(
            # A cluster of this machine only: on loopback, reached by nothing else.
            *_RAY_CLI, "start", "--head", "--block", "--port=0", "--node-ip-address=127.0.0.1",
            f"--temp-dir={temp_dir}", stdin=subprocess.DEVNULL,
            env=env, start_new_session=True, preexec_fn=die_with_parent)
        log.info("ray executor: starting a local Ray head (pid %d, logs in %s)", proc.pid, temp_dir)
        return cls(proc, temp_dir)

    async def wait_ready(self, timeout_s: float = 120.0) -> None:
        """Wait until the head wrote its address (`ray.init(address="auto", _temp_dir=temp_dir)` then joins it);
        RuntimeError when it exits or does not come up in time."""
        address_file = self.temp_dir / "ray_current_cluster"
        deadline = time.monotonic() + timeout_s
        while not (address_file.exists() and address_file.read_text().strip()):
            if self.proc.returncode is not None or time.monotonic() > deadline:
                raise RuntimeError(f"the local Ray head did not start (exit code {self.proc.returncode}; its output "
                                   "is in this log)")
            await asyncio.sleep(0.1)

    async def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM the head, which stops its processes; SIGKILL its process group when it has not exited in time."""
        with contextlib.suppress(ProcessLookupError):
            self.proc.terminate()
        try:
            await asyncio.wait_for(self.proc.wait(), timeout_s)
        except TimeoutError:
            os.killpg(self.proc.pid, signal.SIGKILL)  # its own group (a new session): never the buffer's
            await self.proc.wait()
        log.info("ray executor: local Ray head stopped")
