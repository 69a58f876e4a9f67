"""The `ray` executor's run options (extra keys of `/start_rollout`): how many actors and what each reserves.

Resource hints place the CPU a trajectory spends (reward functions, tools, subprocess agents) on the cluster:
each actor reserves `ray_num_cpus` CPUs and the custom `ray_resources` (e.g. `{"sandbox": 1}` for nodes that
run agent sandboxes), and Ray places the actors where those are.
"""

from __future__ import annotations

from typing import Any, ClassVar

from pydantic import Field, NonNegativeFloat, PositiveInt

from rollout_buffer.generation.options import RunOptions


class RayRunOptions(RunOptions):
    """Options of a run on the `ray` executor; a pool with other options than the current one is built anew."""

    error_prefix: ClassVar[str] = "ray run options"

    ray_actors: PositiveInt | None = None  # None: the server's --ray-actors, else one actor per cluster CPU
    ray_num_cpus: NonNegativeFloat = 1.0  # CPUs each actor reserves (its trajectories share its event loop)
    ray_resources: dict[str, NonNegativeFloat] = Field(default_factory=dict)  # custom resources per actor
    ray_batch_ms: NonNegativeFloat = Field(default=5.0, le=1000)  # how long records and jobs wait to share a call

    def pool_key(self) -> tuple[Any, ...]:
        """What a pool was built with: a run with another key gets a new pool."""
        return self.ray_actors, self.ray_num_cpus, sorted(self.ray_resources.items())

    def actor_options(self) -> dict[str, Any]:
        """`ActorClass.options(...)` of one actor."""
        return {"num_cpus": self.ray_num_cpus, "resources": dict(self.ray_resources)}
