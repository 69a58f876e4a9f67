"""Venvs of environment packages (verifiers, openenv) for the tests: created once per requirement into a cache
folder (`ROLLOUT_BUFFER_ENV_VENVS`, default `~/.cache/rollout-buffer/env-venvs`) under a file lock, reused after."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
from pathlib import Path


def cached_venv(*requirements: str) -> str:
    """The interpreter of a venv holding `requirements` (pip specifiers), created there the first time."""
    root = Path(os.environ.get("ROLLOUT_BUFFER_ENV_VENVS", Path.home() / ".cache" / "rollout-buffer" / "env-venvs"))
    venv = root / "-".join(r.replace("==", "-") for r in requirements)
    python = venv / "bin" / "python"
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:  # test workers share the folder: one installs, the others wait
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / ".complete").exists():
            subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True, timeout=300)
            done = subprocess.run([str(python), "-m", "pip", "install", "-q", *requirements], capture_output=True,
                                  text=True, timeout=900)
            assert done.returncode == 0, done.stderr[-3000:]
            (venv / ".complete").write_text("\n".join(requirements))
    return str(python)
