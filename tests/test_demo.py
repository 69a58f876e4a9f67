"""`rollout-buffer demo`, the README's main job: runs end to end with no GPU and prints its table."""

from __future__ import annotations

import argparse
import importlib.util

import pytest
from demo_cli import run_demo

from rollout_buffer.tools import demo


def test_demo_runs_the_whole_pipeline() -> None:
    rows, out = run_demo("--num-repeat", "2", "--batch-groups", "16", "--latency-ms", "1", with_output=True)
    assert rows["groups planned"] == rows["groups delivered"] == "64" and rows["samples"] == "128"
    assert rows["failed trajectories"] == "0" and not any(k.startswith("groups dropped") for k in rows)
    assert 0.0 < float(rows["mean reward (raw)"]) < 1.0
    assert int(rows["response tokens"]) > 0 and float(rows["samples/s"]) > 0
    # Where to look, and what to do next.
    assert "dashboard http://127.0.0.1:" in out and "/ui" in out
    assert "next:" in out and "rollout-buffer serve --data-dir" in out and "scripts/run-qwen3-4b.sh" in out


def test_agent_demo_trains_the_bundled_openai_agent() -> None:
    rows = run_demo("--task", "agent", "--num-repeat", "2", "--batch-groups", "24", "--latency-ms", "1")
    assert rows["groups delivered"] == "24" and rows["samples"] == "48" and rows["failed trajectories"] == "0"
    assert 0.0 < float(rows["mean reward (raw)"]) <= 1.0 and int(rows["response tokens"]) > 0


def test_the_agent_demo_without_its_extra_says_which_to_add_before_it_starts(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "openai" else real(name, *a))
    with pytest.raises(SystemExit) as done:
        demo.main(argparse.Namespace(task="agent", agent=None))
    line = capsys.readouterr().err
    assert done.value.code == 2 and line.count("\n") == 1
    assert "pip install 'rollout-buffer[agents]'" in line and "pip install -e '.[agents]'" in line
    assert demo.missing_extra("agent", own_agent=True) is None, "an agent of one's own brings its own client"
    assert demo.missing_extra("math", own_agent=False) is None
