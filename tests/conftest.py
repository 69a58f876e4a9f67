"""Shared fixtures: the real Qwen3 tokenizer and real server subprocesses on loopback."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# The environments' venvs (made once per requirement list) in a folder every user may read, set before any server
# starts: the servers the buffer runs as `nobody` use the same venvs as the rest of the suite.
os.environ.setdefault("ROLLOUT_BUFFER_ENV_VENVS", os.path.join(tempfile.gettempdir(), "rollout-buffer-env-venvs"))

from servers import Server, free_port, running

from rollout_buffer.tokens.tokenizer import bundled_tokenizer_path

# Each module's tier as a marker (tiers); the suite leaves no process and no scratch folder behind (leftovers);
# fixtures several modules share, in one place.
pytest_plugins = ["tiers", "leftovers", "agent_files", "environment_venvs", "ray_cluster"]

SEARCH_CORPUS = Path(str(resources.files("generators") / "data" / "search_corpus.jsonl"))


@pytest.fixture(scope="session")
def qwen_tokenizer_path() -> str:
    return bundled_tokenizer_path()


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


@pytest.fixture(scope="module")
def retriever(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """A `rollout-buffer retriever` subprocess over the bundled search corpus, its index in a temporary dir."""
    tmp = tmp_path_factory.mktemp("retriever")
    port = free_port()
    args = ["retriever", "--corpus", str(SEARCH_CORPUS), "--port", str(port), "--index-dir", str(tmp / "index")]
    with running(args, "/health", port, tmp / "retriever.log") as srv:
        yield srv
