"""Retention (`serve --prune-delivered-after-h`): a long record of a group every stream has delivered is cut down
to its facts once older than the option says; its row, reward and last message stay and every reader still
reads it (with `pruned_at`); export leaves it out and counts it. Records of groups still to be delivered (ready,
or leased and not acked), short records and records not old enough are kept whole."""

from __future__ import annotations

import asyncio
import io
import logging
import os
import sqlite3
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from records import Hooks, long_record
from servers import Server, free_port

from rollout_buffer.config import ServerConfig
from rollout_buffer.delivery.buffer import RolloutBuffer
from rollout_buffer.delivery.encoded import EncodedRecord
from rollout_buffer.delivery.queries import Reader
from rollout_buffer.delivery.retention import Retention, prune_delivered
from rollout_buffer.delivery.store import Store
from rollout_buffer.media.image_store import ImageStore
from rollout_buffer.media.images import image_of, image_part
from rollout_buffer.media.run_images import RunImages
from rollout_buffer.schemas import TrajectoryRecord
from rollout_buffer.tools.export import export
from rollout_sim.vision_checkpoint import png

GROUP = 2


def group(instance_id: str, long: bool) -> list[EncodedRecord]:
    records = []
    for i in range(GROUP):
        record = {**long_record(i, float(i)), "uid": f"{instance_id}-{i}", "instance_id": instance_id}
        if not long:  # the same trajectory without its token lists: a short record, no facts
            record |= {"tokens": None, "loss_mask": None, "rollout_log_probs": None, "response_length": None}
        records.append(EncodedRecord.of(TrajectoryRecord.model_validate(record)))
    return records


def rows(db: Path) -> dict[str, tuple[int, bool, float | None]]:
    """Each record's stored size, whether it carries facts, and when it was pruned."""
    with sqlite3.connect(db) as conn:
        return {uid: (size, has_facts, pruned_at) for uid, size, has_facts, pruned_at in conn.execute(
            "SELECT uid, length(record), facts IS NOT NULL, pruned_at FROM trajectories")}


def test_long_records_of_delivered_groups_are_cut_to_their_facts_once_old(tmp_path: Path) -> None:
    async def main() -> tuple[dict[str, Any], list[dict[str, Any]]]:
        config = ServerConfig(data_dir=tmp_path, group_size=GROUP)
        store = Store(config.db_path)
        await store.open()
        try:
            buffer = RolloutBuffer(config, store, {"hooked": Hooks()})
            run = await buffer.runs.get(await buffer.create_run({"task_type": "hooked"}, GROUP))
            assert run is not None

            async def prune(before: float) -> int:
                return sum([await store.call(lambda conn: prune_delivered(conn, before)) for _ in range(4)])

            await buffer.write_encoded(group("delivered", long=True) + group("short", long=False), run)
            delivered = await buffer.deliver(None, 0, None)  # both groups, consumed (no lease)
            assert sorted(orjson.loads(r.blob)["instance_id"] for r in delivered.records) == \
                ["delivered", "delivered", "short", "short"]
            want = {orjson.loads(r.blob)["uid"]: orjson.loads(r.blob) for r in delivered.records}
            await buffer.write_encoded(group("leased", long=True), run)
            leased = await buffer.deliver(None, 0, 60.0)  # leased, not acked yet
            await buffer.write_encoded(group("ready", long=True), run)  # ready, not delivered

            assert await prune(time.time() - 3600) == 0  # none is old enough
            assert await prune(time.time() + 1) == GROUP  # the delivered long records alone
            assert await buffer.ack(leased.meta_info["batch_id"]) == 1
            assert await prune(time.time() + 1) == GROUP  # acked: consumed now

            reader = Reader(config.db_path)  # the dashboard's
            try:
                for uid in ("delivered-0", "delivered-1"):
                    record = await buffer.get_record(uid)
                    assert record is not None and record["pruned_at"] > 0
                    assert "tokens" not in record and "rollout_log_probs" not in record
                    assert record["messages"] == want[uid]["messages"][-1:]
                    assert (record["reward"], record["raw_reward"]) == (want[uid]["reward"], want[uid]["raw_reward"])
                    shown = await reader.trajectory(uid)
                    assert shown is not None and shown["pruned_at"] == record["pruned_at"]
                members = await reader.group(run.run_id, "delivered", 0, 0)
                assert [m["reward"] for m in members] == [want[f"delivered-{i}"]["reward"] for i in range(GROUP)]
            finally:
                await reader.close()
            return want, [await buffer.get_record(f"short-{i}") for i in range(GROUP)]
        finally:
            await store.close()

    want, short = asyncio.run(main())
    assert short == [want[f"short-{i}"] for i in range(GROUP)]  # whole
    stored = rows(tmp_path / "buffer.sqlite")
    for uid, (size, has_facts, pruned_at) in stored.items():
        pruned = uid.startswith(("delivered", "leased"))
        assert (pruned_at is not None) == pruned, uid
        assert size < 2000 if pruned else (size > 50_000) == uid.startswith("ready"), (uid, size)
        assert has_facts == uid.startswith("ready"), uid  # a pruned record is its facts; short ones have none
    out = io.BytesIO()
    summary = export(tmp_path, out)  # `rollout-buffer export`: the delivered records it still holds whole
    assert [orjson.loads(line)["uid"] for line in out.getvalue().splitlines()] == ["short-0", "short-1"]
    assert summary.pruned == 2 * GROUP

    # Served: the option is taken and named; the API and the dashboard say a record was pruned.
    port = free_port()
    srv = Server(["serve", "--port", str(port), "--data-dir", str(tmp_path), "--prune-delivered-after-h", "24"],
                 "/healthz", port, tmp_path / "buffer.log").start()
    try:
        assert "long records of delivered groups are cut down to their facts after 24 h" in srv.log()
        record = httpx.get(f"{srv.url}/trajectories/delivered-0", timeout=10).json()
        assert record["pruned_at"] > 0 and record["reward"] == want["delivered-0"]["reward"], record
        shown = httpx.get(f"{srv.url}/ui/api/trajectories/delivered-0", timeout=10).json()
        assert shown["pruned_at"] == record["pruned_at"] and shown["record"]["uid"] == "delivered-0", shown
        tokens = httpx.get(f"{srv.url}/ui/api/trajectories/delivered-0/tokens", timeout=10).json()
        assert tokens["tokens"] is None and "pruned" in tokens["reason"], tokens
        assert httpx.get(f"{srv.url}/ui/api/trajectories/ready-0/tokens", timeout=30).json()["tokens"]
    finally:
        srv.stop()


