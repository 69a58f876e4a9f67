"""The one scheduler of runs and evals: trajectories start only with a slot, hand it back when they end (or
earlier, or when cancelled before they ran), a resized budget holds new starts, and waiting raises what a
trajectory raised."""

from __future__ import annotations

import asyncio

import pytest

from rollout_buffer.generation.scheduler import InFlight, Slot, Slots


def test_at_most_limit_trajectories_run_and_a_freed_slot_starts_the_next() -> None:
    async def main() -> None:
        slots = Slots(2)
        tasks = InFlight(slots)
        started: list[int] = []
        go = {i: asyncio.Event() for i in range(3)}
        waiting = {i: asyncio.Event() for i in range(3)}

        async def work(i: int, slot: Slot) -> None:
            started.append(i)
            waiting[i].set()
            await go[i].wait()

        await tasks.start(lambda slot: work(0, slot))
        await tasks.start(lambda slot: work(1, slot))
        third = asyncio.create_task(tasks.start(lambda slot: work(2, slot)))
        await waiting[0].wait(), await waiting[1].wait()  # the third start has had its turn meanwhile
        assert started == [0, 1] and slots.in_flight == 2 and not third.done()
        go[0].set()
        await third  # the slot trajectory 0 gave back started trajectory 2
        go[1].set(), go[2].set()
        await tasks.wait_all()
        assert sorted(started) == [0, 1, 2] and slots.in_flight == 0 and len(tasks) == 0

    asyncio.run(main())


def test_a_slot_handed_on_early_is_not_given_back_twice_and_can_be_taken_again() -> None:
    async def main() -> None:
        slots = Slots(1)
        tasks = InFlight(slots)
        handed_on, again = asyncio.Event(), asyncio.Event()

        async def work(slot: Slot) -> None:
            slot.release()  # a finished trajectory, before its store write
            handed_on.set()
            await again.wait()
            await slot.acquire()  # queued again

        await tasks.start(work)
        await handed_on.wait()
        assert slots.in_flight == 0
        again.set()
        await tasks.wait_all()
        assert slots.in_flight == 0

    asyncio.run(main())


def test_a_trajectory_cancelled_before_it_ran_gives_its_slot_back() -> None:
    async def main() -> None:
        slots = Slots(1)
        tasks = InFlight(slots)
        ran: list[bool] = []

        async def work(slot: Slot) -> None:
            ran.append(True)

        await tasks.start(work)
        tasks.cancel()  # before the task had a turn
        await tasks.wait_all()  # a cancelled trajectory is no failure
        assert ran == [] and slots.in_flight == 0 and len(tasks) == 0

    asyncio.run(main())


def test_a_smaller_budget_holds_new_starts_until_below_it() -> None:
    async def main() -> None:
        slots = Slots(2)
        tasks = InFlight(slots)
        go, running = asyncio.Event(), asyncio.Semaphore(0)

        async def work(slot: Slot) -> None:
            running.release()
            await go.wait()

        await tasks.start(work)
        await tasks.start(work)
        slots.resize(1)
        held = asyncio.create_task(tasks.start(work))
        await running.acquire(), await running.acquire()  # the held start has had its turn meanwhile
        assert not held.done() and slots.in_flight == 2
        slots.resize(3)
        await held
        go.set()
        await tasks.wait_all()

    asyncio.run(main())


def test_waiting_raises_what_a_trajectory_raised() -> None:
    async def main() -> None:
        tasks = InFlight(Slots(4))

        async def broken(slot: Slot) -> None:
            raise RuntimeError("the generator broke")

        await tasks.start(broken)
        with pytest.raises(RuntimeError, match="the generator broke"):
            await tasks.wait_all()

    asyncio.run(main())
