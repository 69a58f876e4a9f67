"""Venvs the buffer makes for environments from a requirement list: one per list, in a cache folder
(`ROLLOUT_BUFFER_ENV_VENVS`, default `~/.cache/rollout-buffer/env-venvs`), created once under a file lock and
reused by every later run (and every process) that names the same list. uv makes and fills them: it resolves and
unpacks in parallel and keeps one cache of wheels, where pip takes many times as long for a list as large as
verifiers'. Its index settings apply (`UV_INDEX_URL`, `UV_EXTRA_INDEX_URL`, `uv.toml`), not pip's; TLS trusts the
system's certificate store."""

from __future__ import annotations

import fcntl
import hashlib
import logging
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

log = logging.getLogger(__name__)

_READY = ".complete"
_INSTALL_TIMEOUT_S = 1800


def venv_root() -> Path:
    """Where environment venvs live."""
    default = Path.home() / ".cache" / "rollout-buffer" / "env-venvs"
    return Path(os.environ.get("ROLLOUT_BUFFER_ENV_VENVS", default))


def venv_python(requirements: Sequence[str], field: str = "requirements") -> str:
    """The interpreter of a venv holding `requirements` (pip specifiers), created the first time (blocking, for as
    long as the downloads take; call it in a thread). ValueError naming `field` when uv cannot install them."""
    if not requirements or not all(isinstance(r, str) and r.strip() for r in requirements):
        raise ValueError(f"{field}: a list of pip requirement specifiers")
    try:
        from uv import find_uv_bin  # an extra: only servers that make environment venvs need it
    except ImportError:
        raise ValueError(f"{field}: the buffer makes venvs from requirement lists with uv, which is not installed: "
                         "pip install 'rollout-buffer[environments]'") from None
    key = hashlib.sha256("\n".join(sorted(r.strip() for r in requirements)).encode()).hexdigest()[:16]
    venv = venv_root() / key
    python = venv / "bin" / "python"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(venv.parent / f"{key}.lock", "w") as lock:  # one creates it, the others wait and reuse it
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (venv / _READY).exists():
            started = time.monotonic()
            log.info("creating the environment venv %s for %s", venv, list(requirements))
            uv = find_uv_bin()
            subprocess.run([uv, "venv", "--quiet", "--clear", "--python", sys.executable, str(venv)], check=True,
                           timeout=300, capture_output=True)
            # The system's certificates, as pip's own (truststore) uses: a proxy's or a company's CA is trusted.
            done = subprocess.run([uv, "pip", "install", "--quiet", "--system-certs", "--python", str(python),
                                   *requirements], capture_output=True, text=True, timeout=_INSTALL_TIMEOUT_S)
            if done.returncode != 0:
                raise ValueError(f"{field}: uv could not install {list(requirements)}: {done.stderr[-1500:]}")
            (venv / _READY).write_text("\n".join(requirements) + "\n")
            log.info("environment venv %s ready in %.0f s", venv, time.monotonic() - started)
    return str(python)