def test_long_records_a_hook_rewrote_whole_are_pruned_as_the_hook_left_them(tmp_path: Path) -> None:
    """A `transform_group` hook's records are written whole, without facts: pruning makes them from the record."""
    def tag(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{**r, "reward": 2 * r["reward"] + 1, "extra_info": {**r["extra_info"], "tagged": True}}
                for r in records]

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any] | None]]:
        config = ServerConfig(data_dir=tmp_path, group_size=GROUP)
        store = Store(config.db_path)
        await store.open()
        try:
            buffer = RolloutBuffer(config, store, {"hooked": Hooks(transform_group=tag)})
            run = await buffer.runs.get(await buffer.create_run({"task_type": "hooked"}, GROUP))
            assert run is not None
            await buffer.write_encoded(group("hooked", long=True), run)
            delivered = [orjson.loads(r.blob) for r in (await buffer.deliver(None, 0, None)).records]
            assert all(not has_facts for _, has_facts, _ in rows(config.db_path).values())  # written whole
            assert await store.call(lambda conn: prune_delivered(conn, time.time() + 1)) == GROUP
            return delivered, [await buffer.get_record(f"hooked-{i}") for i in range(GROUP)]
        finally:
            await store.close()

    delivered, pruned = asyncio.run(main())
    assert all(r["extra_info"]["tagged"] for r in delivered)  # as the hook left them
    for i, (whole, record) in enumerate(zip(delivered, pruned, strict=True)):
        assert record is not None and record["pruned_at"] > 0 and "tokens" not in record
        assert (record["reward"], record["raw_reward"]) == (whole["reward"], whole["raw_reward"])
        assert record["extra_info"]["tagged"] is True
        assert record["messages"] == [{"role": "assistant", "content": f"a{i}"}]
    assert all(size < 2000 for size, _, _ in rows(tmp_path / "buffer.sqlite").values())


