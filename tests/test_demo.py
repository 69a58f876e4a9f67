"""`rollout-buffer demo`, the README's main job: runs end to end with no GPU and prints its table."""

from __future__ import annotations

import subprocess
import sys


def test_demo_runs_the_whole_pipeline() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "rollout_buffer.cli", "demo", "--num-repeat", "2", "--batch-groups", "16",
         "--latency-ms", "1"],
        capture_output=True, text=True, timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip("│┃ ").split("│")]
        if len(cells) == 2:
            rows[cells[0]] = cells[1]
    assert rows["groups"] == "64" and rows["samples"] == "128"
    assert rows["failed trajectories"] == "0"
    assert 0.0 < float(rows["mean reward (raw)"]) < 1.0
    assert int(rows["response tokens"]) > 0 and float(rows["samples/s"]) > 0
