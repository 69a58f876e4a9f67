"""A run's live counts (`Progress`): what `/status`, `/metrics`, the dashboard and the log show of it."""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Progress:
    """Live counts of one run, shown in /status and the log."""

    run_id: str
    total: int
    started_at: float = field(default_factory=time.time)
    done: int = 0
    failed: int = 0
    in_flight: int = 0
    skipped: int = 0
    requeued: int = 0  # trajectories sent back to the queue after their aborts
    regenerated: int = 0  # stale groups generated again
    statuses: Counter[str] = field(default_factory=Counter)
    failures: Counter[str] = field(default_factory=Counter)
    state: str = "running"
    error: str | None = None  # why the run failed
    ended_at: float | None = None  # freezes the rate once the run ends
    # Sum and count of each numeric `extra_info.metrics` value the run's records carry (an environment's reward
    # functions and metrics): their means are shown.
    metric_sums: dict[str, list[float]] = field(default_factory=dict)
    # Raw rewards of the trajectories that did not fail, summed: the dashboard charts their mean per interval.
    reward_sum: float = 0.0
    rewarded: int = 0

    def note_metrics(self, metrics: Any) -> None:
        """Add a record's `extra_info.metrics` (name → number) to the run's means."""
        if not isinstance(metrics, dict):
            return
        for name, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
                acc = self.metric_sums.setdefault(str(name), [0.0, 0])
                acc[0] += value
                acc[1] += 1

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view, with the rate in trajectories per second."""
        end = self.ended_at if self.ended_at is not None else time.time()
        elapsed = max(end - self.started_at, 1e-9)
        return {
            "run_id": self.run_id,
            "state": self.state,
            "error": self.error,
            "total": self.total,
            "done": self.done,
            "failed": self.failed,
            "in_flight": self.in_flight,
            "skipped": self.skipped,
            "requeued": self.requeued,
            "regenerated": self.regenerated,
            "rate": self.done / elapsed,
            "elapsed_s": elapsed,
            "statuses": dict(self.statuses),
            "failures": dict(self.failures),
            "metrics": {name: {"mean": total / n, "n": int(n)}
                        for name, (total, n) in sorted(self.metric_sums.items())},
            "reward_sum": self.reward_sum,
            "rewarded": self.rewarded,
        }
