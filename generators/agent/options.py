"""Run options of the agent generator (extra keys of `/start_rollout`) and their checks at start."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from generators.agent.loading import check_reference
from generators.agent.sandbox import check_image
from rollout_buffer.generator_api import Governed, Policy, RunOptions

MiB = 1024 * 1024


class AgentOptions(RunOptions):
    """How an `agent` run runs its agents (see README "Agents")."""

    error_prefix: ClassVar[str] = "agent run options"

    agent: Annotated[str | None, Governed("code")] = Field(default=None, min_length=1,
                                                          description="path/file.py:function or module:function")
    # In a container the program is the image's, which `agent_image` governs.
    agent_command: Annotated[list[str] | None, Governed("program", unless=("agent_sandbox", "docker"))] = Field(
        default=None, min_length=1, description="a subprocess per row")
    agent_timeout_s: float = Field(default=600.0, gt=0)
    agent_max_output_bytes: int = Field(default=MiB, ge=1024, description="kept of stdout and of stderr each")
    agent_sandbox: Literal["local", "docker"] = "local"
    agent_network: Annotated[Literal["auto", "isolated", "host"], Governed("network", fill=True)] = "auto"
    agent_user: Annotated[str | None, Governed("user", fill=True)] = Field(default=None, min_length=1)
    agent_image: Annotated[str | None, Governed("image")] = Field(default=None, min_length=1,
                                                                  description="container image (docker sandbox)")
    agent_env: Annotated[dict[str, str], Governed("child_env")] = Field(default_factory=dict)
    # Agents running at once in one process running them: the buffer, or each Ray actor (with `ray_num_cpus`, the
    # CPUs an actor's agents share). None: as many as `num_process` lets in.
    agent_max_running: int | None = Field(default=None, ge=1)
    agent_workdir_root: Annotated[str | None, Governed("workdir")] = None
    scorer: Annotated[str, Governed("code")] = Field(default="auto", min_length=1,
                                                     description="auto, math, em, or file.py:score / module:score")
    reward_timeout_s: float = Field(default=30.0, gt=0)

    @field_validator("agent_command")
    @classmethod
    def _arguments(cls, v: list[str] | None) -> list[str] | None:
        if v is not None and not v[0]:
            raise ValueError("the command's first argument (the program) is empty")
        return v

    @model_validator(mode="after")
    def _one_kind(self) -> AgentOptions:
        if self.agent is not None and self.agent_command is not None:
            raise ValueError("give `agent` or `agent_command`, not both")
        if self.agent_sandbox == "docker" and self.agent_command is not None and self.agent_image is None:
            raise ValueError("agent_sandbox docker needs agent_image")
        if self.agent_sandbox == "docker" and self.agent_network == "host":
            raise ValueError("agent_network host is not available with agent_sandbox docker (its containers have "
                             "no network but their session)")
        return self

    @property
    def runs_agents(self) -> bool:
        """False for a run that only hosts sessions opened by a harness."""
        return self.agent is not None or self.agent_command is not None

    @property
    def hook_scorer(self) -> bool:
        """True when `scorer` names a `score(item, workdir, transcript)` function."""
        return self.scorer not in ("auto", "math", "em")


def check_payload(payload: dict[str, Any], policy: Policy) -> None:
    """The start-time checks of an agent run; ValueError naming the field (the server answers 422). The server's
    policy has allowed the code it names already; here the `agent` callable and a scorer hook load, and
    `agent_command`'s program exists. The docker sandbox needs an engine holding `agent_image` (blocking: called
    in a thread)."""
    opts = AgentOptions.from_run(payload)
    if not payload.get("tokenizer_path"):
        raise ValueError("tokenizer_path: agent runs capture exact tokens and need the model's tokenizer")
    if opts.agent is not None:
        check_reference(opts.agent, "agent")
    if opts.hook_scorer:
        check_reference(opts.scorer, "scorer")
    if opts.agent_command is not None and opts.agent_sandbox == "local":
        program = opts.agent_command[0]
        if (program if os.sep in program else shutil.which(program)) is None:
            raise ValueError(f"agent_command: program {program!r} not found")
    if opts.agent_command is not None and opts.agent_sandbox == "docker":
        check_image(opts.agent_image or "")
    if opts.agent_workdir_root is not None and not Path(opts.agent_workdir_root).is_dir():
        raise ValueError(f"agent_workdir_root: {opts.agent_workdir_root} is not a folder")
