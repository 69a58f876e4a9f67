"""scripts/run-qwen3-4b.sh, the copy-paste slime launch: its flags parse as slime and the adapter parse them.

The script is sourced (it runs nothing then) and each group of flags printed. slime's own flags, with the
adapter's added the way `slime_adapter.launch` adds them, go through slime's `get_slime_extra_args_provider` from
the pinned copy (SLIME_SRC); the adapter's alone through the adapter's parser. Megatron's and SGLang's groups
need those packages' parsers (GPU installs) and are not parsed here.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import types
from pathlib import Path

import pytest
from slime_src import needs_slime_src, slime_on_path

from slime_adapter.flags import add_arguments
from slime_adapter.launch import with_adapter_flags

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "run-qwen3-4b.sh"
SLIME_GROUPS = ("SLIME_CLUSTER_ARGS", "SLIME_CKPT_ARGS", "SLIME_ROLLOUT_ARGS", "SLIME_GRPO_ARGS", "SLIME_PERF_ARGS")


def flags(group: str) -> list[str]:
    """The script's flags of `group`, as bash expands them (the script sourced with a token set)."""
    shown = subprocess.run(["bash", "-c", f'source "$1" && printf "%s\\n" "${{{group}[@]}}"', "bash", str(SCRIPT)],
                           capture_output=True, text=True, timeout=30, check=True,
                           env={"ROLLOUT_BUFFER_AUTH_TOKEN": "t0ken", "PATH": "/usr/bin:/bin"})
    return shown.stdout.splitlines()


def test_the_adapters_flags_parse_with_the_adapters_parser() -> None:
    args = add_arguments(argparse.ArgumentParser()).parse_args(flags("ADAPTER_ARGS"))
    assert args.agent_rollout_buffer_url == "http://127.0.0.1:8889" and args.rollout_buffer_token == "t0ken"
    assert (args.rollout_task_type, args.loss_mask_type, args.rollout_buffer_lease_s) == ("math", "qwen3", 300.0)


@needs_slime_src
def test_slimes_flags_parse_with_slimes_own_parser(monkeypatch: pytest.MonkeyPatch) -> None:
    # slime's argument module imports SGLang's server arguments (a GPU install) for its SGLang group only: a
    # stand-in for that import; slime's own flags are its real code.
    for name in ("sglang", "sglang.srt", "sglang.srt.server_args"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    sys.modules["sglang.srt.server_args"].ServerArgs = object  # type: ignore[attr-defined]
    with slime_on_path():
        from slime.utils.arguments import get_slime_extra_args_provider

        parser = with_adapter_flags(get_slime_extra_args_provider)()(argparse.ArgumentParser())
        given = [f for group in SLIME_GROUPS for f in flags(group)] + flags("ADAPTER_ARGS")
        args = parser.parse_args(given)
    assert args.rollout_function_path == "slime_adapter.generate_rollout"
    assert args.prompt_data.endswith("dapo-math-17k.jsonl") and args.hf_checkpoint == "/root/Qwen3-4B"
    assert (args.rollout_batch_size, args.n_samples_per_prompt, args.rollout_max_response_len) == (32, 8, 8192)
    assert args.rewards_normalization is False and args.agent_rollout_buffer_url == "http://127.0.0.1:8889"
    assert (args.actor_num_gpus_per_node, args.rollout_num_gpus) == (4, 4)


def test_the_script_refuses_to_run_without_a_token_or_a_buffer(tmp_path: Path) -> None:
    no_token = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30,
                              env={"PATH": "/usr/bin:/bin"})
    assert no_token.returncode != 0 and "ROLLOUT_BUFFER_AUTH_TOKEN" in no_token.stderr, no_token.stderr
    no_buffer = subprocess.run(["bash", str(SCRIPT)], capture_output=True, text=True, timeout=30,
                               env={"PATH": "/usr/bin:/bin", "ROLLOUT_BUFFER_AUTH_TOKEN": "t",
                                    "BUFFER_URL": "http://127.0.0.1:9"})
    assert no_buffer.returncode == 1 and "does not answer at http://127.0.0.1:9" in no_buffer.stderr
