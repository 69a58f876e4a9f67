"""The time the service's timers read (idle sessions' expiry): the machine's monotonic clock, or one a test moves
(`tests/clocks.py`), so that a test advances the time instead of waiting it out."""

from __future__ import annotations

import asyncio
import contextlib
import time


class Clock:
    """The machine's monotonic clock."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""
        return time.monotonic()

    async def wait(self, event: asyncio.Event, timeout_s: float) -> None:
        """Until `event` is set or `timeout_s` seconds of this clock have passed."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)


SYSTEM = Clock()
