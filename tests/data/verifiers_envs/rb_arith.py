"""A single-turn verifiers environment (verifiers' own classes): sums, scored on the boxed answer."""

import re

import verifiers.v1 as vf


class ArithData(vf.TaskData):
    answer: str


class ArithTask(vf.Task[ArithData]):
    @vf.reward
    async def correct(self, trace) -> float:
        found = re.findall(r"\\boxed\{([^}]*)\}", trace.last_reply or "")
        return 1.0 if found and found[-1].strip() == self.data.answer else 0.0

    @vf.metric
    async def reply_chars(self, trace) -> float:
        return float(len(trace.last_reply or ""))


class ArithTaskset(vf.Taskset[ArithTask]):
    def load(self):
        for a, b in [(2, 3), (4, 5), (7, 8)]:
            yield ArithTask(ArithData(id=f"sum-{a}-{b}", prompt=f"What is {a} + {b}? Put the answer in \\boxed{{}}.",
                                      answer=str(a + b)), self.config.task)


__all__ = ["ArithTaskset"]
