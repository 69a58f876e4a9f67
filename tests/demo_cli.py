"""Run `rollout-buffer demo` as a subprocess and read the summary table it prints."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any


def run_demo(*args: str, cwd: Path | None = None, with_output: bool = False) -> Any:
    """`rollout-buffer demo <args>` run to the end (asserted successful); its table as {label: value} (with
    `with_output`, and all it printed)."""
    out = subprocess.run(
        [sys.executable, "-m", "rollout_buffer", "demo", *args],
        capture_output=True, text=True, timeout=240, cwd=cwd,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = table_of(out.stdout)
    return (rows, out.stdout + out.stderr) if with_output else rows


def table_of(stdout: str) -> dict[str, str]:
    """The demo's summary table in its output, as {label: value}."""
    rows = {}
    for line in stdout.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    return rows
