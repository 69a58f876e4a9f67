"""Test generator that cannot work: every trajectory raises, as with a generator missing a dependency."""

TASK_TYPE = "broken"


async def run_rollout(item, ctx):
    raise RuntimeError("the grader needs a key this machine does not have")
