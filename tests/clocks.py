"""A clock the test moves (`rollout_buffer.clock.Clock`): timers on it fire when the test advances it past their
time, and the test can wait until a timer is set again (the timer's owner has done its pass) instead of sleeping."""

from __future__ import annotations

import asyncio

from rollout_buffer.clock import Clock


class ManualClock(Clock):
    """Time stands still until `advance`."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now
        self.waits = 0  # how many times a timer was set on it
        self._timers: list[tuple[float, asyncio.Future[None]]] = []
        self._set = asyncio.Event()

    def monotonic(self) -> float:
        return self.now

    async def wait(self, event: asyncio.Event, timeout_s: float) -> None:
        timer: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._timers.append((self.now + timeout_s, timer))
        self.waits += 1
        self._set.set()
        woken = asyncio.ensure_future(event.wait())
        try:
            await asyncio.wait({timer, woken}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            woken.cancel()
            self._timers = [(due, t) for due, t in self._timers if t is not timer]

    def advance(self, seconds: float) -> None:
        """Move the time on; the timers now due fire."""
        self.now += seconds
        for due, timer in self._timers:
            if due <= self.now and not timer.done():
                timer.set_result(None)

    async def waited(self, more_than: int) -> None:
        """Until a timer has been set more than `more_than` times in all (bounded: a test must not hang)."""
        async with asyncio.timeout(10):
            while self.waits <= more_than:
                self._set.clear()
                await self._set.wait()
