"""`python -m slime_adapter.launch`: the adapter's flags reach slime's parser after slime's own.

slime cannot be installed here, so these tests build a minimal slime checkout with the parts the
launcher touches, shaped like slime's: `slime.utils.arguments` with `get_slime_extra_args_provider`
(custom hook first, then slime's flags, among them `--loss-mask-type` and `--rollout-buffer-url`) and a
`parse_args`, and a `train_async.py` that parses and prints its args.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ARGUMENTS_PY = '''
import argparse


def get_slime_extra_args_provider(add_custom_arguments=None):
    def add_slime_arguments(parser):
        if add_custom_arguments is not None:
            parser = add_custom_arguments(parser)
        parser.add_argument("--rollout-batch-size", type=int, default=32)
        parser.add_argument("--rollout-buffer-url", type=str, default=None)
        parser.add_argument("--loss-mask-type", type=str, default="qwen",
                            choices=["qwen", "qwen3", "qwen3_5", "distill_qwen"])
        return parser

    return add_slime_arguments


def parse_args(add_custom_arguments=None):
    parser = argparse.ArgumentParser()
    parser = get_slime_extra_args_provider(add_custom_arguments)(parser)
    return parser.parse_args()
'''
TRAIN_PY = '''
import json
from slime.utils.arguments import parse_args

if __name__ == "__main__":
    print(json.dumps({"script": __file__, **vars(parse_args())}))
'''


@pytest.fixture
def slime_checkout(tmp_path: Path) -> Path:
    root = tmp_path / "slime-src"
    (root / "slime" / "utils").mkdir(parents=True)
    (root / "slime" / "__init__.py").write_text("")
    (root / "slime" / "utils" / "__init__.py").write_text("")
    (root / "slime" / "utils" / "arguments.py").write_text(ARGUMENTS_PY)
    (root / "train_async.py").write_text(TRAIN_PY)
    return root


def launch(checkout: Path, *argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    repo = Path(__file__).resolve().parent.parent
    full_env = {k: v for k, v in os.environ.items() if k != "SLIME_TRAIN_SCRIPT"}
    full_env |= {"PYTHONPATH": os.pathsep.join([str(checkout), str(repo)]), **(env or {})}
    command = [sys.executable, "-m", "slime_adapter.launch", *argv]
    return subprocess.run(command, capture_output=True, text=True, env=full_env, cwd=checkout, timeout=60)


def test_launch_adds_the_adapter_flags_after_slimes(slime_checkout: Path) -> None:
    out = launch(
        slime_checkout,
        *("--rollout-batch-size", "4", "--agent-rollout-buffer-url", "http://buf:8889"),
        *("--loss-mask-type", "qwen3_5", "--rollout-buffer-lease-s", "60"),
        *("--fetch-trajectory-retry-times", "5"),
    )
    assert out.returncode == 0, out.stderr
    args = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(args["script"]) == slime_checkout / "train_async.py"
    assert args["rollout_batch_size"] == 4
    assert args["agent_rollout_buffer_url"] == "http://buf:8889"
    assert args["rollout_buffer_url"] is None  # slime's flag stays slime's
    assert args["loss_mask_type"] == "qwen3_5"  # slime's definition (and choices) won
    assert args["rollout_buffer_lease_s"] == 60.0 and args["fetch_trajectory_retry_times"] == 5
    assert args["rollout_buffer_wait_s"] == 30.0 and args["rollout_task_type"] == "math"


def test_launch_uses_the_script_named_in_the_environment(slime_checkout: Path) -> None:
    other = slime_checkout / "train.py"
    other.write_text(TRAIN_PY)
    out = launch(slime_checkout, "--rollout-buffer-url", "http://b:1", env={"SLIME_TRAIN_SCRIPT": str(other)})
    assert out.returncode == 0, out.stderr
    args = json.loads(out.stdout.strip().splitlines()[-1])
    assert Path(args["script"]) == other and args["rollout_buffer_url"] == "http://b:1"
    missing = launch(slime_checkout, env={"SLIME_TRAIN_SCRIPT": str(slime_checkout / "nope.py")})
    assert missing.returncode != 0 and "nope.py does not exist" in missing.stderr
