"""A multi-turn, tool-using verifiers environment: the bash harness runs the model's command; the reward is
whether the final answer reports what only running it prints."""

import verifiers.v1 as vf


class ShellData(vf.TaskData):
    expected: str


class ShellTask(vf.Task[ShellData]):
    @vf.reward
    async def reported(self, trace) -> float:
        return 1.0 if self.data.expected in (trace.last_reply or "") else 0.0


class ShellTaskset(vf.Taskset[ShellTask]):
    def load(self):
        for n in (6, 7):
            yield ShellTask(ShellData(id=f"echo-{n}", prompt=f"Run `echo rb-marker-$(({n}*7))` and tell me what it "
                                      "printed.", expected=f"rb-marker-{n * 7}"), self.config.task)


__all__ = ["ShellTaskset"]
