"""Admission control: whether the runner may start another group, under a staleness bound and a memory cap.

The staleness bound is AReaL's rule for `max_head_offpolicyness` (η), counted in groups. With
`rollout_batch_size` B groups per trainer step (per weight version), a run may have started (and not dropped)
at most

    (η + 1 + k) × B  groups,   k = the trainer's steps since the run began

so whatever is in flight or ready when the trainer takes it is at most η versions behind. k is the larger
of two signals, so either releases generation at once: the versions the trainer reported since the run began
(`current_version` on a fetch, `POST /trainer_version`), and the batches it consumed. A trainer that reports
versions trains the batch in its hands with the version it reported, so its consumption counts one batch less
(consumed ÷ B − 1): with it, a fetch followed by training and a weight update is exactly AReaL's rule, and
η = 0 is synchronous. A trainer that never reports a version (slime's original client) has only its fetches:
consumed ÷ B, as in "at most (η + 1) × B groups started ahead of what the trainer has consumed". Dropped
groups (filtered, stale) give their place back. `max_ready_groups` separately caps the groups ahead of the
trainer (being generated, or complete and waiting for it): memory, whatever the trainer's version.

A group is admitted whole, before its first trajectory starts, so a pause never leaves a group half-started:
its trajectories keep their generation slots and finish. The counts come from the run's ledger
(`delivery.ledger`), which a restarted buffer rebuilds from the store, so a restarted run resumes in the
state it was in. Other executors (a Ray one, per-role streams, evaluation budgets) reuse this class with
their own ledger and policy.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from rollout_buffer.delivery.ledger import RunLedger
from rollout_buffer.delivery.versions import TrainerVersion
from rollout_buffer.observability import metrics

log = logging.getLogger(__name__)


class AdmissionState(StrEnum):
    """Whether new groups may start, and if not, which limit holds them."""

    RUNNING = "running"
    PAUSED_STALENESS = "paused_staleness"
    PAUSED_CAP = "paused_cap"


@dataclass(frozen=True)
class AdmissionPolicy:
    """The limits of one run (start-payload fields of the same names)."""

    max_staleness: int | None = None  # η; None: unbounded
    rollout_batch_size: int = 1  # groups per trainer step
    max_ready_groups: int | None = None

    @classmethod
    def of_config(cls, config: dict[str, Any]) -> AdmissionPolicy:
        """From a run's start payload."""
        return cls(config.get("max_staleness"), int(config.get("rollout_batch_size") or 1),
                   config.get("max_ready_groups"))

    @property
    def limits(self) -> bool:
        """True when anything can hold generation back."""
        return self.max_staleness is not None or self.max_ready_groups is not None


class AdmissionController:
    """Admits whole groups of one run against its policy and ledger; `admit()` waits while paused."""

    def __init__(self, policy: AdmissionPolicy, ledger: RunLedger, started: int,
                 persist: Callable[[str], Awaitable[None]] | None = None):
        """`started`: group parts the run already has in the store (what a resumed run has started)."""
        self.policy = policy
        self.ledger = ledger
        self.started = started
        self.state: AdmissionState | None = None
        # The ledger's change the last decision saw: once it reaches `ledger.changes`, admission has decided on
        # everything that happened so far (what a test or an operator waits on instead of waiting a while).
        self.decided_at_change: int | None = None
        self._persist = persist

    def steps(self) -> int:
        """Trainer steps since the run began: reported versions or consumed batches, whichever is more (the
        batch being trained on does not count when the trainer reports versions; see the module doc). With
        role streams (one trainer per role) the slowest role's."""
        return min(self._steps(consumed, version) for consumed, version in self.ledger.trainers())

    def _steps(self, consumed: int, version: TrainerVersion) -> int:
        batches = consumed // self.policy.rollout_batch_size
        if version.current is None:
            return batches
        return max(version.steps, batches - 1)

    def capacity(self) -> int | None:
        """Groups that may still start under the staleness bound (None: unbounded; may be negative)."""
        eta = self.policy.max_staleness
        if eta is None:
            return None
        return (eta + 1 + self.steps()) * self.policy.rollout_batch_size - self.live_groups()

    def live_groups(self) -> int:
        """Groups started and not dropped."""
        return self.started - self.ledger.dropped_groups()

    def groups_ahead(self) -> int:
        """Groups started, not dropped and not consumed yet: in flight, open or ready."""
        return self.live_groups() - self.ledger.consumed_groups()

    def evaluate(self) -> AdmissionState:
        """The state the counts call for now."""
        capacity = self.capacity()
        if capacity is not None and capacity < 1:
            return AdmissionState.PAUSED_STALENESS
        cap = self.policy.max_ready_groups
        if cap is not None and self.groups_ahead() >= cap:
            return AdmissionState.PAUSED_CAP
        return AdmissionState.RUNNING

    async def admit(self) -> None:
        """Wait until one more group may start, then count it as started."""
        while True:
            changed = self.ledger.changed()  # taken before evaluating, so no change slips in between
            seen = self.ledger.changes
            state = self.evaluate()
            await self._enter(state)
            self.decided_at_change = seen
            if state is AdmissionState.RUNNING:
                self.started += 1
                return
            await changed.wait()

    def give_back(self) -> None:
        """A group admitted but never started returns its place."""
        self.started -= 1
        self.ledger.notify()

    async def _enter(self, state: AdmissionState) -> None:
        if state is self.state:
            return
        previous, self.state = self.state, state
        if state is AdmissionState.RUNNING:
            if previous is not None:
                log.info("run %s: generation resumed (%s)", self.ledger.run_id, self._describe())
        else:
            log.info("run %s: generation paused by %s (%s); it resumes when the trainer fetches or reports a "
                     "newer version", self.ledger.run_id, "the staleness bound" if state is
                     AdmissionState.PAUSED_STALENESS else "max_ready_groups", self._describe())
        metrics.ADMISSION_TRANSITIONS.labels(state.value).inc()
        if self._persist is not None:
            await self._persist(state.value)

    def _describe(self) -> str:
        t, v = self.ledger.tally, self.ledger.version
        roles = self.ledger.active_roles()
        trainer = (", ".join(f"{name} trainer version {r.version.current} (began at {r.version.base}), "
                             f"{r.tally.consumed} consumed" for name, r in sorted(roles.items())) if roles
                   else f"trainer version {v.current} (run began at {v.base})")
        return (f"{self.started} groups started, {self.ledger.dropped_groups()} dropped, "
                f"{self.ledger.consumed_groups()} consumed, {t.ready} ready; {trainer}; capacity {self.capacity()}")

    def snapshot(self) -> dict[str, Any]:
        """JSON-ready view for `/status`, `/metrics` and meta_info."""
        return {
            "state": (self.state or self.evaluate()).value,
            "max_staleness": self.policy.max_staleness,
            "rollout_batch_size": self.policy.rollout_batch_size,
            "max_ready_groups": self.policy.max_ready_groups,
            "started_groups": self.started,
            "groups_ahead": self.groups_ahead(),
            "capacity": self.capacity(),
            "trainer_steps": self.steps(),
            "ledger_changes": self.ledger.changes,
            "decided_at_change": self.decided_at_change,
        }
