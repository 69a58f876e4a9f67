"""The math task with a CPU-heavy reward: the math generator's trajectory, then `reward_cpu_ms` of pure Python.

Loaded by `bench.ray_executor` with `--generator-path`; stands for rewards, tools and sandboxes that spend CPU
on the event loop of whichever process runs the trajectory (the buffer's, or a Ray actor's).
"""

from __future__ import annotations

import time
from typing import Any

from generators import math
from rollout_buffer.generator_api import RolloutContext, Trajectory

TASK_TYPE = "math_heavy_reward"
REQUIRED_FIELDS = math.REQUIRED_FIELDS


def burn(cpu_ms: float) -> int:
    """Spend `cpu_ms` of this thread's CPU time in plain Python arithmetic."""
    end = time.thread_time() + cpu_ms / 1000
    n = 0
    while time.thread_time() < end:
        for i in range(1000):
            n = (n * 31 + i) % 1_000_003
    return n


async def run_rollout(item: dict[str, Any], ctx: RolloutContext) -> Trajectory:
    """The math trajectory, scored after `reward_cpu_ms` (run option, default 20) of pure-Python work."""
    record = await math.run_rollout(item, ctx)
    burn(float(ctx.config.get("reward_cpu_ms", 20.0)))
    return record
