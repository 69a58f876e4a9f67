"""Test generator in slime's original style: sync, drives the whole rollout, posts to /buffer/write."""

import httpx

TASK_TYPE = "slime_style"


def run_rollout(data):
    n = int(data["num_repeat_per_sample"])
    with open(data["input_file"]) as f:
        rows = [line for line in f if line.strip()]
    for i, _ in enumerate(rows):
        for k in range(n):
            record = {
                "uid": f"slime-{i}-{k}",
                "instance_id": str(i),
                "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": f"a{k}"}],
                "reward": float(k % 2),
                "extra_info": {},
            }
            httpx.post(f"{data['remote_buffer_url']}/buffer/write", json=record).raise_for_status()
