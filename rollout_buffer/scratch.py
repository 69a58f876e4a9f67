"""Scratch folders (an agent's workspace, a run's environment processes') that do not outlive the process that
made them, even when it is killed by SIGKILL or the OOM killer.

A process makes its scratch folders inside one folder of its own, `rb-scratch-*` under the parent (the system's
temporary folder unless given), whose lock file it holds locked (`flock`) for its whole life. Removing a scratch
folder when its user is done stays the caller's job; what a killed process could not remove, the next process to
make a scratch folder under the same parent removes: a folder whose lock anyone can take has no owner left."""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import IO

log = logging.getLogger(__name__)

_PREFIX = "rb-scratch-"
_LOCK = "owner.lock"

_guard = threading.Lock()
_owned: dict[Path, tuple[Path, IO[bytes]]] = {}  # parent -> (this process's folder, its lock file, held open)


def scratch_folder(prefix: str, parent: str | Path | None = None) -> Path:
    """A new empty folder named `prefix…` (mode 0700), in this process's own folder under `parent` (mode 0711: other
    users reach what they are given inside, but list nothing). The first call for a parent in a process removes the
    folders of processes that died without removing theirs. Blocking: call it in a thread from async code."""
    base = Path(parent if parent is not None else tempfile.gettempdir()).resolve()
    with _guard:
        own = _owned.get(base)
        if own is None or not own[0].is_dir():  # the first call, or a cleaner of old files took it
            own = _owned[base] = _claim(base)
            _remove_orphans(base, own[0])
    return Path(tempfile.mkdtemp(prefix=prefix, dir=own[0]))


def _claim(base: Path) -> tuple[Path, IO[bytes]]:
    """This process's folder under `base`, its lock held. The lock file is locked before it gets the name other
    processes look for, so none of them can ever take it from a live owner."""
    folder = Path(tempfile.mkdtemp(prefix=_PREFIX, dir=base))
    folder.chmod(0o711)
    fd, pending = tempfile.mkstemp(prefix=".lock-", dir=folder)
    lock = os.fdopen(fd, "wb")
    fcntl.flock(lock, fcntl.LOCK_EX)
    os.rename(pending, folder / _LOCK)
    atexit.register(shutil.rmtree, folder, True)  # a process that ends normally leaves nothing either
    return folder, lock


def _remove_orphans(base: Path, own: Path) -> None:
    """Remove every `rb-scratch-*` folder under `base` whose owner is gone (its lock free). Folders of other users,
    and folders still being claimed (no lock file yet), are left alone."""
    uid = os.geteuid()
    for folder in base.glob(f"{_PREFIX}*"):
        if folder == own:
            continue
        try:
            if folder.stat().st_uid != uid:
                continue
            with open(folder / _LOCK, "rb") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
                log.info("removing %s: the process that made it is gone", folder)
                shutil.rmtree(folder, ignore_errors=True)
        except OSError:  # no lock file yet, its owner holds the lock, or another process removed it first
            continue
