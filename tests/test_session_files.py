"""Open harness sessions' files: frames read back as written (with at most `max_open` files open), a torn or
corrupted tail cut off cleanly, and the sessions an older version kept in the store moved to files unchanged."""

from __future__ import annotations

import asyncio
import os
import sqlite3
from pathlib import Path

import orjson
import pytest

from rollout_buffer.delivery.store import Store, StoredSession
from rollout_buffer.proxy.journal import Journal, load_sessions
from rollout_buffer.proxy.session_files import SessionFiles


def test_frames_read_back_in_order_and_a_removed_session_is_gone(tmp_path: Path) -> None:
    files = SessionFiles(tmp_path / "sessions")
    assert files.load() == []  # no folder yet
    files.create("s-1", b"first")
    files.append("s-1", b"")
    files.append("s-1", b"\x00" * 70_000)
    files.create("s-0", b"other")
    assert files.load() == [("s-0", [b"other"]), ("s-1", [b"first", b"", b"\x00" * 70_000])]
    files.create("s-1", b"again")  # a new file replaces an old one of the same id
    assert files.has("s-1") and not files.has("s-2")
    files.remove("s-1")
    files.remove("s-1")  # twice: no error
    assert files.load() == [("s-0", [b"other"])] and not files.has("s-1")
    with pytest.raises(FileNotFoundError):
        files.append("s-1", b"late")
    for bad in ("", "../x", ".hidden"):
        with pytest.raises(ValueError):
            files.create(bad, b"x")


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_at_most_max_open_files_stay_open_and_every_frame_lands(tmp_path: Path) -> None:
    before = _open_fds()
    files = SessionFiles(tmp_path, max_open=2)
    for k in range(5):
        files.create(f"s-{k}", b"first")
    for turn in range(3):  # each session written to again after others pushed its file out
        for k in range(5):
            files.append(f"s-{k}", b"turn %d" % turn)
            assert _open_fds() <= before + 2
    assert files.load() == [(f"s-{k}", [b"first", b"turn 0", b"turn 1", b"turn 2"]) for k in range(5)]
    files.remove("s-4")  # its file was open: closed with it
    files.close()
    assert _open_fds() == before
    files.append("s-0", b"after close")  # opened again
    assert files.load()[0] == ("s-0", [b"first", b"turn 0", b"turn 1", b"turn 2", b"after close"])
    files.close()


@pytest.mark.parametrize("damage", ["cut", "flipped"])
def test_a_torn_or_corrupted_last_frame_is_left_out_and_the_frames_before_it_kept(tmp_path: Path,
                                                                                    damage: str) -> None:
    files = SessionFiles(tmp_path)
    files.create("s", b"session")
    files.append("s", b"turn 0")
    files.append("s", b"turn 1 that a crash cut")
    path = tmp_path / "s.session"
    data = path.read_bytes()
    path.write_bytes(data[:-5] if damage == "cut" else data[:-1] + bytes([data[-1] ^ 1]))
    assert files.load() == [("s", [b"session", b"turn 0"])]
    path.write_bytes(data[:3])  # not even a whole frame head
    assert files.load() == [("s", [])]


def test_sessions_an_older_version_stored_in_sqlite_move_to_files_unchanged(tmp_path: Path) -> None:
    turns = [(0, b'{"route": "new"}', b"\x01\x00\x00\x00", b"\x00", b"\x00" * 8),
             (2, b'{"route": "continue"}', b"\x02\x00\x00\x00\x03\x00\x00\x00", b"\x01\x01", b"\x11" * 16)]
    state = {"api_key": "k", "repeat": 0, "public_url": "http://x", "metadata": {}, "created_at": 1.0}

    async def main() -> list[StoredSession]:
        store = Store(tmp_path / "buffer.sqlite")
        await store.open()
        try:
            await store.call(lambda c: _legacy_rows(c, state, turns))
            legacy = await store.stored_sessions()
            for s in legacy:
                Journal.of_stored(SessionFiles(tmp_path / "sessions"), s)
                store.drop_session(s.session_id)
            assert await store.stored_sessions() == []
            return legacy
        finally:
            await store.close()

    legacy = asyncio.run(main())
    moved = load_sessions(SessionFiles(tmp_path / "sessions"))
    assert len(legacy) == 1 and moved == legacy
    assert moved[0].turns == turns and orjson.loads(moved[0].state) == state


def _legacy_rows(conn: sqlite3.Connection, state: dict[str, object], turns: list[tuple[int, bytes, bytes, bytes, bytes]]
                 ) -> None:
    conn.execute("INSERT INTO agent_sessions(session_id, run_id, instance_id, uid, state, created_at) "
                 "VALUES ('s-old', 'run', 'inst', 'run:inst:s-old', ?, 1.0)", (orjson.dumps(state),))
    conn.executemany("INSERT INTO agent_session_turns(session_id, seq, meta, tokens, loss_mask, log_probs) "
                     "VALUES ('s-old', ?, ?, ?, ?, ?)", turns)