def test_the_retention_loop_prunes_what_is_due_and_says_so(tmp_path: Path,
                                                           caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> dict[str, tuple[int, bool, float | None]]:
        config = ServerConfig(data_dir=tmp_path, group_size=GROUP)
        store = Store(config.db_path)
        await store.open()
        retention = Retention(store, after_s=0.0, every_s=0.05)
        try:
            buffer = RolloutBuffer(config, store, {"hooked": Hooks()})
            run = await buffer.runs.get(await buffer.create_run({"task_type": "hooked"}, GROUP))
            assert run is not None
            await buffer.write_encoded(group("delivered", long=True), run)
            assert len((await buffer.deliver(None, 0, None)).records) == GROUP
            retention.start()
            for _ in range(200):  # bounded: 10 s
                if all(p is not None for _, _, p in rows(config.db_path).values()):
                    break
                await asyncio.sleep(0.05)
            return rows(config.db_path)
        finally:
            await retention.stop()
            await store.close()

    with caplog.at_level(logging.INFO, logger="rollout_buffer.delivery.retention"):
        stored = asyncio.run(main())
    assert all(pruned_at is not None for _, _, pruned_at in stored.values()), stored
    assert f"pruned {GROUP} long records of delivered groups" in caplog.text


def test_images_go_once_no_record_holds_them_and_nothing_used_them(tmp_path: Path,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    """Records holding images are pruned like long ones (delivered, old enough), and with them their hold on their
    images: an image file goes once no record holds it whole and nothing has used it for the grace. An image a
    waiting record holds, one used again (stored again) and one used recently stay."""
    day = 24 * 3600.0
    config = ServerConfig(data_dir=tmp_path, group_size=GROUP)
    images = ImageStore(config.image_dir)
    made = {name: image_of(png(colour)) for name, colour in
            {"a": (200, 0, 0), "b": (0, 200, 0), "c": (0, 0, 200), "retaken": (9, 9, 9), "orphan": (50, 50, 50),
             "recent": (90, 90, 90)}.items()}

    def shown(name: str) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "text", "text": "Look:"}, image_part(made[name].sha256)]}]

    def pictured(instance_id: str, names: list[list[str]]) -> list[EncodedRecord]:
        out = []
        for i, held in enumerate(names):
            record = {"uid": f"{instance_id}-{i}", "instance_id": instance_id, "reward": 1.0,
                      "extra_info": {"epoch": 0, "repeat": i},
                      "messages": [m for n in held for m in shown(n)] + [{"role": "assistant", "content": "ok"}],
                      "images": [made[n].ref() for n in held]}
            out.append(EncodedRecord.of(TrajectoryRecord.model_validate(record)))
        return out

    def kept() -> set[str]:
        return {name for name, image in made.items() if images.path(image.sha256).exists()}

    async def main() -> tuple[set[str], set[str]]:
        store = Store(config.db_path)
        await store.open()
        try:
            for image in made.values():
                images.put(image)
                os.utime(images.path(image.sha256), (time.time() - 2 * day,) * 2)
            os.utime(images.path(made["recent"].sha256))  # used an hour ago (within the grace)
            buffer = RolloutBuffer(config, store, {"hooked": Hooks()})
            run = await buffer.runs.get(await buffer.create_run({"task_type": "hooked"}, GROUP))
            assert run is not None
            await buffer.write_encoded(pictured("delivered", [["a", "b"], ["a"]]), run)
            assert len((await buffer.deliver(None, 0, None)).records) == GROUP
            await buffer.write_encoded(pictured("waiting", [["b"], ["c"]]), run)  # ready, not delivered
            images.put(made["retaken"])  # a conversation took it again: its time is now
            retention = Retention(store, after_s=0.0, images=images)
            assert await retention.prune() == GROUP  # the delivered group's, short as they are
            with sqlite3.connect(config.db_path) as conn:
                holders = {uid for (uid,) in conn.execute("SELECT uid FROM record_images")}
            return kept(), holders
        finally:
            await store.close()

    with caplog.at_level(logging.INFO, logger="rollout_buffer.delivery.retention"):
        survivors, holders = asyncio.run(main())
    assert holders == {"waiting-0", "waiting-1"}
    assert survivors == {"b", "c", "retaken", "recent"}, survivors
    assert "deleted 2 image files" in caplog.text and "nothing used for 24 h" in caplog.text


def test_unused_images_are_looked_for_once_an_hour_by_retentions_clock(tmp_path: Path) -> None:
    """Finding unused images lists the whole image folder: a pass looks for them at most once an hour of its clock
    (an injected one here, moved instead of waited for), while records are pruned at every pass."""
    config = ServerConfig(data_dir=tmp_path, group_size=GROUP)
    images = ImageStore(config.image_dir)
    now = [time.time()]

    def unused(colour: tuple[int, int, int]) -> Path:
        image = image_of(png(colour))
        images.put(image)
        path = images.path(image.sha256)
        os.utime(path, (now[0] - 120.0,) * 2)  # last used two minutes before the clock's now
        return path

    async def main() -> list[bool]:
        store = Store(config.db_path)
        await store.open()
        try:
            retention = Retention(store, after_s=0.0, images=images, image_grace_s=60.0, clock=lambda: now[0])
            first = unused((1, 2, 3))
            await retention.prune()
            second = unused((4, 5, 6))
            seen = [first.exists(), second.exists()]
            now[0] += 3000.0  # within the hour: not looked for
            await retention.prune()
            seen.append(second.exists())
            now[0] += 600.0  # an hour after the last look
            await retention.prune()
            return [*seen, second.exists()]
        finally:
            await store.close()

    assert asyncio.run(main()) == [False, True, True, False]


def test_an_image_a_conversation_uses_has_its_time_renewed(tmp_path: Path) -> None:
    """Taking an image stored already, or sending one to the engine (a session worker's conversation, a restored
    session), sets its file's time to now: retention's grace counts from the last use."""
    images = ImageStore(tmp_path)
    old = time.time() - 2 * 24 * 3600.0

    async def main() -> list[bool]:
        sha = (await RunImages(images, None).take(png((1, 2, 3)))).sha256
        renewed = []
        for use in ("take", "send"):
            os.utime(images.path(sha), (old, old))
            other = RunImages(images, None)  # another conversation's run (or process)
            if use == "take":
                await other.take(png((1, 2, 3)))
            else:
                assert (await other.data_urls([sha]))[0].startswith("data:image/png;base64,")
            renewed.append(images.path(sha).stat().st_mtime > old + 3600)
        return renewed

    assert asyncio.run(main()) == [True, True]
