"""The images records name, stored once each under the data dir by content hash: `images/<first two hex digits of
the SHA-256>/<the rest>`, written under another name and renamed into place (never a half-written file), the
owner's alone (0600). An image seen again (the screenshot a session resends every turn) is not written again.

Blocking file I/O: callers on the event loop run it in a thread (`asyncio.to_thread`).
"""

from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

from rollout_buffer.media.images import Image, image_of

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


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
        """Keep `image`; False when it was kept already."""
        path = self.path(image.sha256)
        if path.exists():
            return False
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".incoming-")
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

    def get(self, sha256: str) -> Image | None:
        """The image `sha256`, None when it is not kept (ValueError for a name that is no SHA-256)."""
        try:
            data = self.path(sha256).read_bytes()
        except FileNotFoundError:
            return None
        return image_of(data, max_bytes=len(data))
