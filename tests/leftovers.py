"""A run of the suite leaves nothing behind: no process it started, no scratch folder.

The process that runs the session (xdist's controller, or the only one) marks its environment before any worker
starts, and points TMPDIR at a folder of the run's own (pytest's tmp_path folders stay in the usual temp dir, where
pytest keeps the last runs'): every process the suite starts inherits both, so another suite running at the same
time is told apart. When the session ends, processes still carrying the mark are given a bounded grace to exit,
then named, killed and counted as a failure. In the run's folder, what a buffer's next start would remove (the
scratch and agent-socket folders of processes that are gone) is removed the same way; anything else left there
counts as a failure too, and the folder is removed.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from rollout_buffer.processes import remove_orphaned_scratch
from rollout_buffer.server.listeners import remove_orphaned_agent_folders

MARK = "ROLLOUT_BUFFER_TEST_RUN"
# Files a tool keeps in the temp dir by design: uv's lock files (`uv-<hash>.lock`), made when environments' venvs are.
KEPT = ("uv-",)
GRACE_S = 20.0
_found: dict[str, list[str]] = {}


def _is_controller(config: pytest.Config) -> bool:
    return not hasattr(config, "workerinput")


def marked_processes(mark: str) -> dict[int, str]:
    """Processes whose environment carries `MARK=mark`: pid → command line."""
    needle = f"{MARK}={mark}".encode()
    found: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if needle not in (entry / "environ").read_bytes().split(b"\0"):
                continue
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue  # exited, waiting for its parent to reap it
            found[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone, or another user's
            continue
    return found


def pytest_configure(config: pytest.Config) -> None:
    if not _is_controller(config) or not Path("/proc/self/environ").exists():
        return
    os.environ[MARK] = uuid.uuid4().hex
    usual = tempfile.gettempdir()
    run_folder = tempfile.mkdtemp(prefix="rb-suite-", dir=usual)
    os.chmod(run_folder, 0o1777)  # as /tmp: agents the suite runs as another user make their files there too
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", usual)
    os.environ.setdefault("RAY_TMPDIR", usual)  # Ray's own sessions stay where Ray keeps them
    # torch's compile cache, shared by every run as it is outside the suite
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(usual, f"torchinductor_{getpass.getuser()}"))
    os.environ["TMPDIR"] = run_folder
    tempfile.tempdir = None  # this process takes the run's folder too


@pytest.hookimpl(trylast=True)  # after xdist has ended its workers
def pytest_sessionfinish(session: pytest.Session) -> None:
    mark = os.environ.get(MARK)
    if not _is_controller(session.config) or mark is None:
        return
    deadline = time.monotonic() + GRACE_S
    while (alive := marked_processes(mark)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for pid in alive:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    run_folder = os.environ["TMPDIR"]
    remove_orphaned_scratch(Path(run_folder))
    remove_orphaned_agent_folders(Path(run_folder))
    left = sorted(os.path.join(run_folder, name) for name in os.listdir(run_folder) if not name.startswith(KEPT))
    shutil.rmtree(run_folder, ignore_errors=True)
    _found.update(processes=[f"{pid}: {cmd}" for pid, cmd in sorted(alive.items())], folders=left)
    if alive or left:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _found.get("processes") or _found.get("folders"):
        terminalreporter.section("left behind by the suite", sep="=", red=True)
        for line in _found["processes"]:
            terminalreporter.line(f"process (killed) {line}")
        for folder in _found["folders"]:
            terminalreporter.line(f"left in the run's folder (removed) {folder}")
