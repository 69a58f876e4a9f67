"""The faults a simulated engine injects: drawn per request at their rates from a seeded RNG, or queued exactly for
the next requests (`POST /sim/faults`)."""

from __future__ import annotations

import asyncio
import logging
import random
from collections import Counter, deque

from starlette.responses import Response

from rollout_sim.contract import FAULT_KINDS, SimConfig
from rollout_sim.replies import ResetConnection, error_response

logger = logging.getLogger(__name__)


class Faults:
    """One engine's fault draws and queue; `counts` is what `/sim/stats` shows."""

    def __init__(self, config: SimConfig, counts: Counter[str]):
        self.config = config
        self.counts = counts
        self._rng = random.Random(f"{config.seed}:faults")
        self._queued: deque[str] = deque()

    def queued(self) -> list[str]:
        """Faults waiting for the next requests."""
        return list(self._queued)

    def queue(self, kinds: list[str]) -> None:
        """Make the next requests fail in the given ways, in order."""
        bad = [k for k in kinds if k not in (*FAULT_KINDS, "none")]
        if bad:
            raise ValueError(f"unknown fault kind(s) {bad}; known: {', '.join(FAULT_KINDS)}, none")
        self._queued.extend(kinds)

    def next(self) -> str | None:
        """The fault of the request arriving now, or None."""
        # Both numbers are drawn on every request so the sequence depends on the seed only.
        error_roll, abort_roll = self._rng.random(), self._rng.random()
        kind_index = self._rng.randrange(len(self.config.error_kinds) or 1)
        if self._queued:
            queued = self._queued.popleft()
            return None if queued == "none" else queued
        if error_roll < self.config.error_rate and self.config.error_kinds:
            return self.config.error_kinds[kind_index]
        if abort_roll < self.config.abort_rate:
            return "abort"
        return None

    async def response(self, fault: str | None) -> Response | None:
        """The response of a fault that replaces the engine's answer, after a hang if that is the fault."""
        if fault is not None:
            self.counts[fault] += 1
            logger.debug("simulated fault: %s", fault)
        if fault == "http_500":
            return error_response(500, "simulated internal server error")
        if fault == "reset":
            return ResetConnection()
        if fault == "hang":
            await asyncio.sleep(self.config.hang_s)
        return None
