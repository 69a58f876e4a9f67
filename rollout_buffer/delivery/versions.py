"""Weight versions: what SGLang's `weight_version` strings mean as numbers, a record's version range, the
trainer's version per run, and the staleness rule a run asks for.

SGLang reports `weight_version` as a string. A numeric string ("7", "000007", as slime writes them) is that
number; `"default"` (what an engine reports before its first weight update) is version 0; any other string
(a hash, "step-7") cannot be ordered and counts as unknown: such data is never judged stale and its lag is
not measured. The trainer's version (`current_version`) must be a non-negative integer; within a run it only
moves forward, unless the trainer says it rewound (a restart from an older checkpoint).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# What SGLang reports before any weight update: the weights the engine was started with.
INITIAL_VERSION_NAME = "default"


def engine_version(value: Any) -> int | None:
    """The number of an engine's `weight_version`: numeric strings and integers as such, `"default"` as 0,
    None for anything else (unknown order)."""
    if isinstance(value, bool) or value is None:
        return None
    if isinstance(value, int):
        return value if value >= 0 else None
    text = str(value).strip()
    if text == INITIAL_VERSION_NAME:
        return 0
    return int(text) if text.isdigit() else None


def ordered_versions(values: Iterable[Any]) -> list[tuple[int, str]]:
    """The known versions among `values`, as (number, reported string), lowest first."""
    known = {(n, str(v)) for v in values if (n := engine_version(v)) is not None}
    return sorted(known)


def version_range(record: Mapping[str, Any]) -> tuple[int, int] | None:
    """(oldest, newest) known weight version a record was generated with, or None when none is known.

    Reads `extra_info.weight_version_min/max` (set by the runner) and else the record's `weight_versions`
    list (records written by other producers through `/buffer/write`).
    """
    info = record.get("extra_info") or {}
    low, high = engine_version(info.get("weight_version_min")), engine_version(info.get("weight_version_max"))
    if low is not None and high is not None:
        return low, high
    known = ordered_versions(record.get("weight_versions") or ())
    return (known[0][0], known[-1][0]) if known else None


def group_version_range(records: Iterable[Mapping[str, Any]]) -> tuple[int | None, int | None]:
    """(oldest, newest) known version over a group's records; (None, None) when none is known."""
    ranges = [r for r in map(version_range, records) if r is not None]
    if not ranges:
        return None, None
    return min(r[0] for r in ranges), max(r[1] for r in ranges)


def mask_older_versions(loss_mask: list[int], spans: Iterable[tuple[int, int, str | None]]) -> int:
    """Zero `loss_mask` over the spans generated with a known version older than the newest known one (the
    option slime calls `mask_offpolicy_in_partial_rollout`); returns how many tokens it masked.

    `spans` are `(start, end, weight_version)` over the token positions `loss_mask` covers.
    """
    spans = list(spans)
    known = [n for *_, v in spans if (n := engine_version(v)) is not None]
    if not known:
        return 0
    newest = max(known)
    masked = 0
    for start, end, version in spans:
        n = engine_version(version)
        if n is not None and n < newest:
            masked += sum(loss_mask[start:end])
            loss_mask[start:end] = [0] * (end - start)
    return masked


class VersionConflict(ValueError):
    """A trainer version older than the one the run already has, without `rewind`."""

    def __init__(self, reported: int, current: int):
        super().__init__(
            f"current_version: {reported} is older than the trainer version {current} this run already has "
            "(send \"rewind\": true to /trainer_version when the trainer restarted from an older checkpoint)"
        )
        self.reported = reported
        self.current = current


@dataclass(frozen=True)
class TrainerVersion:
    """The trainer's weight version for one run: where it stood when the run began, and now."""

    base: int | None = None
    current: int | None = None

    def advanced(self, version: int, rewind: bool = False) -> TrainerVersion:
        """This bookkeeping after the trainer reports `version`; raises VersionConflict when it goes back
        without `rewind`. The first version a run hears of is its base."""
        if self.current is not None and version < self.current and not rewind:
            raise VersionConflict(version, self.current)
        return TrainerVersion(self.base if self.base is not None else version, version)

    @property
    def steps(self) -> int:
        """Versions the trainer advanced since the run began (0 while unknown)."""
        if self.base is None or self.current is None:
            return 0
        return max(0, self.current - self.base)

    def lag(self, version: int | None) -> int | None:
        """How many versions data generated with `version` is behind the trainer (0 when it is not)."""
        if version is None or self.current is None:
            return None
        return max(0, self.current - version)


@dataclass(frozen=True)
class StalenessRule:
    """A run's bound on version lag (`max_staleness`, η) and what happens to groups beyond it."""

    max_staleness: int
    regenerate: bool = False

    @classmethod
    def of_run(cls, config: Mapping[str, Any]) -> StalenessRule | None:
        """The rule of a run's start payload, None when it sets no `max_staleness`."""
        eta = config.get("max_staleness")
        if eta is None:
            return None
        return cls(int(eta), bool(config.get("regenerate_stale", False)))
