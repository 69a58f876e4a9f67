"""Command-line tools: the `rollout-buffer` command (`cli`), the demo, `status` and `export`.

The top room: may import any room, `generators` and `slime_adapter` (the demo drives the adapter).
"""
