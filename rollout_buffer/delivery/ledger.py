"""Per-run ledger: what happened to a run's groups (ready, consumed, dropped) and where its trainer and
engines stand, kept in step with the store by the buffer.

Admission control reads it (`generation.admission`): it is loaded once from the store and then moved by
the same events that move the store (a group completes or is dropped, a delivery takes groups, a lease runs
out, the trainer reports a version), so reading it costs nothing and a restarted buffer rebuilds it exactly.
Whoever waits for one of those events takes `changed()` before reading and waits on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
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
class RoleLedger:
    """One role stream of a run (plan/act's planner or actor, by `extra_info.agent_id`): its groups by fate
    for that stream, how many ready groups have records of the role at all, and its trainer's version.
    `active` once a consumer used the stream (fetched by role or reported the role's version)."""

    tally: GroupTally = field(default_factory=GroupTally)
    groups: int = 0
    version: TrainerVersion = field(default_factory=TrainerVersion)
    active: bool = False

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view for `/status`."""
        return {"trainer_version": self.version.current, "base_version": self.version.base,
                "trainer_steps": self.version.steps, "ready_groups": self.tally.ready,
                "consumed_groups": self.tally.consumed, "dropped_groups": self.tally.dropped}


@dataclass
class RunLedger:
    """One run's tally, trainer version and newest engine version, with a change signal; and its role streams."""

    run_id: str
    tally: GroupTally = field(default_factory=GroupTally)
    version: TrainerVersion = field(default_factory=TrainerVersion)
    engine_version: int | None = None  # the newest weight version seen in the run's records
    roles: dict[str, RoleLedger] = field(default_factory=dict)
    ready_total: int = 0  # groups that completed ready (whatever became of them later)
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def changed(self) -> asyncio.Event:
        """An event set at the next change; take it before reading what you wait on."""
        return self._changed

    def notify(self) -> None:
        """Wake whoever waits for a change."""
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    # ---- events ----------------------------------------------------------------------------------
    def completed(self, dropped: bool, roles: Sequence[str] = ()) -> None:
        """A group of the run completed: ready (with records of `roles`), or dropped by the group policy."""
        if dropped:
            self.tally.dropped += 1
        else:
            self.tally.ready += 1
            self.ready_total += 1
            for role in roles:
                r = self.role(role)
                r.groups += 1
                r.tally.ready += 1
        self.notify()

    def role(self, name: str) -> RoleLedger:
        """The ledger of one role stream (made at its first group or first use)."""
        return self.roles.setdefault(name, RoleLedger())

    def role_taken(self, name: str, groups: int, expired: int, stale: int) -> None:
        """A delivery on a role stream (as `taken`, for that role only)."""
        r = self.role(name)
        r.active = True
        if not (groups or expired or stale):
            return
        r.tally.ready += expired - groups - stale
        r.tally.consumed += groups - expired
        r.tally.dropped += stale
        self.notify()

    def role_reported(self, name: str, version: TrainerVersion) -> None:
        """A role's trainer version changed."""
        r = self.role(name)
        r.active = True
        if version != r.version:
            r.version = version
            self.notify()

    # ---- what admission counts --------------------------------------------------------------------
    def active_roles(self) -> dict[str, RoleLedger]:
        """The role streams consumers use; when there are any, they (not the default stream) pace the run."""
        return {name: r for name, r in self.roles.items() if r.active}

    def trainers(self) -> list[tuple[int, TrainerVersion]]:
        """(groups consumed, version) of each trainer: the default stream's, or each active role's. A group
        without records of a role counts as consumed by that role: it has nothing to wait for."""
        active = self.active_roles()
        if not active:
            return [(self.tally.consumed, self.version)]
        return [(r.tally.consumed + self.ready_total - r.groups, r.version) for r in active.values()]

    def consumed_groups(self) -> int:
        """Groups every trainer has taken (or had nothing to take of)."""
        return min(consumed for consumed, _ in self.trainers())

    def dropped_groups(self) -> int:
        """Groups dropped: by the group policy or as stale on the default stream, plus those every active role
        dropped as stale (fewest over the roles)."""
        active = self.active_roles()
        return self.tally.dropped + (min(r.tally.dropped for r in active.values()) if active else 0)

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
            **({"roles": {name: r.snapshot() for name, r in sorted(self.roles.items())}} if self.roles else {}),
        }
