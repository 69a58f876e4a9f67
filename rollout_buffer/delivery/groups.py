"""What happens to a group when its last trajectory arrives: validity filters, then reward normalization."""

from __future__ import annotations

import asyncio
import logging
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rollout_buffer.schemas import REWARD_LIMIT

log = logging.getLogger(__name__)

Record = dict[str, Any]
GroupKey = tuple[str, str, int, int]  # run_id, instance_id, epoch, part: one group
GROUP_KEY_SQL = "run_id=? AND instance_id=? AND epoch=? AND part=?"  # a `GroupKey` as SQL conditions

# Standard deviations below this count as zero variance (all rewards equal).
ZERO_VARIANCE_EPS = 1e-8
# Added to the denominator as slime's GRPO normalization does.
NORM_EPS = 1e-6


class RewardOutOfRange(ValueError):
    """A reward, episode reward or reward weight that is not a finite number within ±REWARD_LIMIT."""


def bounded(value: Any, what: str) -> float:
    """`value` as a float, RewardOutOfRange unless it is finite and within ±REWARD_LIMIT."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise RewardOutOfRange(f"{what} {value!r} is not a number") from None
    if not -REWARD_LIMIT <= number <= REWARD_LIMIT:  # NaN fails both comparisons
        raise RewardOutOfRange(f"{what} {value!r} is not a finite number within ±{REWARD_LIMIT:g}")
    return number


@dataclass(frozen=True)
class GroupOutcome:
    """A finished group: delivered when `reason` is None, else dropped for that reason."""

    records: list[Record]
    reason: str | None = None


@dataclass(frozen=True)
class GroupPolicy:
    """How a run finalizes its groups. Generator hooks use slime's names and signatures."""

    normalize: bool = True
    drop_zero_variance: bool = False
    is_valid_group: Callable[[list[Record]], Any] | None = None
    transform_group: Callable[[list[Record]], list[Record]] | None = None
    hook_timeout_s: float = 60.0

    @property
    def has_hooks(self) -> bool:
        """Whether the policy runs user code (`is_valid_group`, `transform_group`)."""
        return self.is_valid_group is not None or self.transform_group is not None

    async def outcome(self, records: list[Record]) -> GroupOutcome:
        """`finalize` without blocking the event loop: with user hooks it runs in a worker thread, and a hook
        that does not return within `hook_timeout_s` drops the group (the thread is left to finish)."""
        if not self.has_hooks:
            return self.finalize(records)  # the built-in policy: a few arithmetic steps per record
        try:
            return await asyncio.wait_for(asyncio.to_thread(self.finalize, records), self.hook_timeout_s)
        except TimeoutError:
            key = records[0].get("instance_id") if records else None
            log.error("group hooks of instance %s did not return within %.0f s; the group is dropped", key,
                      self.hook_timeout_s)
            return GroupOutcome(records, f"hook_timeout: no answer within {self.hook_timeout_s:g} s")

    def finalize(self, records: list[Record]) -> GroupOutcome:
        """Filter, normalize and transform one complete group. Never raises: whatever fails (a hook, a reward out
        of range, a record of the wrong shape) drops the group with the reason, so no group stays complete
        forever and no start-up fails on one."""
        try:
            return self._finalize(records)
        except RewardOutOfRange as e:
            return GroupOutcome(records, f"reward_out_of_range: {e}")
        except Exception as e:  # the store's own code must not be taken down by one group's values
            log.exception("the group policy failed on a group of instance %s; it is dropped",
                          records[0].get("instance_id") if records else None)
            return GroupOutcome(records, f"group_policy_error: {type(e).__name__}: {e}")

    def _finalize(self, records: list[Record]) -> GroupOutcome:
        for r in records:
            if r.get("raw_reward") is None:
                r["raw_reward"] = r["reward"]
            bounded((r.get("extra_info") or {}).get("reward_weight", 1.0), "extra_info.reward_weight")
        episode_rewards(records)  # every reward in range before anything (a hook included) reads one
        reason = failed_reason(records) or self._validity_reason(records)
        if reason is not None:
            return GroupOutcome(records, reason)
        if self.normalize:
            normalize_rewards(records)
        if self.transform_group is not None:
            try:
                records = list(self.transform_group(records))
            except Exception as e:
                return GroupOutcome(records, f"transform_group_error: {type(e).__name__}: {e}")
        return GroupOutcome(records)

    def _validity_reason(self, records: list[Record]) -> str | None:
        if self.is_valid_group is not None:
            try:
                verdict = self.is_valid_group(records)
            except Exception as e:  # a user hook must not take the store down
                return f"is_valid_group_error: {type(e).__name__}: {e}"
            # slime's hooks return a bool, or a (bool, reason) pair in some generators.
            ok, why = verdict if isinstance(verdict, tuple) else (verdict, "invalid_group")
            return None if ok else str(why or "invalid_group")
        if not all(has_response(r) for r in records):
            return "empty_response"
        if self.drop_zero_variance and reward_std(records) < ZERO_VARIANCE_EPS:
            return "zero_variance"
        return None


def failed_reason(records: list[Record]) -> str | None:
    """A group with a failed trajectory cannot be trained on as a whole."""
    if any(r.get("status") == "failed" for r in records):
        return "failed_trajectory"
    return None


def has_response(record: Record) -> bool:
    """slime's rule: the trajectory ends with a non-empty assistant message."""
    messages = record.get("messages") or []
    if not messages:
        return False
    last = messages[-1]
    content = last.get("content") if isinstance(last, dict) else None
    if isinstance(content, list):  # OpenAI content parts
        content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return last.get("role") == "assistant" and bool(str(content or "").strip() or last.get("tool_calls"))


def episode_rewards(records: list[Record]) -> dict[str, float]:
    """One raw reward per episode: `extra_info.episode_reward` when a multi-agent generator sets it, else
    the mean raw reward of the episode's records. A record without `episode_id` is its own episode."""
    members: dict[str, list[Record]] = {}
    for r in records:
        members.setdefault(_episode(r), []).append(r)
    out: dict[str, float] = {}
    for ep, rs in members.items():
        shared = (rs[0].get("extra_info") or {}).get("episode_reward")
        out[ep] = (bounded(shared, "extra_info.episode_reward") if shared is not None
                   else statistics.fmean(bounded(r["raw_reward"], "reward") for r in rs))
    return out


def _episode(record: Record) -> str:
    return str((record.get("extra_info") or {}).get("episode_id") or record["uid"])


def reward_std(records: list[Record]) -> float:
    """Population standard deviation of the group's episode rewards."""
    rewards = list(episode_rewards(records).values())
    return statistics.pstdev(rewards) if len(rewards) > 1 else 0.0


def normalize_rewards(records: list[Record]) -> None:
    """GRPO over episodes: (R − mean) / (std + eps), 0 for a zero-variance group.

    A record's reward is its episode's advantage times its `extra_info.reward_weight` (default 1), so
    planner and actor samples of one episode can weigh the shared reward differently.
    """
    per_episode = episode_rewards(records)
    values = list(per_episode.values())
    mean = statistics.fmean(values)
    std = statistics.pstdev(values) if len(values) > 1 else 0.0
    for r in records:
        weight = bounded((r.get("extra_info") or {}).get("reward_weight", 1.0), "extra_info.reward_weight")
        advantage = 0.0 if std < ZERO_VARIANCE_EPS else (per_episode[_episode(r)] - mean) / (std + NORM_EPS)
        r["reward"] = advantage * weight
