"""The base of run options read from a run's `/start_rollout` payload (generators' options, agent sessions'):
typed fields, bad values reported as one ValueError naming them."""

from __future__ import annotations

from typing import Any, ClassVar, Self

from pydantic import BaseModel, ConfigDict, ValidationError


class RunOptions(BaseModel):
    """A generator's run options (the extra keys of `/start_rollout`); keys it does not know are ignored."""

    model_config = ConfigDict(extra="ignore")

    # Starts the ValueError message of bad options, so the run's error says whose options they were.
    error_prefix: ClassVar[str] = "run options"

    @classmethod
    def from_run(cls, config: dict[str, Any]) -> Self:
        """The options of a run's payload; ValueError names the bad ones."""
        try:
            return cls.model_validate(config)
        except ValidationError as e:
            # Not pydantic's error: the runner would read that as a bad trajectory record.
            raise ValueError(f"{cls.error_prefix}: {e}") from None
