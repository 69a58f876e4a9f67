"""The adapter's command-line flags, and the typed settings `generate_rollout` reads from slime's args."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from slime_adapter.client import RetryPolicy
from slime_adapter.loss_mask import LOSS_MASK_TYPES

AUTH_TOKEN_ENV = "ROLLOUT_BUFFER_AUTH_TOKEN"
DEFAULT_LEASE_S = 300.0
DEFAULT_WAIT_S = 30.0
MAX_WAIT_S = 600.0  # the buffer's limit on one long-poll
DEFAULT_BACKOFF_S = 1.0
DEFAULT_NUM_PROCESS = 256
DEFAULT_TASK_TYPE = "math"
DEFAULT_EVAL_NUM_PROCESS = 64
DEFAULT_LEAD_ROLE = "planner"

# (option strings, add_argument keywords). Option strings a parser already has are skipped, so slime's own
# definitions (e.g. its --rollout-buffer-url, --loss-mask-type) win and nothing clashes.
ADAPTER_FLAGS: tuple[tuple[tuple[str, ...], dict[str, Any]], ...] = (
    (
        ("--agent-rollout-buffer-url", "--rollout-buffer-url"),
        {"dest": "agent_rollout_buffer_url", "type": str, "default": None,
         "help": "Base URL of the rollout buffer, e.g. http://127.0.0.1:8889"},
    ),
    (
        ("--fetch-trajectory-retry-times",),
        {"type": int, "default": -1,
         "help": "Retries of a failing buffer request (consecutive failures) before giving up; -1: no limit"},
    ),
    (
        ("--loss-mask-type",),
        {"type": str, "default": "qwen", "choices": list(LOSS_MASK_TYPES),
         "help": "Loss mask algorithm for records that carry messages but no exact tokens"},
    ),
    (
        ("--rollout-task-type",),
        {"type": str, "default": DEFAULT_TASK_TYPE, "help": "Generator (TASK_TYPE) the buffer runs"},
    ),
    (
        ("--rollout-num-process",),
        {"type": int, "default": DEFAULT_NUM_PROCESS,
         "help": "Trajectories the buffer generates concurrently"},
    ),
    (
        ("--eval-num-process",),
        {"type": int, "default": DEFAULT_EVAL_NUM_PROCESS,
         "help": "Eval trajectories the buffer generates concurrently, beside (never instead of) training's"},
    ),
    (
        ("--rollout-buffer-lease-s",),
        {"type": float, "default": DEFAULT_LEASE_S,
         "help": "Lease of fetched groups: unacked ones are delivered again after it; 0 disables leasing"},
    ),
    (
        ("--rollout-buffer-wait-s",),
        {"type": float, "default": DEFAULT_WAIT_S,
         "help": "Long-poll wait of one fetch when nothing is ready (at most 600)"},
    ),
    (
        ("--rollout-buffer-backoff-s",),
        {"type": float, "default": DEFAULT_BACKOFF_S,
         "help": "First retry delay after a failed request; doubles per failure up to 30s"},
    ),
    (
        ("--rollout-buffer-token",),
        {"type": str, "default": None, "help": f"Bearer token of the buffer (default: ${AUTH_TOKEN_ENV})"},
    ),
    (
        ("--rollout-max-staleness",),
        {"type": int, "default": None,
         "help": "Bound the version lag of training data (AReaL's max_head_offpolicyness): the buffer starts at "
                 "most (η+1) rollout batches ahead of the trainer and drops data more than η versions old"},
    ),
    (
        ("--rollout-max-ready-groups",),
        {"type": int, "default": None,
         "help": "Pause generation while this many complete groups wait for the trainer (memory cap)"},
    ),
    (
        ("--rollout-regenerate-stale",),
        {"action": "store_true", "default": False,
         "help": "Generate groups dropped as stale again instead of only counting them"},
    ),
    (
        ("--rollout-buffer-role",),
        {"type": str, "default": None,
         "help": "Train one role of a multi-agent run (plan_act: planner or actor): fetch only that role's "
                 "records (the buffer's agent_id stream) and report this trainer's version for that role"},
    ),
    (
        ("--rollout-buffer-role-engine-url",),
        {"action": "append", "default": [], "metavar": "ROLE=URL",
         "help": "With --rollout-buffer-role, on the lead role's trainer: another role's router (e.g. "
                 "actor=http://10.0.0.2:30000), passed on as the run's <role>_engine_url; repeatable. The lead "
                 "role's own turns go to this trainer's router"},
    ),
    (
        ("--rollout-buffer-lead-role",),
        {"type": str, "default": DEFAULT_LEAD_ROLE,
         "help": "With --rollout-buffer-role: the role whose trainer starts the run; the others wait for it"},
    ),
    (
        # slime's own flag (slime/utils/arguments.py); registered here only when slime's parser lacks it.
        ("--mask-offpolicy-in-partial-rollout",),
        {"action": "store_true", "default": False,
         "help": "Loss 0 on tokens generated with older weights than the trajectory's newest"},
    ),
)


def add_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Register the adapter's flags on `parser`, skipping option strings it already has."""
    existing = parser._option_string_actions  # argparse's own registry of option strings
    for option_strings, kwargs in ADAPTER_FLAGS:
        free = [s for s in option_strings if s not in existing]
        if free:
            parser.add_argument(*free, **kwargs)
    return parser


