"""slime's `Sample`: the real class inside slime, a field-compatible dataclass elsewhere."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


@dataclass
class StandaloneSample:
    """The fields of `slime.utils.types.Sample` that the adapter and slime's trainer use, same defaults."""

    class Status(Enum):
        PENDING = "pending"
        COMPLETED = "completed"
        TRUNCATED = "truncated"
        ABORTED = "aborted"
        FAILED = "failed"

    group_index: int | None = None
    index: int | str | None = None
    prompt: str | list[dict[str, Any]] = ""
    tokens: list[int] = field(default_factory=list)
    response: str = ""
    response_length: int = 0
    label: str | None = None
    reward: float | dict[str, Any] | None = None
    loss_mask: list[int] | None = None
    weight_versions: list[str] = field(default_factory=list)
    rollout_log_probs: list[float] | None = None
    rollout_id: int | None = None
    multimodal_inputs: dict[str, Any] | None = None
    multimodal_train_inputs: dict[str, Any] | None = None
    rollout_top_p_token_ids: Any = None
    rollout_top_p_token_offsets: Any = None
    rollout_routed_experts: Any = None
    teacher_log_probs: list[float] | None = None
    remove_sample: bool = False
    status: Status = Status.PENDING
    metadata: dict[str, Any] = field(default_factory=dict)
    train_metadata: dict[str, Any] | None = None
    session_id: str | None = None


def _slime_sample() -> type[StandaloneSample] | None:
    """slime's `Sample`, typed as the standalone class: it has (at least) the same fields and `Status` members."""
    try:
        from slime.utils.types import Sample as SlimeSample
    except ImportError:
        return None
    return SlimeSample


SLIME_SAMPLE: type[StandaloneSample] | None = _slime_sample()
# The class samples are built from: slime's when it is importable, so slime's isinstance checks hold.
Sample: type[StandaloneSample] = SLIME_SAMPLE or StandaloneSample


# Both are asked once per sample; `Sample` is fixed at import, so the answers are computed once.
@functools.cache
def status_member(name: str) -> Enum:
    """`Sample.Status[name]`, falling back to ABORTED for statuses an older slime lacks (e.g. FAILED)."""
    members = Sample.Status.__members__
    return members[name] if name in members else members["ABORTED"]


@functools.cache
def sample_fields() -> frozenset[str]:
    """Constructor fields of the active `Sample` class (they differ between slime versions)."""
    return frozenset(Sample.__dataclass_fields__)
