"""A verifiers environment with seats: a `solver` and a `checker` answer each task (both trained, each its own
role), an `observer` answers it too but is not trained (`trainable = False`, as envs mark a modeled user)."""

import verifiers.v1 as vf
from rb_arith import ArithTask, ArithTaskset


class DuoConfig(vf.EnvConfig):
    solver: vf.AgentConfig = vf.AgentConfig()
    checker: vf.AgentConfig = vf.AgentConfig()
    observer: vf.AgentConfig = vf.AgentConfig()


class DuoEnv(vf.Env[DuoConfig]):
    async def setup(self, agents: vf.Agents) -> None:
        agents.observer.trainable = False

    async def run(self, task: ArithTask, agents: vf.Agents) -> None:
        for seat in (agents.solver, agents.checker, agents.observer):
            await seat.run(task)


class DuoTaskset(ArithTaskset):
    pass


__all__ = ["DuoEnv", "DuoTaskset"]
