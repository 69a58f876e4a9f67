"""Completing a group does not write its records anew: the built-in policy runs on their facts, and only the
beginning of each record's stored JSON (its `reward` and `raw_reward`) changes. Records stored without facts, or
whose JSON begins otherwise (an earlier release's), get their rewards all the same."""

from __future__ import annotations

import asyncio
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest

from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.encoded import FACTS_FROM_BYTES, EncodedRecord
from rollout_buffer.delivery.groups import GroupPolicy
from rollout_buffer.delivery.record_layout import rewards_prefix
from rollout_buffer.delivery.store import Store
from rollout_buffer.schemas import TrajectoryRecord

GROUP = 4


def long_record(i: int, reward: float) -> dict[str, Any]:
    """A token-mode record of 8 000 tokens (long enough to carry facts), its last message the answer."""
    n = 8000
    return {"uid": f"u{i}", "instance_id": "task", "reward": reward, "extra_info": {"epoch": 0, "repeat": i},
            "messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"a{i}"}],
            "tokens": [(7 * k + i) % 151000 for k in range(n)], "loss_mask": [0] * 1000 + [1] * 7000,
            "rollout_log_probs": [-0.25 * (k % 5) for k in range(7000)], "response_length": 7000}


def expected(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """What the built-in policy makes of the whole records."""
    full = [EncodedRecord.of(TrajectoryRecord.model_validate(r)) for r in records]
    return GroupPolicy().finalize([orjson.loads(e.row.blob) for e in full]).records


def stored(db: Path) -> dict[str, bytes]:
    with sqlite3.connect(db) as conn:
        return dict(conn.execute("SELECT uid, record FROM trajectories"))


def run_group(tmp_path: Path, before_last: str | None = None) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Write a group of four (the SQL `before_last` run on the store before its last record arrives): the
    records' JSON before the group completed, and after."""
    records = [long_record(i, float(i % 2)) for i in range(GROUP)]

    async def main() -> tuple[dict[str, bytes], dict[str, bytes]]:
        config = ServerConfig(data_dir=tmp_path, group_size=GROUP)
        store = Store(config.db_path)
        await store.open()
        try:
            buffer = RolloutBuffer(config, store, {})
            run = await buffer.runs.get(await buffer.create_run({"task_type": None}, GROUP))
            assert run is not None
            encoded = [EncodedRecord.of(TrajectoryRecord.model_validate(r)) for r in records]
            await buffer.write_encoded(encoded[:-1], run)
            if before_last is not None:
                await store.call(lambda conn: conn.execute(before_last))
            before = await store.call(lambda conn: dict(conn.execute("SELECT uid, record FROM trajectories")))
            result = await buffer.write_encoded(encoded[-1:], run)
            assert [f.reason for f in result.finished] == [None]
            delivered = await buffer.deliver(None, 0, None)
            assert [r.reward for r in delivered.records] == pytest.approx([r["reward"] for r in expected(records)])
            return before | {encoded[-1].row.uid: encoded[-1].row.blob}, stored(config.db_path)
        finally:
            await store.close()

    before, after = asyncio.run(main())
    for want in expected(records):  # every record whole, with its group's rewards
        assert orjson.loads(after[want["uid"]]) == want
    return before, after


def test_long_records_carry_facts_and_short_ones_do_not() -> None:
    """A short record is parsed when its group completes: that costs less than carrying its facts."""
    long = EncodedRecord.of(TrajectoryRecord.model_validate(long_record(0, 1.0))).row
    assert len(long.blob) >= FACTS_FROM_BYTES and long.facts is not None
    assert orjson.loads(long.facts) == {k: v for k, v in orjson.loads(long.blob).items()
                                        if k not in ("tokens", "loss_mask", "rollout_log_probs")} | {
        "messages": [{"role": "assistant", "content": "a0"}]}
    short = EncodedRecord.of(TrajectoryRecord.model_validate({**long_record(0, 1.0), "tokens": None,
                                                              "loss_mask": None, "rollout_log_probs": None,
                                                              "response_length": None})).row
    assert short.facts is None


def test_completing_a_group_changes_only_the_beginning_of_its_records_json(tmp_path: Path) -> None:
    before, after = run_group(tmp_path)
    for uid, blob in before.items():
        facts = orjson.loads(blob)
        begins = rewards_prefix(facts)
        assert blob.startswith(begins) and after[uid].startswith(rewards_prefix(orjson.loads(after[uid])))
        assert after[uid][len(rewards_prefix(orjson.loads(after[uid]))):] == blob[len(begins):]
    assert any(after[uid] != blob for uid, blob in before.items())  # the rewards were normalized


def test_records_stored_without_facts_complete_from_their_json(tmp_path: Path) -> None:
    run_group(tmp_path, "UPDATE trajectories SET facts=NULL WHERE uid='u1'")


def test_a_record_whose_json_begins_otherwise_gets_its_rewards(tmp_path: Path) -> None:
    """An earlier release stored the fields in the model's order (`uid` first)."""
    with_uid_first = orjson.dumps(
        {"uid": "u0", **{k: v for k, v in orjson.loads(EncodedRecord.of(TrajectoryRecord.model_validate(
            long_record(0, 0.0))).row.blob).items() if k != "uid"}}).decode()
    run_group(tmp_path, f"UPDATE trajectories SET record=CAST('{with_uid_first}' AS BLOB) WHERE uid='u0'")
