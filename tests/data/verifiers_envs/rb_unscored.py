"""A verifiers taskset that scores nothing: no reward function, no judge."""

import verifiers.v1 as vf


class UnscoredTaskset(vf.Taskset[vf.Task]):
    def load(self):
        yield vf.Task(vf.TaskData(id="unscored-0", prompt="Say hi."), self.config.task)


__all__ = ["UnscoredTaskset"]
