"""A verifiers environment that fails on purpose: `mode: crash_once` kills its worker process in the first
episode of each task (a flag file in `flag_dir` remembers it), `mode: sleep` never ends an episode, `mode: raise`
fails every episode."""

import asyncio
import os
from pathlib import Path

import verifiers.v1 as vf


class FaultConfig(vf.TasksetConfig):
    mode: str = "crash_once"
    flag_dir: str = "/tmp"


class FaultData(vf.TaskData):
    mode: str
    flag_dir: str


class FaultTask(vf.Task[FaultData]):
    async def setup(self, trace, runtime) -> None:
        flag = Path(self.data.flag_dir) / f"{self.data.id}.crashed"
        if self.data.mode == "crash_once" and not flag.exists():
            flag.write_text("1")
            os._exit(3)
        if self.data.mode == "sleep":
            await asyncio.sleep(3600)
        if self.data.mode == "raise":
            raise RuntimeError("the environment's setup failed on purpose")

    @vf.reward
    async def constant(self, trace) -> float:
        return 0.5


class FaultTaskset(vf.Taskset[FaultTask, FaultConfig]):
    def load(self):
        for i in range(2):
            yield FaultTask(FaultData(id=f"fault-{i}", prompt="Say hi.", mode=self.config.mode,
                                      flag_dir=self.config.flag_dir), self.config.task)


__all__ = ["FaultTaskset"]
