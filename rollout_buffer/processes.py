"""How the buffer's child processes — an environment's, agents' commands, session workers — are started and ended:
tied to the process that starts them, as another user when a run asks, their process group killed when they do
not end when asked; and their scratch folders, which do not outlive the process that made them either.

A process makes its scratch folders inside one folder of its own, `rb-scratch-*` under the parent (the system's
temporary folder unless given), whose lock file it holds locked (`flock`) for its whole life. Removing a scratch
folder when its user is done stays the caller's job; what a process killed by SIGKILL (or the OOM killer) could
not remove, the next process to make a scratch folder under the same parent removes: a folder whose lock anyone
can take has no owner left."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import fcntl
import logging
import os
import pwd
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

_SCRATCH_PREFIX = "rb-scratch-"
_SCRATCH_LOCK = "owner.lock"
_scratch_guard = threading.Lock()
_scratch_owned: dict[Path, tuple[Path, IO[bytes]]] = {}  # parent -> (this process's folder, its lock, held open)


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


def scratch_folder(prefix: str, parent: str | Path | None = None) -> Path:
    """A new empty folder named `prefix…` (mode 0700), in this process's own folder under `parent` (mode 0711: other
    users reach what they are given inside, but list nothing). The first call for a parent in a process removes the
    folders of processes that died without removing theirs. Blocking: call it in a thread from async code."""
    base = Path(parent if parent is not None else tempfile.gettempdir()).resolve()
    with _scratch_guard:
        own = _scratch_owned.get(base)
        if own is None or not own[0].is_dir():  # the first call, or a cleaner of old files took it
            own = _scratch_owned[base] = _claim_scratch(base)
            remove_orphaned_scratch(base, own[0])
    return Path(tempfile.mkdtemp(prefix=prefix, dir=own[0]))


def _claim_scratch(base: Path) -> tuple[Path, IO[bytes]]:
    """This process's folder under `base`, its lock held. The lock file is locked before it gets the name other
    processes look for, so none of them can ever take it from a live owner."""
    folder = Path(tempfile.mkdtemp(prefix=_SCRATCH_PREFIX, dir=base))
    folder.chmod(0o711)
    fd, pending = tempfile.mkstemp(prefix=".lock-", dir=folder)
    lock = os.fdopen(fd, "wb")
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.rename(pending, folder / _SCRATCH_LOCK)
    atexit.register(shutil.rmtree, folder, True)  # a process that ends normally leaves nothing either
    return folder, lock


def remove_orphaned_scratch(base: Path, own: Path | None = None) -> None:
    """Remove every `rb-scratch-*` folder under `base` (but `own`) whose owner is gone (its lock free). Folders of
    other users, and folders still being claimed (no lock file yet), are left alone."""
    uid = os.geteuid()
    for folder in base.glob(f"{_SCRATCH_PREFIX}*"):
        if folder == own:
            continue
        try:
            if folder.stat().st_uid != uid:
                continue
            with open(folder / _SCRATCH_LOCK, "rb") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                log.info("removing %s: the process that made it is gone", folder)
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # no lock file yet, its owner holds the lock, or another process removed it first
            continue
