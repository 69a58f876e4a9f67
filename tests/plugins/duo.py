"""Test generator: a two-agent episode (one planner and two actor records) with one shared reward."""

TASK_TYPE = "duo"


async def run_rollout(item, ctx):
    reward = float(ctx.repeat % 2)  # episodes alternate between success and failure
    def sample(role, weight):
        return {"messages": [{"role": "user", "content": item["prompt"]}, {"role": "assistant", "content": role}],
                "reward": reward * weight,
                "extra_info": {"agent_id": role, "reward_weight": weight, "episode_reward": reward}}
    return [sample("planner", 1.0), sample("actor", 0.5), sample("actor", 0.5)]
