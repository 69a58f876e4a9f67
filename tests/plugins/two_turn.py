"""Test generator: two assistant turns with a tool observation between them (loss 0)."""

TASK_TYPE = "two_turn"
REQUIRED_FIELDS = ("prompt",)


async def run_rollout(item, ctx):
    conv = await ctx.conversation([{"role": "user", "content": item["prompt"]}])
    finish = await ctx.generate(conv)
    if finish == "stop":
        await conv.aadd_messages([{"role": "tool", "content": "observation: the tool says 7"}])
        finish = await ctx.generate(conv)
    return await ctx.trajectory(conv, 1.0 if finish == "stop" else 0.0, finish)
