"""Kept so `rollout_buffer.demo.bundled_dataset` (README's curl tour) keeps working; the demo lives in `tools.demo`."""

from rollout_buffer.tools.demo import bundled_dataset, run_demo

__all__ = ["bundled_dataset", "run_demo"]
