"""README's first commands on a fresh venv, as a new user runs them: the plain install runs the demo; the agent
demo names the extra it needs, in one line, before starting anything; with the extra it trains the agent.

A system test: a venv of its own and `pip install -e` of this checkout (from pip's cache after the suite's own
install, about a minute and a half here), then the CLI as a user runs it.
"""

from __future__ import annotations

import re
import subprocess
import venv
from pathlib import Path

import pytest
from demo_cli import table_of

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A venv holding the plain install of this checkout; its bin folder."""
    home = tmp_path_factory.mktemp("fresh-venv")
    venv.EnvBuilder(with_pip=True).create(home)
    bin_dir = home / "bin"
    install(bin_dir, str(ROOT))
    return bin_dir


def install(bin_dir: Path, target: str) -> None:
    done = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "-e", target], capture_output=True,
                          text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]


def rollout_buffer(bin_dir: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(bin_dir / "rollout-buffer"), *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def test_the_readme_names_these_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"^pip install -e \. && rollout-buffer demo ", readme, re.M), "the main job, as tested here"


def test_the_plain_install_runs_the_demo(fresh: Path, tmp_path: Path) -> None:
    assert rollout_buffer(fresh, "--version", cwd=tmp_path).stdout.startswith("rollout-buffer ")
    done = rollout_buffer(fresh, "demo", "--num-repeat", "2", "--latency-ms", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = table_of(done.stdout)
    assert rows["groups delivered"] == rows["groups planned"] and rows["failed trajectories"] == "0", rows


def test_the_agent_demo_names_its_extra_then_runs_with_it(fresh: Path, tmp_path: Path) -> None:
    without = rollout_buffer(fresh, "demo", "--task", "agent", cwd=tmp_path)
    assert without.returncode == 2 and without.stderr.count("\n") == 1, without.stderr
    assert "pip install -e '.[agents]'" in without.stderr and "Traceback" not in without.stderr
    assert not (tmp_path / "rollout_data").exists() and without.stdout == "", "nothing started"
    install(fresh, f"{ROOT}[agents]")
    done = rollout_buffer(fresh, "demo", "--task", "agent", "--num-repeat", "2", "--latency-ms", "1", cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert table_of(done.stdout)["failed trajectories"] == "0"
