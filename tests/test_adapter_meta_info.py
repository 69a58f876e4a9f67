"""`log_raw_info`: one rollout's meta_info batches, aggregated with sample weights, logged under rollout/."""

from __future__ import annotations

import importlib.util
import logging
import sys
import types
from argparse import Namespace
from typing import Any

import pytest
from slime_src import needs_slime_src, slime_on_path

from slime_adapter import log_raw_info
from slime_adapter.meta_info import aggregate_meta_info

# With slime installed its own tracking manager receives the metrics instead of wandb directly (checked against
# SLIME_SRC's slime below).
without_slime = pytest.mark.skipif(importlib.util.find_spec("slime") is not None, reason="slime is installed")

BATCHES: list[dict[str, Any]] = [
    {
        "total_samples": 8, "num_groups": 2, "avg_group_size": 4.0, "avg_reward": 1.0,
        "avg_normalized_reward": 0.0, "finished_groups": ["1", "2", "2"], "finished_groups_count": 3,
        "filtered_groups": {"zero_variance": 1},
        "filtered_zero_variance": 1, "tokenization_mismatches": 1, "redelivered_groups": 0,
        "batch_id": "b1", "acked_groups": 0, "pass_rate": 0.5,
    },
    {
        "total_samples": 24, "num_groups": 3, "avg_group_size": 8.0, "avg_reward": 0.0,
        "avg_normalized_reward": 0.0, "finished_groups": [], "finished_groups_count": 0,
        "filtered_groups": {"zero_variance": 2, "is_valid_group_error: ValueError: bad": 1},
        "tokenization_mismatches": 0, "redelivered_groups": 2, "batch_id": "b2", "pass_rate": 0.25,
    },
    # A batch of groups that were all dropped by the adapter still reports what the buffer finished and filtered.
    {"total_samples": 0, "num_groups": 0, "avg_reward": 0.0, "finished_groups": ["9"], "finished_groups_count": 1,
     "filtered_groups": {"empty_response": 4}, "batch_id": None},
]


def test_values_are_weighted_by_samples_and_counts_summed() -> None:
    m = aggregate_meta_info(BATCHES)
    assert m["rollout/no_filter/total_samples"] == 32
    assert m["rollout/no_filter/avg_reward"] == pytest.approx((8 * 1.0 + 24 * 0.0) / 32)
    assert m["rollout/no_filter/num_groups"] == 5
    assert m["rollout/no_filter/avg_group_size"] == pytest.approx(32 / 5)
    assert m["rollout/finished_groups"] == 4
    assert m["rollout/filtered_groups/zero_variance"] == 3
    assert m["rollout/filtered_groups/is_valid_group_error"] == 1
    assert m["rollout/filtered_groups/empty_response"] == 4
    assert m["rollout/filtered_groups/total"] == 8
    assert m["rollout/tokenization_mismatches"] == 1
    assert m["rollout/redelivered_groups"] == 2
    assert m["rollout/meta/pass_rate"] == pytest.approx((8 * 0.5 + 24 * 0.25) / 32)
    assert all(k.startswith("rollout/") for k in m)
    assert not any("batch_id" in k or "filtered_zero_variance" in k for k in m)


def test_finished_groups_lists_are_counted_and_not_logged_as_metrics() -> None:
    m = aggregate_meta_info([{"total_samples": 4, "avg_reward": 0.5, "finished_groups": ["7", "9"],
                              "finished_groups_count": 2}])
    assert m["rollout/finished_groups"] == 2 and m["rollout/no_filter/avg_reward"] == 0.5
    assert not any("finished_groups_count" in k for k in m)


def test_adapter_counts_are_logged_under_their_own_prefix() -> None:
    args = Namespace(use_wandb=False, use_tensorboard=False)
    m = log_raw_info(args, [{"total_samples": 4, "avg_reward": 0.5}], 3, {"dropped_groups": 1})
    assert m["rollout/adapter/dropped_groups"] == 1 and m["rollout/step"] == 3


