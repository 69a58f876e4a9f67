"""Open harness sessions on disk: one append-only file per session, in the data dir's `sessions/` folder.

A session's journal (`proxy.journal`) is written here, not in the SQLite store: a turn's row is one frame appended
to the session's file (`open` with `O_APPEND`, one `write(2)`, `close`), done on the event loop before the turn
is answered. The same rows in the store cost a hand-off to the store thread and back, a transaction, and the
rows' deletion when the session closed: together ~8% of the buffer's CPU per proxied turn (`bench.proxy_pair`).
A frame in the page cache when `kill -9` comes is in the file after it (as a committed SQLite transaction with
`synchronous=NORMAL` is), and neither is proof against a power cut. A data dir on a slow network filesystem
would stall the event loop on every turn; SQLite's WAL mode, which the store uses, does not work on one either.

Frames: a little-endian u32 length and u32 CRC-32 of the body, then the body. A torn last frame (a crash in the
middle of a write, or a full disk) fails its CRC or is short, and reading stops before it.
"""

from __future__ import annotations

import logging
import os
import struct
import zlib
from pathlib import Path

log = logging.getLogger(__name__)

_HEAD = struct.Struct("<II")
_SUFFIX = ".session"


class SessionFiles:
    """The folder of open sessions' files (or of other append-only files of frames: a session worker's outbox,
    `proxy.outbox`, names its files with its own `suffix`). Every call raises OSError when the disk refuses it."""

    def __init__(self, folder: Path, suffix: str = _SUFFIX):
        self.folder = folder
        self.suffix = suffix

    def _path(self, session_id: str) -> Path:
        if not session_id or "/" in session_id or session_id.startswith("."):
            raise ValueError(f"not a session id: {session_id!r}")
        return self.folder / f"{session_id}{self.suffix}"

    def create(self, session_id: str, body: bytes) -> None:
        """Start the session's file with its first frame (an existing file of that id is replaced)."""
        path = self._path(session_id)
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_TRUNC
        try:
            fd = os.open(path, flags, 0o600)
        except FileNotFoundError:  # the folder's first file
            self.folder.mkdir(parents=True, exist_ok=True)
            fd = os.open(path, flags, 0o600)
        self._write(session_id, fd, body)

    def append(self, session_id: str, body: bytes) -> None:
        """Add a frame to the session's file (FileNotFoundError when it has none)."""
        self._write(session_id, os.open(self._path(session_id), os.O_WRONLY | os.O_APPEND), body)

    @staticmethod
    def _write(session_id: str, fd: int, body: bytes) -> None:
        """Write one frame to `fd` and close it."""
        frame = _HEAD.pack(len(body), zlib.crc32(body)) + body
        try:
            written = os.write(fd, frame)
            if written != len(frame):  # a full disk mid-frame: take the part back, so later frames still read
                size = os.fstat(fd).st_size
                os.ftruncate(fd, size - written)
                raise OSError(f"session {session_id}: only {written} of {len(frame)} bytes written")
        finally:
            os.close(fd)

    def has(self, session_id: str) -> bool:
        """True when the session has a file."""
        return self._path(session_id).exists()

    def remove(self, session_id: str) -> None:
        """Forget the session (no error when it has no file)."""
        self._path(session_id).unlink(missing_ok=True)

    def load(self) -> list[tuple[str, list[bytes]]]:
        """Every session's id and frames, by id."""
        if not self.folder.is_dir():
            return []
        paths = sorted(self.folder.glob(f"*{self.suffix}"))
        return [(p.name.removesuffix(self.suffix), self._frames(p)) for p in paths]

    @staticmethod
    def _frames(path: Path) -> list[bytes]:
        data = path.read_bytes()
        frames, at = [], 0
        while at + _HEAD.size <= len(data):
            length, crc = _HEAD.unpack_from(data, at)
            body = data[at + _HEAD.size:at + _HEAD.size + length]
            if len(body) != length or zlib.crc32(body) != crc:
                log.warning("%s: a torn frame at byte %d (of %d) and what follows it are ignored", path, at, len(data))
                break
            frames.append(body)
            at += _HEAD.size + length
        return frames
