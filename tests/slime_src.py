"""slime's own sources for the tests that check the adapter against them: `SLIME_SRC`, a slime checkout.

`.ci/run` points it at `../shared/slime` (a pinned copy); an explicit `SLIME_SRC` overrides. slime's sources
import with torch (the CPU build) and, for its data source, Pillow: the `conformance` extra. With `SLIME_SRC`
set and one of them missing those tests fail instead of skipping, so a broken install cannot pass as green.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
import types
from collections.abc import Iterator

import pytest

SLIME_SRC = os.environ.get("SLIME_SRC")
needs_slime_src = pytest.mark.skipif(not SLIME_SRC, reason="SLIME_SRC is not set (a checkout of THUDM/slime)")


def require(module: str) -> None:
    """Fail (not skip) without `module` (torch or PIL): SLIME_SRC is set, so the conformance extra is meant."""
    if importlib.util.find_spec(module) is None:
        pytest.fail(f"SLIME_SRC is set but {module} is not installed: pip install -e '.[test,conformance]'")


@contextlib.contextmanager
def slime_on_path() -> Iterator[None]:
    """SLIME_SRC on sys.path (and a bare `wandb` when it is not installed); slime leaves both afterwards."""
    assert SLIME_SRC is not None
    require("torch")  # every slime module imports it (the CPU build is enough)
    saved_path = list(sys.path)
    sys.path.insert(0, SLIME_SRC)
    # Nested uses (a test's fixture inside the module's) find the outer stub in sys.modules and leave it.
    stub_wandb = "wandb" not in sys.modules and importlib.util.find_spec("wandb") is None
    if stub_wandb:
        sys.modules["wandb"] = types.ModuleType("wandb")  # slime's client imports it; nothing here logs to it
    try:
        yield
    finally:
        sys.path[:] = saved_path
        for name in [m for m in sys.modules if m.split(".")[0] in ("slime", "slime_plugins")]:
            del sys.modules[name]
        if stub_wandb:
            del sys.modules["wandb"]