def test_version_lag_and_admission_are_logged_under_staleness() -> None:
    m = aggregate_meta_info([
        {"total_samples": 8, "avg_version_lag": 1.0, "max_version_lag": 2, "stale_groups": 1, "regenerated_groups": 1,
         "trainer_version": 4, "groups_ahead": 6, "admission_state": "paused_staleness"},
        {"total_samples": 24, "avg_version_lag": 0.0, "max_version_lag": 0, "stale_groups": 2,
         "trainer_version": 5, "groups_ahead": 3, "admission_state": "running"},
    ])
    assert m["rollout/staleness/avg_version_lag"] == pytest.approx(8 / 32)
    assert m["rollout/staleness/max_version_lag"] == 2
    assert (m["rollout/stale_groups"], m["rollout/regenerated_groups"]) == (3, 1)
    assert (m["rollout/staleness/trainer_version"], m["rollout/staleness/groups_ahead"]) == (5, 3)
    assert (m["rollout/staleness/admission_running"], m["rollout/staleness/admission_paused_staleness"]) == (1.0, 0.0)
    assert not any(k.startswith("rollout/meta/") for k in m)


def test_no_batches_logs_zero_samples() -> None:
    assert aggregate_meta_info([])["rollout/no_filter/total_samples"] == 0


def test_logged_to_logging_with_the_rollout_step(caplog: pytest.LogCaptureFixture) -> None:
    args = Namespace(use_wandb=False, use_tensorboard=False)
    with caplog.at_level(logging.INFO, logger="slime_adapter.meta_info"):
        metrics = log_raw_info(args, BATCHES, rollout_id=12)
    assert metrics["rollout/step"] == 12
    assert "rollout 12" in caplog.text and "rollout/no_filter/avg_reward" in caplog.text


def test_weight_swaps_the_engines_did_not_version_are_logged_with_a_warning(caplog: pytest.LogCaptureFixture
                                                                            ) -> None:
    args = Namespace(use_wandb=False, use_tensorboard=False)
    batches = [{"total_samples": 4, "unversioned_weight_swaps": 0}, {"total_samples": 4, "unversioned_weight_swaps": 2}]
    with caplog.at_level(logging.WARNING, logger="slime_adapter.meta_info"):
        metrics = log_raw_info(args, batches, rollout_id=3)
    assert metrics["rollout/staleness/unversioned_weight_swaps"] == 2
    assert "saw 2 weight updates the engines did not version" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="slime_adapter.meta_info"):
        log_raw_info(args, batches[:1], rollout_id=4)
    assert caplog.text == ""


@pytest.fixture
def fake_wandb(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """A stand-in `wandb` module (wandb is not installed here) recording what is logged."""
    logged: list[dict[str, Any]] = []
    module = types.ModuleType("wandb")
    module.log = logged.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", module)
    return logged


@without_slime
def test_wandb_gets_the_metrics_when_slime_enables_it(fake_wandb: list[dict[str, Any]]) -> None:
    args = Namespace(use_wandb=True, use_tensorboard=False, wandb_always_use_train_step=True,
                     rollout_batch_size=4, n_samples_per_prompt=8, global_batch_size=16)
    log_raw_info(args, BATCHES, rollout_id=3)
    assert len(fake_wandb) == 1
    assert fake_wandb[0]["rollout/step"] == 3 * 4 * 8 // 16
    assert fake_wandb[0]["rollout/no_filter/total_samples"] == 32


@without_slime
def test_a_failing_tracker_does_not_stop_training(
    fake_wandb: list[dict[str, Any]], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(_: dict[str, Any]) -> None:
        raise ConnectionError("wandb is down")

    monkeypatch.setattr(sys.modules["wandb"], "log", broken)
    with caplog.at_level(logging.WARNING, logger="slime_adapter.meta_info"):
        metrics = log_raw_info(Namespace(use_wandb=True), BATCHES, rollout_id=1)
    assert metrics["rollout/no_filter/total_samples"] == 32
    assert "wandb is down" in caplog.text


@needs_slime_src
def test_slimes_own_tracking_gets_the_metrics_inside_slime(fake_wandb: list[dict[str, Any]]) -> None:
    """Inside a slime process the metrics go through slime's `logging_utils.log` (its trackers), not wandb directly."""
    args = Namespace(use_wandb=True, use_tensorboard=False, wandb_always_use_train_step=False)
    with slime_on_path():
        metrics = log_raw_info(args, BATCHES, rollout_id=3)
        used = [m for m in sys.modules if m.endswith(".logging_utils") and m.startswith("slime.")]
    assert used and fake_wandb == [metrics]
    assert metrics["rollout/step"] == 3 and metrics["rollout/no_filter/total_samples"] == 32
