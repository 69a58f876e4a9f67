"""`rollout-buffer demo`, the README's main job: runs end to end with no GPU and prints its table."""

from __future__ import annotations

from demo_cli import run_demo


def test_demo_runs_the_whole_pipeline() -> None:
    rows = run_demo("--num-repeat", "2", "--batch-groups", "16", "--latency-ms", "1")
    assert rows["groups"] == "64" and rows["samples"] == "128"
    assert rows["failed trajectories"] == "0"
    assert 0.0 < float(rows["mean reward (raw)"]) < 1.0
    assert int(rows["response tokens"]) > 0 and float(rows["samples/s"]) > 0


def test_agent_demo_trains_the_bundled_openai_agent() -> None:
    rows = run_demo("--task", "agent", "--num-repeat", "2", "--batch-groups", "24", "--latency-ms", "1")
    assert rows["groups"] == "24" and rows["samples"] == "48" and rows["failed trajectories"] == "0"
    assert 0.0 < float(rows["mean reward (raw)"]) <= 1.0 and int(rows["response tokens"]) > 0
