"""Idle harness sessions expire: a session without a request for longer than its run's `session_ttl_s` (and no
turn generating) is closed as failed by its backend (`LocalBackend.expire`), so its group is dropped rather
than waiting forever. One loop sleeps until the next session is due, woken early when one opens that is due
sooner."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from rollout_buffer.clock import SYSTEM, Clock
from rollout_buffer.proxy.session import Session, SessionKind

log = logging.getLogger(__name__)

_MAX_SLEEP_S = 30.0


class Reaper:
    """The expiry loop over a backend's open sessions (`sessions`), closing each with `expire(session, why)`; idle
    time is read on `clock`, the sessions' own."""

    def __init__(self, sessions: dict[str, Session], expire: Callable[[Session, str], Awaitable[None]],
                 clock: Clock = SYSTEM):
        self._sessions = sessions
        self._expire = expire
        self._clock = clock
        self._wake = asyncio.Event()
        self._look_at = 0.0  # when the loop looks again, unless woken earlier
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the loop (from the running event loop)."""
        self._task = asyncio.create_task(self._loop(), name="session-reaper")

    async def stop(self) -> None:
        """Stop the loop."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def opened(self, session: Session) -> None:
        """A harness session opened: look again now when it is due before the loop would."""
        if session.last_active + session.options.session_ttl_s < self._look_at:
            self._wake.set()  # sessions usually open in expiry order: this is rare

    def wake(self) -> None:
        """Look at the sessions now (many came back at once after a restart)."""
        self._wake.set()

    async def _loop(self) -> None:
        while True:
            now = self._clock.monotonic()
            due = [s for s in self._sessions.values()
                   if s.kind is SessionKind.HARNESS and s.state == "open" and not s.generating
                   and now - s.last_active >= s.options.session_ttl_s]
            for session in due:
                try:
                    await self._expire(session, f"no finish within session_ttl_s={session.options.session_ttl_s:g} "
                                       "of its last request")
                except Exception:
                    log.exception("expiring session %s failed", session.session_id)
            now = self._clock.monotonic()
            waits = [s.last_active + s.options.session_ttl_s - now
                     for s in self._sessions.values() if s.kind is SessionKind.HARNESS and s.state == "open"]
            self._wake.clear()
            timeout = max(min([_MAX_SLEEP_S, *waits]), 0.05)
            self._look_at = now + timeout
            await self._clock.wait(self._wake, timeout)
