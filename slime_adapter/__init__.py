"""slime's side of the rollout buffer: `--rollout-function-path slime_adapter.generate_rollout`.

`generate_rollout` fetches whole groups of trajectories from a running `rollout-buffer serve`, turns them
into slime `Sample`s and returns a training batch (with `evaluation=True`, slime's eval output for its eval
datasets, evaluated by the buffer: `slime_adapter.evaluation`); `add_arguments` registers the adapter's flags on
slime's parser (see `slime_adapter.launch`); `log_raw_info` logs the buffer's statistics under `rollout/`.
"""

from slime_adapter.flags import add_arguments
from slime_adapter.meta_info import log_raw_info
from slime_adapter.rollout import generate_rollout

__all__ = ["add_arguments", "generate_rollout", "log_raw_info"]
