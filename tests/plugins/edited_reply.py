"""Test generator: edits the assistant's text after generation, so the exact tokens no longer match a
re-render of the messages: every trajectory carries a tokenization mismatch."""

TASK_TYPE = "edited_reply"
REQUIRED_FIELDS = ("prompt",)


async def run_rollout(item, ctx):
    conv = await ctx.conversation([{"role": "user", "content": item["prompt"]}])
    finish = await ctx.generate(conv)
    conv.messages[-1]["content"] += " (edited afterwards)"
    return await ctx.trajectory(conv, 1.0, finish)
