"""Trajectories in flight under a budget of slots: the one scheduler of training runs and evaluations.

`Slots` is the budget (a run's `num_process`, or the `eval_num_process` every eval shares; resizable). `InFlight`
starts each trajectory as a task once it holds a slot, so work is created lazily and a huge input file never
sits in memory as tasks; the slot comes back when the task ends (a task cancelled before it ran included), or
earlier when the task hands it on itself (a finished trajectory, before its store write); waiting on the tasks
raises what the first failed one raised.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Callable, Coroutine
from typing import Any


class Slots:
    """At most `limit` trajectories in flight. Resizable: trajectories above a new limit finish, none starts until
    below it."""

    def __init__(self, limit: int):
        self.limit = limit
        self.in_flight = 0
        self._freed = asyncio.Event()

    async def acquire(self) -> None:
        """Wait for a free slot and take it."""
        while self.in_flight >= self.limit:
            await self._freed.wait()
        self.in_flight += 1

    def release(self) -> None:
        """Give a slot back."""
        self.in_flight -= 1
        self._wake()

    def resize(self, limit: int) -> None:
        """A new limit."""
        self.limit = limit
        self._wake()

    def _wake(self) -> None:
        # Every waiter re-checks; the ones still over the limit wait on the new event.
        event, self._freed = self._freed, asyncio.Event()
        event.set()


class Slot:
    """One trajectory's hold on a slot of its budget."""

    def __init__(self, slots: Slots):
        self._slots = slots
        self.held = True

    def release(self) -> None:
        """Hand the slot on (once; later calls do nothing)."""
        if self.held:
            self.held = False
            self._slots.release()

    async def acquire(self) -> None:
        """Take a slot again (a trajectory that goes back to the queue)."""
        if not self.held:
            await self._slots.acquire()
            self.held = True


class InFlight:
    """The trajectory tasks one run (or one eval) has in flight, under `slots`."""

    def __init__(self, slots: Slots):
        self.slots = slots
        self._tasks: set[asyncio.Task[None]] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    async def start(self, work: Callable[[Slot], Coroutine[Any, Any, None]]) -> None:
        """Wait for a slot, then run `work(slot)` as a task; the slot comes back when it ends at the latest."""
        await self.slots.acquire()
        slot = Slot(self.slots)
        task = asyncio.create_task(work(slot))
        self._tasks.add(task)
        task.add_done_callback(functools.partial(self._ended, slot))

    def _ended(self, slot: Slot, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        slot.release()

    async def wait_next(self, woken: asyncio.Event | None = None) -> None:
        """Until a task ends (or `woken` is set); raises what a task that ended raised."""
        waiter = asyncio.ensure_future(woken.wait()) if woken is not None else None
        try:
            done, _ = await asyncio.wait({*self._tasks, *([waiter] if waiter else [])},
                                         return_when=asyncio.FIRST_COMPLETED)
        finally:
            if waiter is not None:
                waiter.cancel()
        for t in done:
            if t is not waiter and not t.cancelled() and t.exception() is not None:
                raise t.exception()  # type: ignore[misc]

    async def wait_all(self) -> None:
        """Until every task ended; raises what the first failed one raised."""
        while self._tasks:
            await self.wait_next()

    def cancel(self) -> None:
        """Cancel every task in flight."""
        for t in self._tasks:
            t.cancel()
