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

from rollout_buffer.delivery.streams import DEFAULT_STREAM, RunStreams
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
        """From a stream's counts of its groups by state."""
        return cls(
            ready=counts.get("ready", 0),
            consumed=sum(counts.get(s, 0) for s in CONSUMED_STATES),
            dropped=counts.get("filtered", 0),
        )


@dataclass
class StreamLedger:
    """One stream of a run: its groups by fate on that stream, how many ready groups it holds at all, and its
    trainer's version. A role's stream (plan/act's planner or actor, by `extra_info.agent_id`) is `active`
    once a consumer used it (fetched by role or reported the role's version)."""

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
    """One run's streams (the default one, named "", and its roles'), groups its group policy dropped, and the
    newest engine version seen, with a change signal."""

    run_id: str
    streams: dict[str, StreamLedger] = field(default_factory=lambda: {DEFAULT_STREAM: StreamLedger()})
    dropped_at_completion: int = 0
    engine_version: int | None = None  # the newest weight version seen in the run's records
    ready_total: int = 0  # groups that completed ready (whatever became of them later)
    changes: int = 0  # changes notified so far: what a decision taken on the ledger can say it saw
    _changed: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    @classmethod
    def of_stored(cls, run_id: str, stored: RunStreams) -> RunLedger:
        """A run's ledger as the store has it."""
        ledger = cls(run_id, dropped_at_completion=stored.dropped_at_completion, ready_total=stored.ready_total)
        for name, state in stored.streams.items():
            ledger.streams[name] = StreamLedger(GroupTally.from_states(state.counts), state.groups, state.version,
                                                state.active)
        return ledger

    def changed(self) -> asyncio.Event:
        """An event set at the next change; take it before reading what you wait on."""
        return self._changed

    def notify(self) -> None:
        """Wake whoever waits for a change."""
        self.changes += 1
        event, self._changed = self._changed, asyncio.Event()
        event.set()

    def stream(self, name: str = DEFAULT_STREAM) -> StreamLedger:
        """The ledger of one stream (a role's is made at its first group or first use)."""
        return self.streams.setdefault(name, StreamLedger())

    @property
    def version(self) -> TrainerVersion:
        """The default stream's trainer version."""
        return self.streams[DEFAULT_STREAM].version

    @property
    def tally(self) -> GroupTally:
        """The run's groups by fate as the default stream sees them, drops by the group policy included."""
        t = self.streams[DEFAULT_STREAM].tally
        return GroupTally(t.ready, t.consumed, t.dropped + self.dropped_at_completion)

    @property
    def roles(self) -> dict[str, StreamLedger]:
        """The role streams."""
        return {name: s for name, s in self.streams.items() if name != DEFAULT_STREAM}

    # ---- events ----------------------------------------------------------------------------------
    def completed(self, dropped: bool, roles: Sequence[str] = ()) -> None:
        """A group of the run completed: ready (with records of `roles`), or dropped by the group policy."""
        if dropped:
            self.dropped_at_completion += 1
        else:
            self.ready_total += 1
            for name in (DEFAULT_STREAM, *roles):
                s = self.stream(name)
                s.groups += 1
                s.tally.ready += 1
        self.notify()

    def taken(self, groups: int, expired: int, stale: int, stream: str = DEFAULT_STREAM) -> None:
        """A delivery on a stream: `groups` ready groups handed out, `expired` leases made ready again before,
        `stale` ready groups dropped for lagging the stream's trainer."""
        s = self.stream(stream)
        if stream != DEFAULT_STREAM:
            s.active = True
        if not (groups or expired or stale):
            return
        s.tally.ready += expired - groups - stale
        s.tally.consumed += groups - expired
        s.tally.dropped += stale
        self.notify()

    def reported(self, version: TrainerVersion, stream: str = DEFAULT_STREAM) -> None:
        """A stream's trainer version changed."""
        s = self.stream(stream)
        if stream != DEFAULT_STREAM:
            s.active = True
        if version != s.version:
            s.version = version
            self.notify()

    def engine_seen(self, version: int | None) -> None:
        """A record of the run was generated with `version`."""
        if version is not None and (self.engine_version is None or version > self.engine_version):
            self.engine_version = version

    # ---- what admission counts --------------------------------------------------------------------
    def active_roles(self) -> dict[str, StreamLedger]:
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

    @property
    def trainer_lead(self) -> int | None:
        """How many versions the trainer is ahead of the newest engine version seen (negative: behind)."""
        if self.version.current is None or self.engine_version is None:
            return None
        return self.version.current - self.engine_version

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view for `/status`."""
        t = self.tally
        roles = self.roles
        return {
            "trainer_version": self.version.current,
            "base_version": self.version.base,
            "trainer_steps": self.version.steps,
            "engine_version": self.engine_version,
            "trainer_lead": self.trainer_lead,
            "ready_groups": t.ready,
            "consumed_groups": t.consumed,
            "dropped_groups": t.dropped,
            **({"roles": {name: r.snapshot() for name, r in sorted(roles.items())}} if roles else {}),
        }
