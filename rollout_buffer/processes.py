"""How the buffer's child processes — an environment's, agents' commands, session workers — are started and ended:
tied to the process that starts them, as another user when a run asks, their process group killed when they do
not end when asked."""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import shutil
import signal
from collections.abc import Callable, Sequence
from pathlib import Path


def fate_shared(argv: Sequence[str], switch_to: tuple[int, int] | None = None) -> list[str]:
    """`argv` killed when the process that started it (the buffer, a Ray actor) dies, even by SIGKILL, and run as
    `switch_to` (uid, gid) when given: `setpriv` (util-linux) switches the user, then sets the parent-death signal,
    which the exec keeps (not subprocess's own `user=`: uvloop's subprocesses lack it). Without setpriv the process
    may outlive a crashed buffer; PermissionError when it would have to switch users."""
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        if switch_to is not None:
            raise PermissionError("needs setpriv (util-linux) to run as another user")
        return list(argv)
    ids = ["--reuid", str(switch_to[0]), "--regid", str(switch_to[1]), "--clear-groups"] if switch_to else []
    return [setpriv, *ids, "--pdeathsig", "KILL", "--", *argv]


def user_ids(name: str, field: str) -> tuple[int, int] | None:
    """(uid, gid) of the user `name` when that is another user than the buffer's, else None; ValueError naming
    `field` when there is no such user or the buffer (not root) cannot switch to it."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(f"{field}: no user {name!r}") from None
    if entry.pw_uid == os.geteuid():
        return None
    if os.geteuid() != 0:
        raise ValueError(f"{field}: running as {name!r} needs a buffer running as root")
    return entry.pw_uid, entry.pw_gid


def give_to(path: Path, ids: tuple[int, int] | None) -> None:
    """Make a scratch folder the user's (nothing when the processes run as the buffer's user)."""
    if ids is not None:
        os.chown(path, *ids)


async def end_process(proc: asyncio.subprocess.Process, ask: Callable[[], None], grace_s: float) -> None:
    """Ask a process to end (`ask`: close its stdin, send SIGTERM), give it `grace_s`, then SIGKILL its process
    group (it was started in a session of its own)."""
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError, OSError, RuntimeError):
        ask()
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
