"""The adapter's flags: registered next to slime's without clashes, read back as typed settings."""

from __future__ import annotations

import argparse

import pytest

from slime_adapter import add_arguments
from slime_adapter.client import RetryPolicy
from slime_adapter.flags import AUTH_TOKEN_ENV, AdapterSettings


def slime_like_parser() -> argparse.ArgumentParser:
    """The flags current slime already defines in its rollout-buffer group (names and defaults as slime's)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollout-buffer-url", type=str, default=None)
    parser.add_argument("--fetch-trajectory-retry-times", type=int, default=-1)
    parser.add_argument("--rollout-task-type", type=str, default="math")
    choices = ["qwen", "qwen3", "qwen3_5", "distill_qwen"]
    parser.add_argument("--loss-mask-type", type=str, default="qwen", choices=choices)
    return parser


def test_fresh_parser_gets_every_flag_with_defaults() -> None:
    args = add_arguments(argparse.ArgumentParser()).parse_args([])
    assert args.agent_rollout_buffer_url is None
    assert args.fetch_trajectory_retry_times == -1
    assert args.loss_mask_type == "qwen"
    assert args.rollout_task_type == "math"
    assert args.rollout_num_process == 256
    assert args.rollout_buffer_lease_s == 300.0 and args.rollout_buffer_wait_s == 30.0


def test_alias_sets_the_same_destination() -> None:
    parser = add_arguments(argparse.ArgumentParser())
    assert parser.parse_args(["--rollout-buffer-url", "http://h:1"]).agent_rollout_buffer_url == "http://h:1"
    assert parser.parse_args(["--agent-rollout-buffer-url", "http://h:2"]).agent_rollout_buffer_url == "http://h:2"


def test_flags_slime_already_has_are_left_to_slime() -> None:
    parser = add_arguments(slime_like_parser())  # would raise argparse.ArgumentError on a clash
    add_arguments(parser)  # and registering twice is harmless
    args = parser.parse_args(["--rollout-buffer-url", "http://b:9", "--loss-mask-type", "qwen3_5",
                              "--rollout-buffer-wait-s", "2"])
    assert args.rollout_buffer_url == "http://b:9"  # slime's own destination
    assert args.loss_mask_type == "qwen3_5"  # slime's choices still apply
    assert args.rollout_buffer_wait_s == 2.0
    settings = AdapterSettings.from_args(args)
    assert settings.buffer_url == "http://b:9" and settings.wait_s == 2.0
    agent = parser.parse_args(["--agent-rollout-buffer-url", "http://a:8"])
    assert AdapterSettings.from_args(agent).buffer_url == "http://a:8"


def test_settings_from_args(monkeypatch: pytest.MonkeyPatch) -> None:
    parser = add_arguments(argparse.ArgumentParser())
    monkeypatch.setenv(AUTH_TOKEN_ENV, "from-env")
    args = parser.parse_args(["--rollout-buffer-url", "http://x:1", "--rollout-buffer-lease-s", "0",
                              "--fetch-trajectory-retry-times", "3", "--rollout-buffer-backoff-s", "0.5"])
    settings = AdapterSettings.from_args(args)
    assert settings.lease_s is None  # 0 disables leasing
    assert settings.retry.retries == 3 and settings.retry.delay(1) == 0.5 and settings.retry.delay(3) == 2.0
    assert settings.token == "from-env"
    flag = parser.parse_args(["--rollout-buffer-url", "http://x:1", "--rollout-buffer-token", "from-flag"])
    assert AdapterSettings.from_args(flag).token == "from-flag"


def test_settings_refuse_missing_url_and_bad_wait() -> None:
    parser = add_arguments(argparse.ArgumentParser())
    with pytest.raises(ValueError, match="--agent-rollout-buffer-url"):
        AdapterSettings.from_args(parser.parse_args([]))
    with pytest.raises(ValueError, match="wait"):
        args = parser.parse_args(["--rollout-buffer-url", "http://x", "--rollout-buffer-wait-s", "900"])
        AdapterSettings.from_args(args)


def test_retry_policy_limits_and_backoff() -> None:
    assert not RetryPolicy(retries=-1).gives_up(10**6)  # -1: never gives up
    limited = RetryPolicy(retries=2, backoff_s=0.5)
    assert not limited.gives_up(2) and limited.gives_up(3)  # 2 retries = 3 attempts
    assert [limited.delay(k) for k in (1, 2, 3, 10)] == [0.5, 1.0, 2.0, 30.0]  # doubling, capped
