"""A standalone stand-in for slime's data buffer (`RolloutDataSourceWithBuffer`) for use without slime.

It has the methods `generate_rollout` calls, with slime's names and behaviour: `add_samples` takes whole
groups of exactly `n_samples_per_prompt` samples, `get_samples` pops the oldest groups first, and
`metadata` maps rollout ids to the instance ids consumed in them (the skip list of a resumed run).
"""

from __future__ import annotations

from typing import Any

Group = list[Any]


class DataBuffer:
    """Groups of samples waiting to be trained on, oldest first."""

    def __init__(self, n_samples_per_prompt: int):
        if n_samples_per_prompt < 1:
            raise ValueError("n_samples_per_prompt must be at least 1")
        self.n_samples_per_prompt = n_samples_per_prompt
        self.buffer: list[Group] = []
        self.metadata: dict[str, Any] = {}

    def add_samples(self, samples: list[Group]) -> None:
        """Append whole groups; like slime, refuses a group whose size is not `n_samples_per_prompt`."""
        for group in samples:
            if not isinstance(group, list):
                raise TypeError(f"groups must be lists of samples, got {type(group).__name__}")
            if len(group) != self.n_samples_per_prompt:
                raise ValueError(f"group has {len(group)} samples, expected {self.n_samples_per_prompt}")
        self.buffer.extend(samples)

    def get_samples(self, num_samples: int) -> list[Group]:
        """Remove and return up to `num_samples` groups, oldest first (slime's default `pop_first`)."""
        taken = self.buffer[:num_samples]
        del self.buffer[:num_samples]
        return taken

    def get_buffer_length(self) -> int:
        """Number of groups held."""
        return len(self.buffer)

    def get_metadata(self) -> dict[str, Any]:
        """The metadata dict (slime saves it with checkpoints)."""
        return self.metadata

    def update_metadata(self, metadata: dict[str, Any]) -> None:
        """Merge entries into the metadata."""
        self.metadata.update(metadata)
