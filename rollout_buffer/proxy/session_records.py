"""What a session closes into: one record per branch that generated a turn of its own. A harness session's records
are built, stamped as the runner stamps a trajectory's and validated here, in one pass, before they are stored."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

from pydantic import ValidationError

from rollout_buffer.generation.context import RolloutContext, stamp
from rollout_buffer.proxy.tree import SessionTree
from rollout_buffer.schemas import Trajectory, TrajectoryRecord, TrajectoryStatus


class _RecordsRun(Protocol):
    def failed(self, item: dict[str, Any], ctx: RolloutContext, kind: str, text: str) -> TrajectoryRecord: ...


class Closing(Protocol):
    """What closing reads of a session (`proxy.session.Session`)."""

    session_id: str
    ctx: RolloutContext
    tree: SessionTree
    metadata: dict[str, Any]
    images_omitted: int

    async def stop(self, state: str, wait_s: float = ...) -> None: ...

    def harness_run(self) -> _RecordsRun: ...


class InvalidRecords(ValueError):
    """A session's records do not validate (a 422 to whoever finished it)."""


async def branch_records(session: Closing, reward: float, status: TrajectoryStatus | None = None,
                         **extra_info: Any) -> list[Trajectory]:
    """One record per branch that generated a turn of its own, sharing `reward` (not stamped yet).

    ValueError when no branch generated anything. `status` overrides the records' status (`failed`).
    """
    branches = [b for _, b in sorted(session.tree.branches.items()) if b.own_turns > 0]
    if not branches:
        raise ValueError(f"session {session.session_id} generated no model turn")
    several = len(branches) > 1
    out: list[Trajectory] = []
    for b in branches:
        info: dict[str, Any] = {
            **extra_info,
            "session_id": session.session_id,
            "branch": b.id,
            "parent_branch": b.parent,
            "fork_turn": b.own_from,
            "shared_messages": b.shared_messages,
            "branch_turns": b.own_turns,
            "tool_calls": b.tool_calls,
            "ill_formed_turns": b.ill_formed,
            "protocols": sorted(b.protocols),
            "episode_reward": float(reward),
        }
        extras = {"lane": b.lane, "images_omitted": session.images_omitted or None}
        info.update({k: v for k, v in extras.items() if v is not None})
        if session.metadata:
            info.setdefault("metadata", session.metadata)
        record = await session.ctx.trajectory(b.conv, reward, b.conv.finish_reason or "stop", **info)
        record["messages"] = list(record["messages"])
        if status is not None:
            record["status"] = status
        if several:
            record["uid"] = f"{session.ctx.uid}-{b.id}"
        out.append(record)
    return out


async def finished_records(session: Closing, reward: float, extra_info: dict[str, Any]
                           ) -> tuple[list[TrajectoryRecord], str]:
    """Stop a harness session: its stamped, validated records (one failed record when it generated nothing) and
    the outcome (`finished`, `empty`). InvalidRecords when a record is not valid."""
    await session.stop("finished")
    try:
        raw = await branch_records(session, reward, **extra_info)
        outcome = "finished"
    except ValueError as e:
        failed = session.harness_run().failed({}, session.ctx, "empty_session", str(e))
        return stamped(session, [failed.model_dump(mode="json")]), "empty"
    return stamped(session, raw), outcome


async def failed_records(session: Closing, reason: str, outcome: str, wait_s: float
                         ) -> tuple[list[TrajectoryRecord], bool]:
    """Stop a harness session that failed (`outcome`: expired, failed), cancelling turns in flight after `wait_s`:
    its branches as failed records with the reason (one failed record when it generated nothing), and whether it
    had any."""
    await session.stop(outcome, wait_s)
    kind = f"session_{outcome}"
    try:
        raw = await branch_records(session, 0.0, status="failed", error=reason, error_kind=kind)
    except ValueError:
        return stamped(session, [session.harness_run().failed({}, session.ctx, kind, reason).model_dump(
            mode="json")]), False
    return stamped(session, raw), True


def stamped(session: Closing, raw: Sequence[Trajectory | dict[str, Any]]) -> list[TrajectoryRecord]:
    """Records as the runner stamps a trajectory's (uid per branch when there are several), validated."""
    several = len(raw) > 1
    try:
        return [TrajectoryRecord.model_validate(stamp(r, session.ctx, k if several else None))
                for k, r in enumerate(raw)]
    except ValidationError as e:
        raise InvalidRecords(f"the session's records are invalid: {e}") from None
