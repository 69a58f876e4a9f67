"""`log_raw_info`: the buffer's per-batch meta_info, aggregated over one rollout and logged under `rollout/`.

Averages are weighted by the samples of each batch (a batch of 64 samples counts 64 times a batch of
one), counts are summed. slime's own trackers (wandb, tensorboard) get the numbers when slime's args
enable them; `logging` always does.
"""

from __future__ import annotations

import importlib
import logging
import numbers
from collections import Counter
from collections.abc import Iterable
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

PREFIX = "rollout/"
# Keys with a meaning of their own; any other numeric key is averaged by samples under rollout/meta/.
_SUMMED = ("tokenization_mismatches", "redelivered_groups", "stale_groups", "regenerated_groups")
_AVERAGED = ("avg_reward", "avg_normalized_reward")
# The version lag of the delivered data (averaged by samples under rollout/staleness/, its max the max).
_LAG = "avg_version_lag"
_MAX_LAG = "max_version_lag"
# State at the time of the rollout's last fetch; the weight swaps the buffer saw the engines make under an unchanged
# version (their tokens are credited to the wrong weights: docs/staleness.md).
_SWAPS = "unversioned_weight_swaps"
_LATEST = ("trainer_version", "groups_ahead", _SWAPS)
_ADMISSION = "admission_state"
_NOT_METRICS = frozenset(
    {"total_samples", "num_groups", "avg_group_size", "finished_groups", "finished_groups_count", "filtered_groups",
     "batch_id", "run_id", "acked_groups", _LAG, _MAX_LAG, _ADMISSION, *_LATEST, *_SUMMED, *_AVERAGED}
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    return float(value)


def _count(value: Any) -> int:
    # `finished_groups` lists instance ids (one per group), as slime's buffer sends it.
    if isinstance(value, list | tuple | set):
        return len(value)
    number = _number(value)
    return int(number) if number is not None else 0


def aggregate_meta_info(all_meta_info: Iterable[dict[str, Any]]) -> dict[str, float]:
    """The `rollout/...` metrics of one rollout's batches."""
    metas = [m for m in all_meta_info if m]
    weights = [_count(m.get("total_samples")) for m in metas]
    total = sum(weights)
    metrics: dict[str, float] = {f"{PREFIX}no_filter/total_samples": total}

    def weighted(key: str) -> float | None:
        values = [(_number(m.get(key)), w) for m, w in zip(metas, weights, strict=True)]
        pairs = [(v, w) for v, w in values if v is not None]
        seen = sum(w for _, w in pairs)
        return sum(v * w for v, w in pairs) / seen if seen else None

    for key in _AVERAGED:
        if (value := weighted(key)) is not None:
            metrics[f"{PREFIX}no_filter/{key}"] = value
    num_groups = sum(_count(m.get("num_groups")) for m in metas)
    metrics[f"{PREFIX}no_filter/num_groups"] = num_groups
    if num_groups:
        metrics[f"{PREFIX}no_filter/avg_group_size"] = total / num_groups
    metrics[f"{PREFIX}finished_groups"] = sum(_count(m.get("finished_groups")) for m in metas)

    filtered: Counter[str] = Counter()
    for m in metas:
        for reason, n in (m.get("filtered_groups") or {}).items():
            # Free-text reasons ("is_valid_group_error: ValueError: ...") are grouped by their tag.
            filtered[str(reason).split(":")[0]] += _count(n)
    metrics[f"{PREFIX}filtered_groups/total"] = sum(filtered.values())
    for reason, n in filtered.items():
        metrics[f"{PREFIX}filtered_groups/{reason}"] = n
    for key in _SUMMED:
        metrics[f"{PREFIX}{key}"] = sum(_count(m.get(key)) for m in metas)
    metrics.update(_staleness_metrics(metas, weighted))

    extra_keys = {k for m in metas for k in m if k not in _NOT_METRICS and not k.startswith("filtered_")}
    for key in sorted(extra_keys):
        if (value := weighted(key)) is not None:
            metrics[f"{PREFIX}meta/{key}"] = value
    return metrics


def _staleness_metrics(metas: list[dict[str, Any]], weighted: Any) -> dict[str, float]:
    """rollout/staleness/: the lag of the rollout's data, and where the trainer and admission stood last."""
    out: dict[str, float] = {}
    if (lag := weighted(_LAG)) is not None:
        out[f"{PREFIX}staleness/avg_version_lag"] = lag
    lags = [v for m in metas if (v := _number(m.get(_MAX_LAG))) is not None]
    if lags:
        out[f"{PREFIX}staleness/max_version_lag"] = max(lags)
    for key in _LATEST:
        values = [v for m in metas if (v := _number(m.get(key))) is not None]
        if values:
            out[f"{PREFIX}staleness/{key}"] = values[-1]
    states = [m[_ADMISSION] for m in metas if isinstance(m.get(_ADMISSION), str)]
    if states:  # one-hot, so a dashboard can plot how often generation was paused
        for state in ("running", "paused_staleness", "paused_cap"):
            out[f"{PREFIX}staleness/admission_{state}"] = float(states[-1] == state)
    return out


def rollout_step(args: Any, rollout_id: int) -> int:
    """The x-axis value slime logs rollout metrics against (`rollout/step`)."""
    if getattr(args, "wandb_always_use_train_step", False):
        return rollout_id * args.rollout_batch_size * args.n_samples_per_prompt // args.global_batch_size
    return rollout_id


def _slime_module(name: str) -> ModuleType | None:
    """slime's `observability.<name>` (current slime), else `utils.<name>` (before the move); None without slime."""
    for package in ("slime.observability", "slime.utils"):
        try:
            return importlib.import_module(f"{package}.{name}")
        except ModuleNotFoundError as e:
            if e.name not in ("slime", package, f"{package}.{name}"):
                raise  # it is there but cannot import (e.g. no wandb): log_raw_info warns
    return None


def _send_to_trackers(args: Any, metrics: dict[str, float], step: int) -> None:
    logging_utils = _slime_module("logging_utils")
    if logging_utils is not None and hasattr(logging_utils, "log"):
        # Current slime: one call reaches every tracker the run enabled (wandb, tensorboard, mlflow).
        logging_utils.log(args, metrics, step_key=f"{PREFIX}step")
        return
    if getattr(args, "use_wandb", False):
        import wandb

        wandb.log(metrics)
    if getattr(args, "use_tensorboard", False):
        tensorboard_utils = _slime_module("tensorboard_utils")
        if tensorboard_utils is None:
            raise ImportError("use_tensorboard needs slime's tensorboard_utils")
        tensorboard_utils._TensorboardAdapter(args).log(metrics, step)


def log_raw_info(args: Any, all_meta_info: list[dict[str, Any]], rollout_id: int,
                 adapter_counts: dict[str, int] | None = None) -> dict[str, float]:
    """Aggregate and log one rollout's meta_info; returns the metrics logged (with `rollout/step`).

    `adapter_counts` are the adapter's own counts of the rollout (e.g. groups it dropped because a record
    could not become a sample), logged under `rollout/adapter/`.
    """
    metrics = aggregate_meta_info(all_meta_info)
    for key, value in (adapter_counts or {}).items():
        metrics[f"{PREFIX}adapter/{key}"] = value
    step = rollout_step(args, rollout_id)
    metrics[f"{PREFIX}step"] = step
    log.info("rollout %d buffer stats: %s", rollout_id, metrics)
    if metrics.get(f"{PREFIX}staleness/{_SWAPS}"):
        log.warning("rollout %d: the buffer saw %d weight updates the engines did not version (GET /status, "
                    "control.weights): their tokens' weight versions are wrong", rollout_id,
                    metrics[f"{PREFIX}staleness/{_SWAPS}"])
    try:
        _send_to_trackers(args, metrics, step)
    except Exception as e:  # a tracker outage must not stop training
        log.warning("could not send rollout %d stats to trackers: %s: %s", rollout_id, type(e).__name__, e)
    return metrics
