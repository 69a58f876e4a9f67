"""The images records name, stored once each under the data dir by content hash: `images/<first two hex digits of
the SHA-256>/<the rest>`, written under another name and renamed into place (never a half-written file), the
owner's alone (0600). An image seen again (the screenshot a session resends every turn) is not written again: its
file's time is set to now instead, so a file's time says when a conversation last used it.

Retention (`delivery.retention`) deletes the files no stored record still holds whole and nothing has used for a
while. Writers (the buffer and its session workers) hold a shared lock on `images/.lock` while they check for a
file and write or touch it; deleting holds it exclusively and checks each file's time again under it, so an image
taken again while retention runs is never deleted under its taker.

Blocking file I/O: callers on the event loop run it in a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import fcntl
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rollout_buffer.media.images import Image, image_of

_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_INCOMING = ".incoming-"


class ImageStore:
    """Content-addressed image files under `root`."""

    def __init__(self, root: Path):
        self.root = root

    def path(self, sha256: str) -> Path:
        """Where the image `sha256` is (or would be) kept; ValueError for a name that is no SHA-256."""
        if not _SHA256.match(sha256):
            raise ValueError(f"{sha256!r} is not a SHA-256 in hex")
        return self.root / sha256[:2] / sha256[2:]

    def put(self, image: Image) -> bool:
        """Keep `image` (an image kept already has its time set to now); False when it was kept already."""
        path = self.path(image.sha256)
        with self._locked(fcntl.LOCK_SH):
            try:
                os.utime(path)
                return False
            except FileNotFoundError:
                pass
            path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=_INCOMING)
            try:
                with os.fdopen(fd, "wb") as out:
                    out.write(image.data)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        return True

    def touch(self, shas: Iterable[str]) -> None:
        """Set the time of the kept images among `shas` to now: a conversation still uses them."""
        with self._locked(fcntl.LOCK_SH):
            for sha in shas:
                try:
                    os.utime(self.path(sha))
                except FileNotFoundError:
                    pass

    def get(self, sha256: str) -> Image | None:
        """The image `sha256`, None when it is not kept (ValueError for a name that is no SHA-256)."""
        try:
            data = self.path(sha256).read_bytes()
        except FileNotFoundError:
            return None
        return image_of(data, max_bytes=len(data))

    def unused_since(self, before: float) -> list[str]:
        """The kept images whose time is before `before` (a time); a write cut short before then is removed."""
        out = []
        for path in self._files():
            try:
                at = path.stat().st_mtime
            except FileNotFoundError:
                continue
            if at >= before:
                continue
            if path.name.startswith(_INCOMING):
                path.unlink(missing_ok=True)
            elif _SHA256.match(path.parent.name + path.name):
                out.append(path.parent.name + path.name)
        return out

    def remove(self, shas: Iterable[str], before: float) -> tuple[int, int]:
        """Delete the images among `shas` whose time is still before `before`; how many, and their bytes."""
        count = size = 0
        with self._locked(fcntl.LOCK_EX):
            for sha in shas:
                path = self.path(sha)
                try:
                    st = path.stat()
                except FileNotFoundError:
                    continue
                if st.st_mtime < before:
                    path.unlink(missing_ok=True)
                    count, size = count + 1, size + st.st_size
        return count, size

    def _files(self) -> Iterator[Path]:
        if not self.root.is_dir():
            return
        for folder in self.root.iterdir():
            if len(folder.name) == 2 and folder.is_dir():
                yield from folder.iterdir()

    @contextmanager
    def _locked(self, kind: int) -> Iterator[None]:
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.root / ".lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, kind)
            yield
        finally:
            os.close(fd)  # closing releases the lock
