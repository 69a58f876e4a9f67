"""The rollout input file: JSONL, one task per line, validated up front and streamed during the run."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

# A required field is a name, or a tuple of names of which one must be present.
RequiredField = str | tuple[str, ...]


class InputFileError(ValueError):
    """The input file is missing, unreadable or has a bad line; the message names the file and line."""


@dataclass(frozen=True)
class InputSummary:
    """What validation learned about an input file."""

    path: Path
    num_items: int


def existing_path(raw: str, field: str = "input_file") -> Path:
    """A client-supplied path (links resolved) that exists; InputFileError naming `field` otherwise. The server's
    policy has judged the path before (`Policy.readable`: outside its roots, existing or not, is refused)."""
    path = Path(raw).expanduser()
    try:
        return path.resolve(strict=True)
    except FileNotFoundError:
        raise InputFileError(f"{field}: {raw} does not exist") from None
    except (OSError, RuntimeError) as e:  # RuntimeError: a symlink loop
        raise InputFileError(f"{field}: {raw} cannot be opened: {e}") from None


def resolve_input_path(raw: str, field: str = "input_file") -> Path:
    """The input file: it exists and is a regular file."""
    resolved = existing_path(raw, field)
    if not resolved.is_file():
        raise InputFileError(f"{field}: {raw} is not a regular file")
    return resolved


def iter_json_objects(path: Path, label: str = "input_file") -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, object) for every non-blank line of a JSONL file.

    A line that is not a JSON object raises InputFileError naming `label`, the file and the line.
    """
    with path.open("rb") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                item = orjson.loads(line)
            except orjson.JSONDecodeError as e:
                raise InputFileError(f"{label}: {path} line {lineno}: not valid JSON ({e})") from None
            if not isinstance(item, dict):
                raise InputFileError(f"{label}: {path} line {lineno}: expected a JSON object")
            yield lineno, item


def iter_items(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield (line number, item) for every non-blank line; `instance_id` defaults to the item's position among
    them, as the runner numbers tasks (`LineIndex`), so blank lines shift no id."""
    for position, (lineno, item) in enumerate(iter_json_objects(path)):
        if item.get("instance_id") is None:
            item["instance_id"] = str(position)
        else:
            item["instance_id"] = str(item["instance_id"])
        yield lineno, item


def validate_file(path: Path, required: Sequence[RequiredField] = ()) -> InputSummary:
    """Read the whole file once: every line a JSON object with the required fields, ids unique."""
    seen: dict[str, int] = {}
    count = 0
    try:
        for lineno, item in iter_items(path):
            for field in required:
                names = (field,) if isinstance(field, str) else field
                if not any(item.get(n) is not None for n in names):
                    wanted = " or ".join(repr(n) for n in names)
                    raise InputFileError(f"input_file: {path} line {lineno}: missing required field {wanted}")
            iid = item["instance_id"]
            if iid in seen:
                raise InputFileError(
                    f"input_file: {path} line {lineno}: instance_id {iid!r} repeats line {seen[iid]}"
                )
            seen[iid] = lineno
            count += 1
    except OSError as e:
        raise InputFileError(f"input_file: {path} cannot be read: {e.strerror or e}") from None
    if count == 0:
        raise InputFileError(f"input_file: {path} has no tasks")
    return InputSummary(path, count)


class LineIndex:
    """Byte offsets of the input file's task lines, so epochs can be shuffled without holding items."""

    def __init__(self, path: Path):
        self.path = path
        self.offsets: list[int] = []
        with path.open("rb") as f:
            pos = 0
            for line in f:
                if line.strip():
                    self.offsets.append(pos)
                pos += len(line)
        self._fh = path.open("rb")
        self._positions: dict[str, int] | None = None

    def find(self, instance_id: str) -> dict[str, Any] | None:
        """The task with `instance_id`, or None (the file is indexed by id on first use)."""
        if self._positions is None:
            self._positions = {}
            for i in range(len(self.offsets)):
                self._positions.setdefault(self.read(i)["instance_id"], i)
        at = self._positions.get(instance_id)
        return None if at is None else self.read(at)

    def read(self, i: int) -> dict[str, Any]:
        """The i-th task, with `instance_id` defaulting to its position."""
        self._fh.seek(self.offsets[i])
        item = orjson.loads(self._fh.readline())
        if not isinstance(item, dict):
            raise InputFileError(f"input_file: {self.path} task {i}: expected a JSON object")
        item["instance_id"] = str(item["instance_id"]) if item.get("instance_id") is not None else str(i)
        return item

    def close(self) -> None:
        self._fh.close()


def write_default_input(data_dir: Path, task_type: str, rows: list[dict[str, Any]]) -> Path:
    """A generator's own dataset (an environment's tasks) as the run's input file under `data_dir/inputs`.

    Named by its content, so the same tasks listed again are the same file and a resumed run finds it.
    """
    body = b"".join(orjson.dumps(row) + b"\n" for row in rows)
    folder = data_dir / "inputs"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{task_type}-{hashlib.sha256(body).hexdigest()[:16]}.jsonl"
    if not path.is_file():  # written aside and renamed: two runs listing the same tasks at once both see it whole
        partial = path.with_name(f"{path.name}.{uuid.uuid4().hex}.partial")
        partial.write_bytes(body)
        partial.replace(path)
    return path
