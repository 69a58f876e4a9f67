"""Open harness sessions' files: frames read back as written, and a torn or corrupted tail cut off cleanly."""

from __future__ import annotations

from pathlib import Path

import pytest

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


def test_frames_of_interleaved_sessions_all_land(tmp_path: Path) -> None:
    files = SessionFiles(tmp_path)
    for k in range(5):
        files.create(f"s-{k}", b"first")
    for turn in range(3):
        for k in range(5):
            files.append(f"s-{k}", b"turn %d" % turn)
    assert files.load() == [(f"s-{k}", [b"first", b"turn 0", b"turn 1", b"turn 2"]) for k in range(5)]


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
