"""Whether a run can work at all: a run whose trajectories keep failing (a wrong tokenizer, a generator that
raises, an agent that cannot start) fails with the reason instead of ending `finished` after failing every item,
which a trainer polling for groups cannot tell from a run that is still coming.

The rule, per run (run options): of the last `failure_window` trajectories that ended, a share of at least
`max_failure_rate` failed. With the defaults (32, 1.0): 32 failures in a row. Engine outages are not failures
(their trajectories wait for the engine), so they never count here.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import ClassVar

from pydantic import Field

from rollout_buffer.generation.options import RunOptions


class RunHealthOptions(RunOptions):
    """When a run whose trajectories keep failing fails itself."""

    error_prefix: ClassVar[str] = "run health options"

    failure_window: int = Field(default=32, ge=0, description="trajectories looked at (0: never fail a run so)")
    max_failure_rate: float = Field(default=1.0, gt=0.0, le=1.0, description="failed share that fails the run")


class RunCannotWork(Exception):
    """The run's trajectories keep failing; the message says how and the last error."""


class FailureWatch:
    """The last trajectories' outcomes of one run (`RunHealthOptions`)."""

    def __init__(self, options: RunHealthOptions):
        self.window = options.failure_window
        self.max_rate = options.max_failure_rate
        self._recent: deque[str | None] = deque(maxlen=max(self.window, 1))  # the failure kind, None: ok
        self._last_error = ""

    def ended(self, failure_kind: str | None, error: str = "") -> str | None:
        """A trajectory ended (`failure_kind` None: it did not fail); the reason the run cannot work, once the
        rule holds, else None."""
        if failure_kind == "engine_outage":  # the engines were down longer than the run's budget
            return error
        if not self.window:
            return None
        self._recent.append(failure_kind)
        if failure_kind is not None:
            self._last_error = error
        if len(self._recent) < self.window:
            return None
        kinds = Counter(k for k in self._recent if k is not None)
        failed = sum(kinds.values())
        if failed < self.max_rate * self.window:
            return None
        share = "all" if failed == self.window else f"{failed} of them"
        most = ", ".join(f"{kind} ×{n}" for kind, n in kinds.most_common(3))
        return (f"the last {self.window} trajectories {share} failed ({most}); last error: {self._last_error[:500]} "
                "(the run option failure_window / max_failure_rate sets when a run fails so)")
