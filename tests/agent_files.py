"""The agents the tests run: the example agents shipped with the generators, and the test's own stdlib agent in a
folder anyone may read."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from readable import readable_copies

REPO = Path(__file__).resolve().parents[1]
AGENTS = REPO / "generators" / "data" / "agents"
STDLIB_AGENT = REPO / "tests" / "agents" / "stdlib_agent.py"


@pytest.fixture(scope="module")
def stdlib_agent() -> Iterator[Path]:
    """The test agent in a folder anyone may read: run as `nobody`, it cannot reach a checkout under a private
    folder (a `mktemp -d` clone, /root) or pytest's own temporary folders (mode 0700)."""
    with readable_copies([STDLIB_AGENT, STDLIB_AGENT.with_name("early_exit.sh")], "rb-test-agent-") as folder:
        yield folder / STDLIB_AGENT.name
