"""Generator discovery: built-in package, installed entry points, --generator-path; duplicates refused."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
from servers import free_port, running

from rollout_buffer.generation.hooks import HOOKS
from rollout_buffer.generation.plugins import PluginError, discover

PLUGINS = Path(__file__).parent / "plugins"


def test_builtin_package_and_path() -> None:
    found = discover([PLUGINS / "two_turn.py", PLUGINS / "slime_style.py"], include_entry_points=False)
    assert found["math"].origin.endswith("generators/math.py")
    assert found["math"].native and not found["slime_style"].native
    assert found["two_turn"].origin == str(PLUGINS / "two_turn.py")


def test_a_generator_says_when_its_runs_stay_in_the_buffer_process(tmp_path: Path) -> None:
    """`RUNS_IN_BUFFER = True`, or per run a `runs_in_buffer(payload)` hook (which wins): the runner then uses
    the local executor whatever `--executor` is."""
    (tmp_path / "pinned.py").write_text("TASK_TYPE = 'pinned'\nRUNS_IN_BUFFER = True\n"
                                        "async def run_rollout(item, ctx):\n    return []\n")
    (tmp_path / "per_run.py").write_text("TASK_TYPE = 'per_run'\nRUNS_IN_BUFFER = True\n"
                                         "def runs_in_buffer(payload):\n    return payload.get('here', False)\n"
                                         "async def run_rollout(item, ctx):\n    return []\n")
    found = discover([tmp_path / "pinned.py", tmp_path / "per_run.py"], include_entry_points=False)
    assert found["pinned"].needs_buffer_process({})
    assert not found["per_run"].needs_buffer_process({}) and found["per_run"].needs_buffer_process({"here": True})
    assert not found["math"].needs_buffer_process({})
    agent = found["agent"]  # hosting harness sessions stays; running agents goes to the executor
    assert agent.needs_buffer_process({"task_type": "agent"})
    assert not agent.needs_buffer_process({"task_type": "agent", "agent_command": ["./run.sh"]})


@pytest.mark.parametrize(("source", "reason"), [
    ("async def is_valid_group(group):\n    return True\n", "is_valid_group must be a plain def"),
    ("def default_input(payload, runs_here):\n    return []\n", "default_input must be async def"),
    ("def check_payload(payload):\n    pass\n", "check_payload must take (payload, policy)"),
    ("transform_group = 3\n", "transform_group must be a function"),
    ("REQUIRED_FIELDS = 'prompt'\n", "REQUIRED_FIELDS must be tuple or list, not str"),
    ("RUNS_IN_BUFFER = 'yes'\n", "RUNS_IN_BUFFER must be bool, not str"),
], ids=["async hook called plainly", "plain hook awaited", "wrong arguments", "not a function", "fields a string",
        "flag a string"])
def test_a_hook_the_buffer_could_not_call_is_refused_at_discovery(tmp_path: Path, source: str, reason: str) -> None:
    """Every hook and constant is declared in `generation/hooks.py`; a module defining one the buffer could not
    call refuses to load, naming it, instead of failing a run later."""
    module = tmp_path / "odd.py"
    module.write_text("TASK_TYPE = 'odd'\nasync def run_rollout(item, ctx):\n    return []\n" + source)
    with pytest.raises(PluginError, match=re.escape(f"odd.py: TASK_TYPE 'odd': {reason}")):
        discover([module], include_entry_points=False)


def test_the_service_asks_only_for_declared_hooks() -> None:
    found = discover(include_entry_points=False)
    with pytest.raises(KeyError, match="not a generator hook"):
        found["math"].hook("is_valid_groups")
    assert found["math"].hook("is_valid_group") is None and found["math"].required_fields == ("prompt", "label")
    service = Path(__file__).resolve().parent.parent / "rollout_buffer"
    asked = {m for path in service.rglob("*.py") for m in re.findall(r'\.hook\("(\w+)"\)', path.read_text())}
    assert asked and asked <= set(HOOKS), asked - set(HOOKS)


def test_directory_path_and_duplicate_names_both_files() -> None:
    with pytest.raises(PluginError) as err:
        discover([PLUGINS / "flaky.py", PLUGINS / "dup"], include_entry_points=False)
    msg = str(err.value)
    assert "'flaky'" in msg and "flaky.py" in msg and "flaky_again.py" in msg


def test_broken_file_is_a_clear_error(tmp_path: Path) -> None:
    bad = tmp_path / "broken.py"
    bad.write_text("TASK_TYPE = 'broken'\nimport not_a_module_anywhere\n")
    with pytest.raises(PluginError, match=r"broken\.py failed to import: ModuleNotFoundError"):
        discover([bad], include_entry_points=False)
    nofn = tmp_path / "nofn.py"
    nofn.write_text("TASK_TYPE = 'nofn'\n")
    with pytest.raises(PluginError, match="no callable run_rollout"):
        discover([nofn], include_entry_points=False)


def _install_entry_point(site: Path) -> None:
    """A real installed distribution (dist-info with entry_points.txt) providing a generator module."""
    (site / "ep_generator.py").write_text(textwrap.dedent('''
        TASK_TYPE = "from_entry_point"

        async def run_rollout(item, ctx):
            return {"messages": [{"role": "assistant", "content": "x"}], "reward": 1.0}
    '''))
    info = site / "ep_generator-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: ep-generator\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text("[rollout_buffer.generators]\nfrom_entry_point = ep_generator\n")


def test_entry_point_generator_is_served(tmp_path: Path) -> None:
    site = tmp_path / "site"
    site.mkdir()
    _install_entry_point(site)
    listing = subprocess.run(
        [sys.executable, "-c", "from rollout_buffer.generation.plugins import discover; print(sorted(discover()))"],
        env={"PYTHONPATH": str(site), "PATH": "/usr/bin:/bin"}, capture_output=True, text=True, check=True,
    )
    assert "from_entry_point" in listing.stdout and "math" in listing.stdout
    port = free_port()
    inp = tmp_path / "in.jsonl"
    inp.write_text('{"prompt": "p"}\n')
    args = ["serve", "--port", str(port), "--data-dir", str(tmp_path / "d")]
    with running(args, "/healthz", port, tmp_path / "log", env={"PYTHONPATH": str(site)}) as srv:
        start = {"task_type": "from_entry_point", "input_file": str(inp), "remote_engine_url": "http://127.0.0.1:9"}
        resp = httpx.post(f"{srv.url}/start_rollout", json=start)
        assert resp.status_code == 200, resp.text
        resp = httpx.post(f"{srv.url}/start_rollout", json={"task_type": "nope", "input_file": str(inp)})
        assert "from_entry_point" in resp.json()["message"], "the error lists the known task types"
