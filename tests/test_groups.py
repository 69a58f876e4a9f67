"""Group finalization: slime's validity rule, DAPO zero-variance filter, GRPO normalization over episodes."""

from __future__ import annotations

import pytest

from rollout_buffer.delivery.groups import GroupPolicy


def rec(uid: str, reward: float, content: str = "answer", **extra) -> dict:
    return {"uid": uid, "reward": reward, "extra_info": extra,
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": content}]}


def test_grpo_values() -> None:
    out = GroupPolicy().finalize([rec("a", 1.0), rec("b", 0.0), rec("c", 0.0), rec("d", 1.0)])
    assert out.reason is None
    adv = 0.5 / (0.5 + 1e-6)  # mean 0.5, population std 0.5
    assert [r["reward"] for r in out.records] == pytest.approx([adv, -adv, -adv, adv])
    assert [r["raw_reward"] for r in out.records] == [1.0, 0.0, 0.0, 1.0]


def test_zero_variance_kept_as_zero_or_dropped() -> None:
    same = [rec(str(i), 1.0) for i in range(4)]
    assert [r["reward"] for r in GroupPolicy().finalize([dict(r) for r in same]).records] == [0.0] * 4
    assert GroupPolicy(drop_zero_variance=True).finalize(same).reason == "zero_variance"


def test_normalization_off_keeps_raw() -> None:
    out = GroupPolicy(normalize=False).finalize([rec("a", 1.0), rec("b", 0.0)])
    assert [r["reward"] for r in out.records] == [1.0, 0.0]


def test_empty_response_and_failed_trajectories_drop_the_group() -> None:
    assert GroupPolicy().finalize([rec("a", 1.0), rec("b", 0.0, content=" ")]).reason == "empty_response"
    failed = rec("c", 0.0)
    failed["status"] = "failed"
    assert GroupPolicy().finalize([rec("a", 1.0), failed]).reason == "failed_trajectory"


def test_generator_hooks() -> None:
    out = GroupPolicy(is_valid_group=lambda g: (False, "too_easy")).finalize([rec("a", 1.0)])
    assert out.reason == "too_easy"
    boom = GroupPolicy(is_valid_group=lambda g: 1 / 0).finalize([rec("a", 1.0)])
    assert boom.reason is not None and boom.reason.startswith("is_valid_group_error: ZeroDivisionError")
    tagged = GroupPolicy(transform_group=lambda g: [{**r, "tag": 1} for r in g]).finalize([rec("a", 1.0)])
    assert tagged.records[0]["tag"] == 1


def test_episodes_normalize_as_units_with_role_weights() -> None:
    # Two episodes of a multi-agent task: episode rewards 1 and 0, planner weight 1, actor weight 0.5.
    group = [
        rec("e1-p", 1.0, episode_id="e1", reward_weight=1.0, episode_reward=1.0),
        rec("e1-a1", 0.5, episode_id="e1", reward_weight=0.5, episode_reward=1.0),
        rec("e1-a2", 0.5, episode_id="e1", reward_weight=0.5, episode_reward=1.0),
        rec("e2-p", 0.0, episode_id="e2", reward_weight=1.0, episode_reward=0.0),
        rec("e2-a1", 0.0, episode_id="e2", reward_weight=0.5, episode_reward=0.0),
    ]
    out = GroupPolicy().finalize(group)
    adv = 0.5 / (0.5 + 1e-6)
    assert [r["reward"] for r in out.records] == pytest.approx([adv, adv / 2, adv / 2, -adv, -adv / 2])
