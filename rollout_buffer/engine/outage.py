"""Engine outages: when the engines stop answering, a run waits for them instead of failing its trajectories.

An engine that refuses connections, answers 5xx (sglang-router's "no healthy worker" among them) or stops
answering within the request timeout is down, not wrong: a restarting SGLang takes minutes, and every trajectory
failed meanwhile would be a group lost (or worse, scored as a zero) for nothing the trajectory did. Past the
client's own quick retries such a failure starts (or continues) an outage of the engine client: requests in
flight keep retrying with backoff from where they were, new trajectories are not started (`wait_clear`), and the
first answer from an engine ends it. An outage longer than the run's budget (`engine_outage_s`) fails the run,
with the reason; a budget of 0 keeps the old behaviour (fail each trajectory once its retries are spent).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from rollout_buffer.observability import metrics

log = logging.getLogger(__name__)

# What an engine that is down answers (or does not): the kinds of `AttemptError` an outage is made of.
OUTAGE_KINDS = frozenset({"connection", "http_5xx", "timeout"})
# A run's default budget: well above an SGLang restart.
DEFAULT_OUTAGE_S = 1800.0


class OutageTooLong(Exception):
    """The engines have not answered for longer than the run's budget."""


class Outage:
    """The outage of one engine client: since when no request got an answer, which engines, the last error."""

    def __init__(self, budget_s: float = DEFAULT_OUTAGE_S):
        self.budget_s = budget_s
        self.since: float | None = None  # time.time() of the first failure of the streak
        self._started_mono = 0.0
        self.urls: set[str] = set()
        self.error = ""
        self._clear = asyncio.Event()
        self._clear.set()

    @property
    def active(self) -> bool:
        """Whether the engines are down now."""
        return self.since is not None

    def failed(self, url: str, error: str) -> None:
        """A request to `url` failed as a down engine does; OutageTooLong once the outage outlasts the budget."""
        if self.since is None:
            self.since, self._started_mono = time.time(), time.monotonic()
            self._clear.clear()
            log.warning("engine outage: %s does not answer (%s); trajectories in flight wait for it, no new one "
                        "starts, for up to engine_outage_s=%g", url, error, self.budget_s)
            metrics.ENGINE_OUTAGES.inc()
        self.urls.add(url)
        self.error = error
        if time.monotonic() - self._started_mono > self.budget_s:
            raise OutageTooLong(f"the engines ({', '.join(sorted(self.urls))}) did not answer for "
                                f"{time.monotonic() - self._started_mono:.0f} s, longer than engine_outage_s="
                                f"{self.budget_s:g}; last error: {error}")

    def answered(self) -> None:
        """An engine answered: the outage, if any, is over."""
        if self.since is None:
            return
        log.warning("engine outage over after %.0f s (%s): trajectories go on", time.monotonic() - self._started_mono,
                    ", ".join(sorted(self.urls)))
        self.since, self.urls, self.error = None, set(), ""
        self._clear.set()

    async def wait_clear(self) -> None:
        """Return once no outage is going on (at once when none is)."""
        if self.since is not None:
            await self._clear.wait()

    def snapshot(self) -> dict[str, Any] | None:
        """The outage as `/status` shows it, None when there is none."""
        if self.since is None:
            return None
        return {"since": self.since, "seconds": round(time.monotonic() - self._started_mono, 1),
                "engines": sorted(self.urls), "error": self.error, "budget_s": self.budget_s}
