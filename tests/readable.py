"""Copies of test files that other users can read: the processes the buffer (as root) runs as `nobody`."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path


@contextlib.contextmanager
def readable_copies(files: Iterable[Path], prefix: str) -> Iterator[Path]:
    """A folder in the temporary directory holding copies of `files` that anyone may read and run (the checkout, or
    pytest's own temporary folders, may be closed to other users); removed afterwards."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        folder.chmod(0o755)
        for file in files:
            shutil.copy(file, folder / file.name)
            (folder / file.name).chmod(0o755)
        yield folder
    finally:
        shutil.rmtree(folder)
