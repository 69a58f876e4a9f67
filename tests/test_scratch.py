"""Scratch folders of a process killed by SIGKILL are removed by the next process that makes one; a live process's
are not."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

from rollout_buffer.processes import scratch_folder

MAKER = """
import sys, time
from rollout_buffer.processes import scratch_folder
folder = scratch_folder("rb-agent-", sys.argv[1])
(folder / "checkout.txt").write_text("a large checkout")
print(folder, flush=True)
time.sleep(120)
"""


def start_maker(parent: Path) -> tuple[subprocess.Popen[str], Path]:
    """A process that makes a scratch folder under `parent` and holds it: (the process, its folder)."""
    proc = subprocess.Popen([sys.executable, "-c", MAKER, str(parent)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout is not None
    return proc, Path(proc.stdout.readline().strip())


def test_a_killed_process_leaves_nothing_once_another_makes_a_scratch_folder(tmp_path: Path) -> None:
    killed, killed_folder = start_maker(tmp_path)
    live, live_folder = start_maker(tmp_path)
    being_claimed = tmp_path / "rb-scratch-just-made"  # another process between making it and locking it
    being_claimed.mkdir()
    try:
        os.kill(killed.pid, signal.SIGKILL)
        killed.wait(10)
        assert (killed_folder / "checkout.txt").exists()

        mine = scratch_folder("rb-env-", tmp_path)
        assert not killed_folder.parent.exists(), "the killed process's folder is removed"
        assert (live_folder / "checkout.txt").exists() and being_claimed.exists()
        assert mine.is_dir() and not any(mine.iterdir()) and mine.name.startswith("rb-env-")
        # Other users reach what a run gives them inside (an agent's work folder), but list nothing.
        assert stat.S_IMODE(mine.stat().st_mode) == 0o700
        assert stat.S_IMODE(mine.parent.stat().st_mode) == 0o711
        assert scratch_folder("rb-env-", tmp_path).parent == mine.parent, "one folder of its own per process"
    finally:
        live.kill()
        live.wait(10)