@dataclass(frozen=True)
class AdapterSettings:
    """What `generate_rollout` needs from slime's args, validated once."""

    buffer_url: str
    retry: RetryPolicy
    lease_s: float | None
    wait_s: float
    token: str | None
    loss_mask_type: str
    task_type: str
    num_process: int
    eval_num_process: int = DEFAULT_EVAL_NUM_PROCESS
    max_staleness: int | None = None
    max_ready_groups: int | None = None
    regenerate_stale: bool = False
    mask_offpolicy: bool = False
    role: str | None = None  # the role stream this trainer consumes (None: whole groups, every role)
    lead_role: str = DEFAULT_LEAD_ROLE
    role_engine_urls: tuple[tuple[str, str], ...] = ()  # (role, router URL) of other roles' engines

    @property
    def starts_run(self) -> bool:
        """Whether this trainer may start the buffer's run: without a role, or as the lead role."""
        return self.role is None or self.role == self.lead_role

    @classmethod
    def from_args(cls, args: Any) -> AdapterSettings:
        """Read the flags (either URL flag; defaults for flags the parser never registered)."""
        url = getattr(args, "agent_rollout_buffer_url", None) or getattr(args, "rollout_buffer_url", None)
        if not url:
            raise ValueError("set --agent-rollout-buffer-url (or --rollout-buffer-url) to the buffer's URL")
        lease_s = float(getattr(args, "rollout_buffer_lease_s", DEFAULT_LEASE_S) or 0.0)
        wait_s = float(getattr(args, "rollout_buffer_wait_s", DEFAULT_WAIT_S))
        if not 0 <= wait_s <= MAX_WAIT_S:
            raise ValueError(f"--rollout-buffer-wait-s must be between 0 and {MAX_WAIT_S:g}")
        retries = getattr(args, "fetch_trajectory_retry_times", -1)
        max_staleness = getattr(args, "rollout_max_staleness", None)
        if max_staleness is not None and int(max_staleness) < 0:
            raise ValueError("--rollout-max-staleness must be 0 or more")
        role = getattr(args, "rollout_buffer_role", None)
        if role is not None and not str(role).strip():
            raise ValueError("--rollout-buffer-role must name a role (e.g. planner or actor)")
        engines = []
        for spec in getattr(args, "rollout_buffer_role_engine_url", None) or []:
            name, sep, engine_url = str(spec).partition("=")
            if not sep or not name.strip() or not engine_url.strip().startswith(("http://", "https://")):
                raise ValueError(f"--rollout-buffer-role-engine-url: {spec!r} is not ROLE=http://HOST:PORT")
            engines.append((name.strip(), engine_url.strip()))
        return cls(
            buffer_url=url,
            retry=RetryPolicy(
                retries=-1 if retries is None else int(retries),
                backoff_s=float(getattr(args, "rollout_buffer_backoff_s", DEFAULT_BACKOFF_S)),
            ),
            lease_s=lease_s if lease_s > 0 else None,
            wait_s=wait_s,
            token=getattr(args, "rollout_buffer_token", None) or os.environ.get(AUTH_TOKEN_ENV) or None,
            loss_mask_type=getattr(args, "loss_mask_type", None) or "qwen",
            task_type=getattr(args, "rollout_task_type", None) or DEFAULT_TASK_TYPE,
            num_process=int(getattr(args, "rollout_num_process", None) or DEFAULT_NUM_PROCESS),
            eval_num_process=int(getattr(args, "eval_num_process", None) or DEFAULT_EVAL_NUM_PROCESS),
            max_staleness=None if max_staleness is None else int(max_staleness),
            max_ready_groups=getattr(args, "rollout_max_ready_groups", None),
            regenerate_stale=bool(getattr(args, "rollout_regenerate_stale", False)),
            mask_offpolicy=bool(getattr(args, "mask_offpolicy_in_partial_rollout", False)),
            role=None if role is None else str(role).strip(),
            lead_role=getattr(args, "rollout_buffer_lead_role", None) or DEFAULT_LEAD_ROLE,
            role_engine_urls=tuple(engines),
        )
