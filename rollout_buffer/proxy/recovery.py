"""Which stored harness sessions come back after a restart (of the buffer, or of the session worker that held
them): those of the run that resumed are restored, those whose records are stored already are let go, the rest are
closed as failed with one record naming why. Decided in the buffer, which has the store and the runs, for its own
sessions and for each session worker's (which sends what its journal holds: `StoredSummary`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.generation.run_manager import RunManager
from rollout_buffer.generation.runner import Run
from rollout_buffer.observability import metrics
from rollout_buffer.proxy.journal import StoredSession, load_state
from rollout_buffer.schemas import TrajectoryRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StoredSummary:
    """What recovery needs of a stored session: its identity, and what its failure record says."""

    session_id: str
    run_id: str
    instance_id: str
    uid: str
    repeat: int
    turns: int
    metadata: dict[str, Any]

    @classmethod
    def of(cls, stored: StoredSession) -> StoredSummary:
        """The summary of a session as its journal holds it."""
        state = load_state(stored)
        return cls(stored.session_id, stored.run_id, stored.instance_id, stored.uid, int(state.get("repeat", 0)),
                   len(stored.turns), state.get("metadata") or {})


@dataclass
class RecoveryPlan:
    """Sessions to restore in `run`, to let go (`done`: their records are stored) and to close as failed."""

    run: Run | None
    restore: list[str] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    fail: dict[str, str] = field(default_factory=dict)  # session id -> why


async def recovery_plan(runs: RunManager, stored: list[StoredSummary]) -> RecoveryPlan:
    """Decide what becomes of each stored session, once `runs` resumed its run (waiting for it to get ready)."""
    done = await runs.buffer.episodes_stored([(s.run_id, s.instance_id, s.uid) for s in stored])
    run = runs.current
    plan = RecoveryPlan(run, done=[s.session_id for s in stored if s.uid in done])
    left = [s for s in stored if s.uid not in done]
    refused: str | None = None
    if run is not None and any(s.run_id == run.run_id for s in left):
        try:
            resources = await run.wait_loaded(120.0)
            if resources.tokenizer is None:
                refused = f"run {run.run_id} has no tokenizer (chat mode)"
        except RuntimeError as e:
            refused = str(e)
    for s in left:
        if run is not None and s.run_id == run.run_id and refused is None:
            plan.restore.append(s.session_id)
        else:
            plan.fail[s.session_id] = refused or await _ended_reason(runs, s.run_id)
    return plan


async def _ended_reason(runs: RunManager, run_id: str) -> str:
    row = await runs.buffer.runs.get(run_id)
    state = row.state if row is not None else "gone"
    return f"run {run_id} was {state} while the buffer was down, before the session was finished"


async def record_failure(runs: RunManager, stored: StoredSummary, reason: str) -> None:
    """Close a stored session that is not restored: one failed record with the reason, in its run (counted in its
    progress when it is the running run; nothing when the run is gone from the store)."""
    run_row = await runs.buffer.runs.get(stored.run_id)
    if run_row is not None:
        record = TrajectoryRecord(
            uid=stored.uid, instance_id=stored.instance_id, messages=[], reward=0.0, status="failed",
            extra_info={"error": reason, "error_kind": "session_failed", "session_id": stored.session_id,
                        "turns": stored.turns, "metadata": stored.metadata, "epoch": 0, "repeat": stored.repeat,
                        "task_type": run_row.config.get("task_type"), "run_id": stored.run_id,
                        "timestamp": time.time()})
        run = runs.running(stored.run_id)
        if run is not None:
            await run.accept([record])
            run.session_failed("session_failed")
        else:
            await runs.buffer.write([record], run_row)
        metrics.TRAJECTORIES_FAILED.labels("session_failed").inc()
    log.warning("session %s closed as failed: %s", stored.session_id, reason)
