"""Records and generators as delivery sees them in tests: a generator that is only its hooks, a long token-mode
record."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class Hooks:
    """A generator as delivery sees it: only its hooks."""

    def __init__(self, **hooks: Callable[..., Any]):
        self.hooks = hooks

    def hook(self, name: str) -> Callable[..., Any] | None:
        return self.hooks.get(name)


def long_record(i: int, reward: float) -> dict[str, Any]:
    """A token-mode record of 8 000 tokens (long enough to carry facts), its last message the answer."""
    n = 8000
    return {"uid": f"u{i}", "instance_id": "task", "reward": reward, "extra_info": {"epoch": 0, "repeat": i},
            "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"a{i}"}],
            "tokens": [(7 * k + i) % 151000 for k in range(n)], "loss_mask": [0] * 1000 + [1] * 7000,
            "rollout_log_probs": [-0.25 * (k % 5) for k in range(7000)], "response_length": 7000}
