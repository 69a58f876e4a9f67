"""A run's settings are parsed once into a typed object that every trajectory of the run shares."""

from __future__ import annotations

import pytest
from pydantic import PositiveInt

from rollout_buffer.generation.context import RolloutContext, RunResources
from rollout_buffer.generation.options import RunOptions


class _Options(RunOptions):
    error_prefix = "my generator's options"
    turns: PositiveInt = 3


def _resources(config: dict[str, object]) -> RunResources:
    return RunResources("r1", "mine", config, engine=None, tokenizer=None, sampling_params={},  # type: ignore[arg-type]
                        max_tokens=None)


def test_options_are_parsed_once_for_the_run_and_typed() -> None:
    resources = _resources({"turns": "5", "other": "ignored"})
    first = RolloutContext(resources, "i1", 0, 0, "u1").options(_Options)
    second = RolloutContext(resources, "i2", 0, 1, "u2").options(_Options)
    assert first is second and first.turns == 5
    resources.config["turns"] = 7  # the payload is read once: a trajectory sees the run's options
    assert resources.options(_Options).turns == 5


def test_bad_options_name_the_field_and_whose_they_are() -> None:
    with pytest.raises(ValueError, match=r"^my generator's options: turns: Input should be greater than 0"):
        _resources({"turns": 0}).options(_Options)
