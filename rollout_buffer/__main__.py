"""`python -m rollout_buffer`: the `rollout-buffer` command (`tools.cli`)."""

from rollout_buffer.tools.cli import main

main()
