"""The `ray` executor's run options (extra keys of `/start_rollout`): how many actors and what each reserves.

Resource hints place the CPU a trajectory spends (reward functions, tools, subprocess agents) on the cluster:
each actor reserves `ray_num_cpus` CPUs, `ray_memory_mb` of memory and the custom `ray_resources` (e.g.
`{"sandbox": 1}` for nodes that run agent sandboxes), and Ray places the actors where those are. A request no
node of the cluster can meet is refused by name (Ray would wait for such a node forever).
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
    ray_memory_mb: NonNegativeFloat = 0.0  # memory each actor reserves (0: none)
    ray_resources: dict[str, NonNegativeFloat] = Field(default_factory=dict)  # custom resources per actor
    ray_batch_ms: NonNegativeFloat = Field(default=5.0, le=1000)  # how long records and jobs wait to share a call

    def pool_key(self) -> tuple[Any, ...]:
        """What a pool was built with: a run with another key gets a new pool."""
        return self.ray_actors, self.ray_num_cpus, self.ray_memory_mb, sorted(self.ray_resources.items())

    def actor_options(self) -> dict[str, Any]:
        """`ActorClass.options(...)` of one actor."""
        memory = {"memory": int(self.ray_memory_mb * 2**20)} if self.ray_memory_mb else {}
        return {"num_cpus": self.ray_num_cpus, **memory, "resources": dict(self.ray_resources)}

    def unmet(self, nodes: list[dict[str, Any]]) -> str | None:
        """Why no alive node of `nodes` (`ray.nodes()`) can host an actor, naming the options; None when one can."""
        wants = {"ray_num_cpus": {"CPU": self.ray_num_cpus}, "ray_memory_mb": {"memory": self.ray_memory_mb * 2**20},
                 "ray_resources": dict(self.ray_resources)}
        totals = [n.get("Resources", {}) for n in nodes if n.get("Alive")]

        def fits(want: dict[str, float]) -> bool:
            return any(all(float(have.get(k, 0)) >= v for k, v in want.items() if v) for have in totals)

        if fits({k: v for want in wants.values() for k, v in want.items()}):
            return None
        alone = [name for name, want in wants.items() if not fits(want)]
        largest = ", ".join(f"{k} {max((float(t.get(k, 0)) for t in totals), default=0):g}"
                            for want in wants.values() for k, v in want.items() if v)
        return (f"{', '.join(alone or wants)}: no node of the Ray cluster has "
                f"{'that' if alone else 'all of them at once'} (the largest: {largest}); "
                "ask for what a node has, or add such a node")
