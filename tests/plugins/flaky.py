"""Test generator: raises for odd repeats, so failures are recorded and counted."""

TASK_TYPE = "flaky"


async def run_rollout(item, ctx):
    if ctx.repeat % 2:
        raise RuntimeError(f"tool exploded on repeat {ctx.repeat}")
    conv = await ctx.conversation([{"role": "user", "content": item["prompt"]}])
    finish = await ctx.generate(conv)
    return await ctx.trajectory(conv, 1.0, finish)
