"""A long record's JSON is written once: its group completes from the records' facts, and what it decided (the
JSON's new beginning: `reward`, `raw_reward`) is kept beside it and put in place wherever the record is read.
Records stored without facts, or whose JSON begins otherwise (an earlier release's), get their rewards all the
same, written into them."""

from __future__ import annotations

import asyncio
import io
import sqlite3
from pathlib import Path
from typing import Any

import orjson
import pytest
from records import Hooks, long_record

from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.encoded import FACTS_FROM_BYTES, EncodedRecord
from rollout_buffer.delivery.groups import GroupPolicy
from rollout_buffer.delivery.queries import Reader
from rollout_buffer.delivery.record_layout import REWARDED_SQL, REWARDS_JOIN_SQL, with_rewards
from rollout_buffer.delivery.records import Records
from rollout_buffer.delivery.store import Store
from rollout_buffer.schemas import TrajectoryRecord
from rollout_buffer.tools.export import export

GROUP = 4


def expected(records: list[dict[str, Any]], **hooks: Any) -> list[dict[str, Any]]:
    """What the policy (built-in, or with `hooks`) makes of the whole records."""
    full = [EncodedRecord.of(TrajectoryRecord.model_validate(r)) for r in records]
    return GroupPolicy(**hooks).finalize([orjson.loads(e.row.blob) for e in full]).records


def stored(db: Path) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Each record's JSON as stored, and as read (with what its group decided)."""
    with sqlite3.connect(db) as conn:
        rows = conn.execute(f"SELECT t.uid, {REWARDED_SQL} FROM trajectories t {REWARDS_JOIN_SQL}").fetchall()
    return {uid: blob for uid, blob, *_ in rows}, {uid: with_rewards(*rest) for uid, *rest in rows}


def run_group(tmp_path: Path, before_last: str | None = None, hooks: dict[str, Any] | None = None
              ) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Write a group of four (the SQL `before_last` run on the store before its last record arrives), check
    every record reads whole with its group's rewards (delivered and looked up): the records' JSON as stored
    before the group completed, and after."""
    records = [long_record(i, float(i % 2)) for i in range(GROUP)]

    async def main() -> tuple[dict[str, bytes], dict[str, bytes]]:
        config = ServerConfig(data_dir=tmp_path, group_size=GROUP)
        store = Store(config.db_path)
        await store.open()
        try:
            buffer = RolloutBuffer(config, store, {"hooked": Hooks(**hooks or {})})
            run = await buffer.runs.get(await buffer.create_run({"task_type": "hooked"}, GROUP))
            assert run is not None
            encoded = [EncodedRecord.of(TrajectoryRecord.model_validate(r)) for r in records]
            await buffer.write_encoded(encoded[:-1], run)
            if before_last is not None:
                await store.call(lambda conn: conn.execute(before_last))
            before = await store.call(lambda conn: dict(conn.execute("SELECT uid, record FROM trajectories")))
            result = await buffer.write_encoded(encoded[-1:], run)
            assert [f.reason for f in result.finished] == [None]
            delivered = await buffer.deliver(None, 0, None)
            want = expected(records, **hooks or {})
            assert [r.reward for r in delivered.records] == pytest.approx([r["reward"] for r in want])
            assert [orjson.loads(r.blob) for r in delivered.records] == want
            assert [await buffer.get_record(r.row.uid) for r in encoded] == want
            reader = Reader(config.db_path)  # the dashboard's
            try:
                assert [(await reader.trajectory(r["uid"]) or {}).get("record") for r in want] == want
                members = await reader.group(run.run_id, "task", 0, 0)
                assert [(m["reward"], m["raw_reward"], m["normalized"]) for m in members] == [
                    (r["reward"], r["raw_reward"], True) for r in want]
                (batch,) = await reader.batches(run.run_id)
                assert batch["normalized"] == [r["reward"] for r in want]
            finally:
                await reader.close()
            return before | {encoded[-1].row.uid: encoded[-1].row.blob}, stored(config.db_path)
        finally:
            await store.close()

    before, (after, read) = asyncio.run(main())
    want = expected(records, **hooks or {})
    assert [orjson.loads(read[r["uid"]]) for r in want] == want
    out = io.BytesIO()
    export(tmp_path, out)  # `rollout-buffer export`
    assert [orjson.loads(line) for line in out.getvalue().splitlines()] == want
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


def test_a_long_records_json_is_written_once(tmp_path: Path) -> None:
    before, after = run_group(tmp_path)
    assert after == before  # byte for byte: what the group decided is kept beside it


def test_a_record_without_facts_is_rewritten_beside_long_ones_that_are_not(tmp_path: Path) -> None:
    """A short record (or one stored before facts were kept) in a group of long ones."""
    before, after = run_group(tmp_path, "UPDATE trajectories SET facts=NULL WHERE uid='u1'")
    assert after["u1"] != before["u1"] and all(after[uid] == before[uid] for uid in ("u0", "u2", "u3"))


def test_a_record_whose_json_begins_otherwise_gets_its_rewards(tmp_path: Path) -> None:
    """Stored with its fields in another order (`uid` first): it is written anew with its rewards."""
    with_uid_first = orjson.dumps(
        {"uid": "u0", **{k: v for k, v in orjson.loads(EncodedRecord.of(TrajectoryRecord.model_validate(
            long_record(0, 0.0))).row.blob).items() if k != "uid"}}).decode()
    before, after = run_group(tmp_path, f"UPDATE trajectories SET record=CAST('{with_uid_first}' AS BLOB) "
                                        "WHERE uid='u0'")
    assert after["u0"] != before["u0"] and all(after[uid] == before[uid] for uid in ("u1", "u2", "u3"))


def test_records_a_hook_transforms_are_written_whole_and_read_as_it_left_them(tmp_path: Path) -> None:
    def tag(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**r, "reward": 2 * r["reward"], "extra_info": {**r["extra_info"], "tagged": True}} for r in records]

    before, after = run_group(tmp_path, hooks={"transform_group": tag})
    assert all(after[uid] != blob for uid, blob in before.items())


def test_a_group_of_long_records_left_complete_by_a_stopped_process_is_finished_from_its_facts(tmp_path: Path
                                                                                              ) -> None:
    """At start, as when it completed: the records' JSON written once, what the group decided read beside it."""
    records = [long_record(i, float(i % 2)) for i in range(GROUP)]

    async def main() -> None:
        config = ServerConfig(data_dir=tmp_path, group_size=GROUP)
        store = Store(config.db_path)
        await store.open()
        try:
            buffer = RolloutBuffer(config, store, {})
            run = await buffer.runs.get(await buffer.create_run({"task_type": None}, GROUP))
            assert run is not None
            encoded = [EncodedRecord.of(TrajectoryRecord.model_validate(r)) for r in records]
            written = await Records(store).write(run.run_id, GROUP, [e.row for e in encoded])  # stopped here
            assert [g.key for g in written.complete] == [(run.run_id, "task", 0, 0)]
            before, _ = stored(config.db_path)
            restarted = RolloutBuffer(config, store, {})
            assert await restarted.finish_interrupted() == 1
            after, read = stored(config.db_path)
            assert after == before
            want = expected(records)
            assert [orjson.loads(read[r["uid"]]) for r in want] == want
            delivered = await restarted.deliver(None, 0, None)
            assert [orjson.loads(r.blob) for r in delivered.records] == want
        finally:
            await store.close()

    asyncio.run(main())
