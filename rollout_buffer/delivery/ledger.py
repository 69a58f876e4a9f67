"""Per-run ledger: what happened to a run's groups (ready, consumed, dropped) and where its trainer and
engines stand, kept in step with the store by the buffer.

Admission control reads it (`generation.admission`): it is loaded once from the store and then moved by
the same events that move the store (a group completes or is dropped, a delivery takes groups, a lease runs
out, the trainer reports a version), so reading it costs nothing and a restarted buffer rebuilds it exactly.
Whoever waits for one of those events takes `changed()` before reading and waits on it.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.delivery.versions import TrainerVersion

# Group states that mean "handed to the trainer" (a lease that runs out makes the group ready again).
CONSUMED_STATES = ("leased", "delivered")


@dataclass
class GroupTally:
    """A run's groups (every part counts) by fate: complete and waiting, handed to the trainer, dropped."""

    ready: int = 0
    consumed: int = 0
    dropped: int = 0

    @classmethod
    def from_states(cls, counts: dict[str, int]) -> GroupTally:
        """From the store's counts of the run's groups by state."""
        return cls(
            ready=counts.get("ready", 0),
            consumed=sum(counts.get(s, 0) for s in CONSUMED_STATES),
            dropped=counts.get("filtered", 0),
        )


@dataclass
class RunLedger:
    """One run's tally, trainer version and newest engine version, with a change signal."""

    run_id: str
    tally: GroupTally = field(default_factory=GroupTally)
    version: TrainerVersion = field(default_factory=TrainerVersion)
    engine_version: int | None = None  # the newest weight version seen in the run's records
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def changed(self) -> asyncio.Event:
        """An event set at the next change; take it before reading what you wait on."""
        return self._changed

    def notify(self) -> None:
        """Wake whoever waits for a change."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # ---- events ----------------------------------------------------------------------------------
    def completed(self, dropped: bool) -> None:
        """A group of the run completed: ready, or dropped by the group policy."""
        if dropped:
            self.tally.dropped += 1
        else:
            self.tally.ready += 1
        self.notify()

    def taken(self, groups: int, expired: int, stale: int) -> None:
        """A delivery: `groups` ready groups handed out, `expired` leases made ready again before, `stale`
        ready groups dropped for lagging the trainer."""
        if not (groups or expired or stale):
            return
        t = self.tally
        t.ready += expired - groups - stale
        t.consumed += groups - expired
        t.dropped += stale
        self.notify()

    def trainer_reported(self, version: TrainerVersion) -> None:
        """The trainer's version changed."""
        if version != self.version:
            self.version = version
            self.notify()

    def engine_seen(self, version: int | None) -> None:
        """A record of the run was generated with `version`."""
        if version is not None and (self.engine_version is None or version > self.engine_version):
            self.engine_version = version

    @property
    def trainer_lead(self) -> int | None:
        """How many versions the trainer is ahead of the newest engine version seen (negative: behind)."""
        if self.version.current is None or self.engine_version is None:
            return None
        return self.version.current - self.engine_version

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view for `/status`."""
        t = self.tally
        return {
            "trainer_version": self.version.current,
            "base_version": self.version.base,
            "trainer_steps": self.version.steps,
            "engine_version": self.engine_version,
            "trainer_lead": self.trainer_lead,
            "ready_groups": t.ready,
            "consumed_groups": t.consumed,
            "dropped_groups": t.dropped,
        }
