"""Group finalization: slime's validity rule, DAPO zero-variance filter, GRPO normalization over episodes; the
policy and user hooks run outside the store, a hook that hangs or raises failing only its group."""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import pytest
from records import Hooks

from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.encoded import encode_record
from rollout_buffer.delivery.groups import GroupPolicy
from rollout_buffer.delivery.records import NewRecord, Records
from rollout_buffer.delivery.store import Store
from rollout_buffer.schemas import TrajectoryRecord


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


def _record(uid: str, instance_id: str, reward: float) -> TrajectoryRecord:
    return TrajectoryRecord.model_validate({"uid": uid, "instance_id": instance_id, "reward": reward, "messages": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": f"answer {uid}"}]})


def test_group_hooks_run_outside_the_store_and_a_hanging_or_raising_hook_fails_only_its_group(tmp_path: Path) -> None:
    """A hook that hangs holds up its own group, not the store: other writes commit meanwhile, and past the
    hook timeout the group is dropped with the reason. A hook that raises drops its group with the error."""
    release, hanging = threading.Event(), threading.Event()

    def hangs(records: list[dict[str, Any]]) -> bool:
        if records[0]["instance_id"] == "slow":
            hanging.set()
            release.wait(30)
        return True

    def explodes(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        if records[0]["instance_id"] == "bad":
            raise ValueError("no transform for you")
        return records

    async def main() -> None:
        config = ServerConfig(data_dir=tmp_path, group_size=2, hook_timeout_s=1.0)
        store = Store(config.db_path)
        await store.open()
        try:
            buffer = RolloutBuffer(config, store, {"hooked": Hooks(is_valid_group=hangs, transform_group=explodes)})
            run = await buffer.runs.get(await buffer.create_run({"task_type": "hooked"}, 2))
            assert run is not None
            slow = asyncio.create_task(buffer.write([_record("s1", "slow", 1.0), _record("s2", "slow", 0.0)], run))
            assert await asyncio.to_thread(hanging.wait, 30), "its hook is running now"
            other = await asyncio.wait_for(buffer.write([_record("o1", "other", 1.0)], run), 0.5)
            assert other.inserted == 1 and not slow.done()  # committed while the hook hangs
            assert (await slow).finished[0].reason == "hook_timeout: no answer within 1 s"
            bad = await buffer.write([_record("b1", "bad", 1.0), _record("b2", "bad", 0.0)], run)
            assert bad.finished[0].reason == "transform_group_error: ValueError: no transform for you"
            good = await buffer.write([_record("g1", "good", 1.0), _record("g2", "good", 0.0)], run)
            assert good.finished[0].reason is None
            assert await buffer.reads.filter_counts(run.run_id) == {
                "hook_timeout: no answer within 1 s": 1, "transform_group_error: ValueError: no transform for you": 1}
            delivered = await buffer.deliver(None, 0, None)
            assert sorted(r.load()["uid"] for r in delivered.records) == ["g1", "g2"]
        finally:
            release.set()
            await store.close()

    asyncio.run(main())


async def _left_complete(buffer: RolloutBuffer, store: Store, records: list[TrajectoryRecord]) -> str:
    """A new run whose group `g` of `records` a stopped process left complete (written, its policy not run);
    the run's id."""
    run = await buffer.runs.get(await buffer.create_run({"task_type": None}, 2))
    assert run is not None
    items = [NewRecord(r.uid, r.instance_id, 0, r.status, encode_record(r), reward=r.reward) for r in records]
    written = await Records(store).write(run.run_id, 2, items)  # stopped before the policy ran
    assert [g.key for g in written.complete] == [(run.run_id, "g", 0, 0)]
    return run.run_id


def test_a_group_left_complete_by_a_stopped_process_is_finished_at_start(tmp_path: Path) -> None:
    """The policy runs between two commits: a process stopped in between leaves the group `complete`, and the
    next start finishes it."""

    async def main() -> None:
        config = ServerConfig(data_dir=tmp_path, group_size=2)
        store = Store(config.db_path)
        await store.open()
        try:
            buffer = RolloutBuffer(config, store, {})
            run_id = await _left_complete(buffer, store, [_record("a", "g", 1.0), _record("b", "g", 0.0)])
            assert await buffer.reads.group_counts(run_id) == {"complete": 1}
            restarted = RolloutBuffer(config, store, {})
            assert await restarted.finish_interrupted() == 1
            assert await restarted.reads.group_counts(run_id) == {"ready": 1}
            delivered = await restarted.deliver(None, 0, None)
            assert [r.raw_reward for r in delivered.records] == [1.0, 0.0]
        finally:
            await store.close()

    asyncio.run(main())


def test_a_poisoned_group_left_by_an_older_release_is_dropped_at_start(tmp_path: Path) -> None:
    """A store an older release wrote (it took 1e308 as a reward) holds a complete group whose normalization
    overflows: the start drops it with its reason instead of failing (a crash loop under a restart policy)."""

    async def main() -> None:
        config = ServerConfig(data_dir=tmp_path, group_size=2)
        store = Store(config.db_path)
        await store.open()
        try:
            poisoned = TrajectoryRecord.model_construct(**{**_record("b", "g", 0.0).model_dump(), "reward": 1e308})
            run_id = await _left_complete(RolloutBuffer(config, store, {}), store, [_record("a", "g", 1.0), poisoned])
            restarted = RolloutBuffer(config, store, {})
            assert await restarted.finish_interrupted() == 1
            assert await restarted.reads.group_counts(run_id) == {"filtered": 1}
            (group,) = await restarted.reads.list_groups("filtered", run_id, 10)
            assert group["reason"].startswith("reward_out_of_range"), group
        finally:
            await store.close()

    asyncio.run(main())


@pytest.mark.parametrize(("poison", "reason"), [
    ({"reward": 1e308}, "reward_out_of_range"),
    ({"reward": float("nan")}, "reward_out_of_range"),
    ({"extra_info": {"episode_reward": float("inf")}}, "reward_out_of_range"),
    ({"extra_info": {"episode_reward": "lots"}}, "reward_out_of_range"),
    ({"extra_info": {"reward_weight": -1e300}}, "reward_out_of_range"),
    ({"extra_info": None, "messages": "not a list"}, "group_policy_error"),
])
def test_no_value_makes_finishing_a_group_raise(poison: dict[str, Any], reason: str) -> None:
    """A value the store took (or a record of an older release) drops its own group with the reason; the policy
    never raises (it runs in the store's thread and at start-up)."""
    records = [rec("a", 1.0), {**rec("b", 0.0), **poison}]
    for policy in (GroupPolicy(), GroupPolicy(drop_zero_variance=True)):
        out = policy.finalize([dict(r) for r in records])
        assert out.reason is not None and out.reason.startswith(reason), out.reason


def test_a_batch_counts_only_its_own_runs_groups(tmp_path: Path) -> None:
    """A group of a replaced run that is dropped after the next run started (an agent session left open) is not
    reported as a loss of the next run's batches."""

    async def main() -> None:
        config = ServerConfig(data_dir=tmp_path, group_size=2)
        store = Store(config.db_path)
        await store.open()
        try:
            buffer = RolloutBuffer(config, store, {})
            old = await buffer.runs.get(await buffer.create_run({"task_type": None}, 2))
            new = await buffer.runs.get(await buffer.create_run({"task_type": None}, 2))
            assert old is not None and new is not None
            failed = TrajectoryRecord.model_validate({**_record("o2", "left-open", 0.0).model_dump(),
                                                      "status": "failed"})
            await buffer.write([_record("o1", "left-open", 1.0), failed], old)  # dropped: failed_trajectory
            await buffer.write([_record("n1", "fresh", 1.0), _record("n2", "fresh", 0.0)], new)
            delivered = await buffer.deliver(None, 0, None)
            assert delivered.meta_info["run_id"] == new.run_id
            assert delivered.meta_info["filtered_groups"] == {}, delivered.meta_info
            assert delivered.meta_info["finished_groups"] == ["fresh"]
        finally:
            await store.close()

    asyncio.run(main())


def test_a_full_store_at_start_is_served_degraded_and_caught_up_once_it_has_room(tmp_path: Path) -> None:
    """Groups a stopped process left complete cannot be finished on a full store: the start goes on degraded
    (reads served, `degraded` saying why), and the groups are finished once the store has room, without a
    restart."""
    from rollout_buffer.server.catch_up import CatchUp

    async def main() -> None:
        config = ServerConfig(data_dir=tmp_path, group_size=2)
        store = Store(config.db_path)
        await store.open()
        buffer = RolloutBuffer(config, store, {})
        run = await buffer.runs.get(await buffer.create_run({"task_type": None}, 2))
        assert run is not None
        items = [NewRecord(r.uid, r.instance_id, 0, r.status, encode_record(r), reward=r.reward)
                 for g in range(200) for r in (_record(f"a{g}", f"g{g}", 1.0), _record(f"b{g}", f"g{g}", 0.0))]
        await Records(store).write(run.run_id, 2, items)  # stopped before the policy ran
        await store.close()
        full = Store(config.db_path, max_bytes=config.db_path.stat().st_size)  # not a page more
        await full.open()
        try:
            restarted = RolloutBuffer(config, full, {})
            catch_up = CatchUp([("finishing complete groups", restarted.finish_interrupted)], retry_s=0.05)
            await catch_up.start()
            assert catch_up.degraded is not None and "full" in catch_up.degraded, catch_up.degraded
            assert (await restarted.reads.group_counts(run.run_id)).get("complete"), "reads are served"
            assert await restarted.get_record("a0") is not None
            await full.call(lambda conn: conn.execute("PRAGMA max_page_count=1000000"))  # room again
            for _ in range(200):
                if catch_up.degraded is None:
                    break
                await asyncio.sleep(0.05)
            assert catch_up.degraded is None
            assert await restarted.reads.group_counts(run.run_id) == {"ready": 200}
            await catch_up.stop()
        finally:
            await full.close()

    asyncio.run(main())
