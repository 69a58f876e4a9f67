"""What a starting server finishes of the process before it: groups left complete, the run that was running, open
agent sessions, running evals — and what it does when its store refuses the writes that takes (a full disk,
`--max-db-mb`): it serves anyway, degraded.

Degraded, the server answers reads, leases, acks and exports from what is stored; writes answer 503 naming the
cause; `/status` says so (`store.degraded`). It tries again every `RETRY_S`, from the step that was refused, and
once the store takes the writes the interrupted work goes on without a restart. Each step runs once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Sequence

from rollout_buffer.delivery.store import StoreError

log = logging.getLogger(__name__)

RETRY_S = 5.0


class CatchUp:
    """The start-up steps that write to the store, run in order; degraded while the store refuses one."""

    def __init__(self, steps: Sequence[tuple[str, Callable[[], Awaitable[object]]]], retry_s: float = RETRY_S):
        self._steps = list(steps)
        self._done = 0
        self.retry_s = retry_s
        self.degraded: str | None = None  # why the server serves reads only, while it does
        self._retrying: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Run the steps; when the store refuses one, serve degraded and go on trying in the background."""
        if not await self._attempt():
            self._retrying = asyncio.create_task(self._retry(), name="catch-up")

    async def _attempt(self) -> bool:
        while self._done < len(self._steps):
            name, step = self._steps[self._done]
            try:
                await step()
            except StoreError as e:
                if self.degraded is None:
                    log.error("the store refuses writes (%s) while %s: serving reads, leases, acks and exports only; "
                              "writes answer 503 until it has room again, then this resumes by itself", e, name)
                self.degraded = f"{e} (while {name}; trying again every {self.retry_s:g} s)"
                return False
            self._done += 1
        if self.degraded is not None:
            log.warning("the store takes writes again: interrupted work resumed, the server is no longer degraded")
        self.degraded = None
        return True

    async def _retry(self) -> None:
        while True:
            await asyncio.sleep(self.retry_s)
            if await self._attempt():
                return

    async def stop(self) -> None:
        """Stop trying (the server is stopping)."""
        if self._retrying is not None:
            self._retrying.cancel()
            await asyncio.gather(self._retrying, return_exceptions=True)
