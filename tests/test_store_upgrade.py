"""A store written by release 0.1.0 opens in today's format and carries on where it stood: every group in the
state it had on every stream, leases still held and ackable, trainer versions kept, the one-day session tables
gone. A store from a newer release is refused with what to do.

`fixtures/store/release-0.1.0.sqlite` was written by release 0.1.0's own code (see the README beside it).
"""

from __future__ import annotations

import asyncio
import shutil
import sqlite3
from pathlib import Path

import httpx
import orjson
import pytest
from servers import free_port, running

from rollout_buffer.delivery import schema
from rollout_buffer.delivery.store import Store, StoreError

RELEASE_0_1 = Path(__file__).parent / "fixtures" / "store" / "release-0.1.0.sqlite"
RUN = "run-20261124-225501-a99aeb"
EARLIER_RUN = "run-20261124-225501-855fc2"
LEASED_BATCH = "2ec35990268d40afa7407fb444143937"  # g-leased, leased for an hour
ROLES_BATCH = "7df6856898664aef80539e53d66fb223"  # g-roles on the default stream, leased for a minute


def _data_dir(tmp_path: Path) -> Path:
    data = tmp_path / "data"
    data.mkdir()
    shutil.copy(RELEASE_0_1, data / "buffer.sqlite")
    return data


