"""The `rollout-buffer` console script and `python -m rollout_buffer.cli`; the command lives in `tools.cli`."""

from rollout_buffer.tools.cli import DELEGATED, main

__all__ = ["DELEGATED", "main"]

if __name__ == "__main__":
    main()
