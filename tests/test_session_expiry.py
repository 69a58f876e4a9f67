"""Idle harness sessions expire after their run's `session_ttl_s`, read on an injected clock that the tests move:
nothing is waited out, and "not yet" is seen once the expiry loop has looked and set its next timer."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from clocks import ManualClock

from rollout_buffer.proxy.expiry import Reaper
from rollout_buffer.proxy.session import SessionKind


def _session(session_id: str, clock: ManualClock, ttl_s: float, generating: bool = False) -> Any:
    return SimpleNamespace(session_id=session_id, kind=SessionKind.HARNESS, state="open", generating=generating,
                           last_active=clock.now, options=SimpleNamespace(session_ttl_s=ttl_s))


def test_an_idle_session_expires_once_its_ttl_has_passed_on_the_clock_and_not_before() -> None:
    async def main() -> list[Any]:
        clock = ManualClock()
        sessions: dict[str, Any] = {}
        expired: list[tuple[str, str, float]] = []

        async def expire(session: Any, why: str) -> None:
            expired.append((session.session_id, why, clock.now))
            session.state = "expired"
            sessions.pop(session.session_id)

        reaper = Reaper(sessions, expire, clock)
        sessions["idle"] = _session("idle", clock, ttl_s=20.0)
        sessions["busy"] = _session("busy", clock, ttl_s=20.0, generating=True)  # a turn is being generated
        reaper.start()
        try:
            await clock.waited(0)
            seen = [list(expired)]
            looked = clock.waits
            clock.advance(19.5)
            reaper.wake()  # its timer is not due yet: made to look now, it finds nothing due
            await clock.waited(looked)
            seen.append(list(expired))
            looked = clock.waits
            clock.advance(0.5)
            await clock.waited(looked)
            seen.append([(sid, at) for sid, _, at in expired])
            sessions["busy"].generating = False  # its turn ended long after its last request: due at once
            looked = clock.waits
            clock.advance(30.0)
            await clock.waited(looked)
            seen.append([sid for sid, _, _ in expired])
            seen.append(expired[0][1])
            return seen
        finally:
            await reaper.stop()

    before, not_yet, at_ttl, later, why = asyncio.run(main())
    assert before == [] and not_yet == []
    assert at_ttl == [("idle", 1020.0)]
    assert later == ["idle", "busy"]
    assert why == "no finish within session_ttl_s=20 of its last request"


def test_a_session_due_sooner_than_the_next_look_wakes_the_loop() -> None:
    async def main() -> list[str]:
        clock = ManualClock()
        sessions: dict[str, Any] = {"long": _session("long", clock, ttl_s=25.0)}
        expired: list[str] = []

        async def expire(session: Any, why: str) -> None:
            expired.append(session.session_id)
            sessions.pop(session.session_id)

        reaper = Reaper(sessions, expire, clock)
        reaper.start()
        try:
            await clock.waited(0)  # its next look is in 25 s
            looked = clock.waits
            sessions["short"] = short = _session("short", clock, ttl_s=5.0)
            reaper.opened(short)  # due in 5 s: the loop looks again now and sets its timer for then
            await clock.waited(looked)
            looked = clock.waits
            clock.advance(5.0)
            await clock.waited(looked)
            return list(expired)
        finally:
            await reaper.stop()

    assert asyncio.run(main()) == ["short"]
