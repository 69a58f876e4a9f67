"""The environment packages the tests run, each in a venv of its own: OpenEnv's and verifiers' example
environments, and the interpreters of their venvs."""

from __future__ import annotations

from pathlib import Path

import pytest

from rollout_buffer.environments.venvs import venv_python

OPENENV = "openenv==0.10.0"
OPENENV_ENVS = Path(__file__).parent / "data" / "openenv_envs"
VERIFIERS = "verifiers==0.4.0"
VERIFIERS_ENVS = Path(__file__).parent / "data" / "verifiers_envs"


@pytest.fixture(scope="module")
def openenv_python() -> str:
    return venv_python([OPENENV])


@pytest.fixture(scope="module")
def verifiers_python() -> str:
    """The interpreter of a venv holding verifiers and uv (its harness programs run with uv)."""
    return venv_python([VERIFIERS, "uv"])