def test_a_release_0_1_store_upgrades_and_delivers_where_it_stood(tmp_path: Path) -> None:
    data = _data_dir(tmp_path)
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(data), "--group-size", "2"]
    with running(args, "/healthz", port, tmp_path / "buffer.log") as srv:
        status = httpx.get(f"{srv.url}/status", timeout=10).json()
        assert status["run"]["run_id"] == RUN
        # g-acked and g-consumed delivered; g-leased and g-roles leased; g-failed dropped at completion and
        # g-stale as stale; g-ready ready; g-open and g-stale's regenerated part open.
        assert status["groups"] == {"delivered": 2, "leased": 2, "filtered": 2, "ready": 1, "open": 2}
        assert status["filtered"] == {"failed_trajectory": 1, "stale": 1}
        assert status["earlier_runs"] == {EARLIER_RUN: 1}
        assert status["roles"]["planner"]["groups"] == {"delivered": 1}
        assert status["roles"]["planner"]["trainer_version"] == 3
        assert status["roles"]["actor"]["groups"] == {"ready": 1} and status["roles"]["actor"]["records"] == 2
        assert status["control"]["trainer_version"] == 3 and status["control"]["base_version"] == 3

        # The hour-long lease of release 0.1.0 still holds: its batch acks. The minute-long one ran out long
        # ago: g-roles comes again (whole, on the default stream) with g-ready.
        acked = httpx.post(f"{srv.url}/ack", json={"batch_id": LEASED_BATCH}, timeout=10).json()
        assert acked["acked_groups"] == 1
        got = httpx.post(f"{srv.url}/get_rollout_data", json={"run_id": RUN, "current_version": 3}, timeout=10).json()
        assert sorted(r["uid"] for r in got["data"]["data"]) == ["m1-a", "m1-p", "m2-a", "m2-p", "r1", "r2"]
        assert got["data"]["meta_info"]["redelivered_groups"] == 1
        # The actor's stream has its records of g-roles; the planner's took them already.
        actor = httpx.post(f"{srv.url}/get_rollout_data", json={"run_id": RUN, "agent_id": "actor"}, timeout=10)
        assert sorted(r["uid"] for r in actor.json()["data"]["data"]) == ["m1-a", "m2-a"]
        planner = httpx.post(f"{srv.url}/get_rollout_data", json={"run_id": RUN, "agent_id": "planner"}, timeout=10)
        assert planner.json()["data"]["data"] == []
        # A batch of the default stream is not the planner's to ack.
        wrong = httpx.post(f"{srv.url}/ack", json={"batch_id": ROLES_BATCH, "agent_id": "planner"}, timeout=10)
        assert wrong.status_code == 409 and "default stream" in wrong.json()["message"]
        # The earlier run's ready group is still fetchable by naming it.
        earlier = httpx.post(f"{srv.url}/get_rollout_data", json={"run_id": EARLIER_RUN}, timeout=10).json()
        assert sorted(r["uid"] for r in earlier["data"]["data"]) == ["old-a", "old-b"]
        # Versions go on from where they stood.
        version = httpx.post(f"{srv.url}/trainer_version", json={"current_version": 4}, timeout=10).json()
        assert (version["base_version"], version["trainer_version"]) == (3, 4)
        evals = httpx.post(f"{srv.url}/eval_results", json={"version": 3}, timeout=10).json()
        assert evals["finished"] and list(evals["results"]) == ["math-eval"]
    with sqlite3.connect(data / "buffer.sqlite") as conn:
        assert conn.execute("PRAGMA user_version").fetchone()[0] == schema.VERSION
        tables = {name for (name,) in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
        assert not tables & {"agent_sessions", "agent_session_turns", "role_versions"}
        assert "batch_id" not in {row[1] for row in conn.execute("PRAGMA table_info(groups)")}


def test_every_migration_leaves_the_schema_a_fresh_store_has(tmp_path: Path) -> None:
    """Upgrading is not a second way to build the store: the upgraded schema is the fresh one."""
    data = _data_dir(tmp_path)
    fresh = tmp_path / "fresh.sqlite"

    def schema_of(path: Path) -> dict[str, object]:
        conn = schema.connect(path)
        try:
            # Columns as SQLite reads them (an ALTERed table's text differs from a created one's in spaces).
            return {name: (kind, conn.execute(f"PRAGMA table_xinfo({name})").fetchall() if kind == "table" else sql)
                    for kind, name, sql in conn.execute("SELECT type, name, sql FROM sqlite_master ORDER BY name")}
        finally:
            conn.close()

    assert schema_of(data / "buffer.sqlite") == schema_of(fresh)


def test_a_store_from_a_newer_release_is_refused_with_what_to_do(tmp_path: Path) -> None:
    data = _data_dir(tmp_path)
    with sqlite3.connect(data / "buffer.sqlite") as conn:
        conn.execute(f"PRAGMA user_version={schema.VERSION + 1}")

    async def main() -> None:
        await Store(data / "buffer.sqlite").open()

    with pytest.raises(StoreError, match="upgrade rollout-buffer to open it"):
        asyncio.run(main())
    with sqlite3.connect(data / "buffer.sqlite") as conn:  # nothing was changed
        assert conn.execute("PRAGMA user_version").fetchone()[0] == schema.VERSION + 1
        assert conn.execute("SELECT count(*) FROM agent_sessions").fetchone()[0] == 1


def test_export_asks_for_an_upgrade_of_an_older_store(tmp_path: Path) -> None:
    from rollout_buffer.tools.export import ExportError, open_readonly

    data = _data_dir(tmp_path)
    with pytest.raises(ExportError, match="rollout-buffer serve --data-dir"):
        open_readonly(data)
    conn = schema.connect(data / "buffer.sqlite")
    conn.close()
    exported = open_readonly(data)
    try:
        rows = exported.execute("SELECT record FROM trajectories WHERE uid='a1'").fetchall()
        assert orjson.loads(rows[0][0])["instance_id"] == "g-acked"
    finally:
        exported.close()


def test_a_store_from_before_image_retention_knows_which_images_its_records_hold(tmp_path: Path) -> None:
    """Records stored before `record_images` existed get their rows, so retention never deletes their images."""
    path = tmp_path / "buffer.sqlite"
    conn = sqlite3.connect(path, isolation_level=None)
    for migration in schema.MIGRATIONS[:-1]:
        migration(conn)
    conn.execute(f"PRAGMA user_version={schema.VERSION - 1}")
    held, pruned = "a" * 64, "b" * 64
    for uid, sha, pruned_at in (("kept", held, None), ("pruned", pruned, 1.0), ("text", None, None)):
        content = [{"type": "image", "image": f"sha256:{sha}"}] if sha else "no image here"
        record = {"uid": uid, "messages": [{"role": "user", "content": content}],
                  "images": [{"sha256": sha, "media_type": "image/png", "width": 4, "height": 4}] if sha else None}
        conn.execute("INSERT INTO trajectories(uid, run_id, instance_id, epoch, part, status, episode, created_at, "
                     "record, pruned_at) VALUES (?, 'r', 'i', 0, 0, 'completed', ?, 0, ?, ?)",
                     (uid, uid, orjson.dumps(record), pruned_at))
    conn.close()
    upgraded = schema.connect(path)
    try:
        assert upgraded.execute("SELECT uid, sha256 FROM record_images").fetchall() == [("kept", held)]
    finally:
        upgraded.close()
