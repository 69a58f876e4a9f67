"""Wire schemas of the HTTP protocol: what slime sends and what it gets back."""

from __future__ import annotations

import math
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, BeforeValidator, ConfigDict, Field, field_validator, model_validator

TrajectoryStatus = Literal["completed", "truncated", "aborted", "failed"]


def _no_bool(value: Any) -> Any:
    # pydantic takes true/false as 1/0 for an int field; a version or a bound given as a boolean is a mistake.
    if isinstance(value, bool):
        raise ValueError("must be an integer, not a boolean")
    return value


# A count or version that must be a non-negative integer; numeric strings ("3", as slime sends numbers) pass.
NonNegativeInt = Annotated[int, BeforeValidator(_no_bool), Field(ge=0)]
PositiveInt = Annotated[int, BeforeValidator(_no_bool), Field(ge=1)]


def check_http_urls(value: str | list[str] | None, what: str = "engine URL") -> None:
    """Raise ValueError unless `value` is None, an http(s) URL or a non-empty list of them; `what` names it."""
    urls = [value] if isinstance(value, str) else (value or [])
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{what} {url!r} must start with http:// or https://")
    if isinstance(value, list) and not value:
        raise ValueError(f"needs at least one {what}")


def _engine_urls(value: str | list[str] | None) -> str | list[str] | None:
    check_http_urls(value)
    return value


# `remote_engine_url`: one router URL, or several engines.
EngineUrls = Annotated[str | list[str] | None, AfterValidator(_engine_urls)]


class TrajectoryRecord(BaseModel):
    """One finished trajectory, as `/buffer/write` takes it and `/get_rollout_data` returns it.

    slime's keys (`uid`, `instance_id`, `messages`, `reward`, `extra_info`) are required; the exact
    token fields are filled when the generator ran in token mode. Unknown keys are kept.
    """

    model_config = ConfigDict(extra="allow")

    uid: str = Field(min_length=1)
    instance_id: str
    messages: list[dict[str, Any]]
    reward: float
    extra_info: dict[str, Any] = Field(default_factory=dict)
    raw_reward: float | None = None
    status: TrajectoryStatus = "completed"
    tokens: list[int] | None = None
    loss_mask: list[int] | None = None
    rollout_log_probs: list[float] | None = None
    response_length: int | None = None
    weight_versions: list[str] | None = None

    @field_validator("instance_id", mode="before")
    @classmethod
    def _instance_id_as_str(cls, v: Any) -> Any:
        # slime's data often has integer ids; the store keys on strings.
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v

    @field_validator("reward", "raw_reward")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        if v is not None and not math.isfinite(v):
            raise ValueError("must be a finite number (NaN and infinity are refused)")
        return v

    @model_validator(mode="after")
    def _token_fields_align(self) -> TrajectoryRecord:
        if self.tokens is not None and self.loss_mask is not None:
            n_mask = len(self.loss_mask)
            if self.response_length is not None and n_mask not in (len(self.tokens), self.response_length):
                raise ValueError("loss_mask must cover all tokens or the last response_length tokens")
        if self.rollout_log_probs is not None and self.response_length is not None:
            if len(self.rollout_log_probs) != self.response_length:
                raise ValueError("rollout_log_probs must have response_length entries")
        return self

    @property
    def epoch(self) -> int:
        """Epoch of the record: `extra_info.epoch`, 0 when absent."""
        try:
            return int(self.extra_info.get("epoch", 0) or 0)
        except (TypeError, ValueError):
            return 0


class StartRolloutRequest(BaseModel):
    """slime's `/start_rollout` payload. Numbers may arrive as strings, as slime sends them."""

    model_config = ConfigDict(extra="allow")

    task_type: str = Field(min_length=1)
    # Required unless the generator runs without input (an `agent` run that only hosts sessions).
    input_file: str | None = Field(default=None, min_length=1)
    num_repeat_per_sample: int = Field(default=8, ge=1, le=4096)
    num_epoch: int = Field(default=1, ge=1)
    num_process: int = Field(default=256, ge=1, le=1_000_000)
    remote_engine_url: EngineUrls = None
    remote_buffer_url: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    tokenizer_path: str | None = None
    skip_instance_ids: list[str] | None = None
    # Group policy: slime's validity rule by default, DAPO dynamic sampling on request.
    drop_zero_variance: bool = False
    normalize_rewards: bool = True
    shuffle: bool = True
    seed: int = 42
    # Fully asynchronous control (README "Staleness and weight versions").
    max_staleness: NonNegativeInt | None = None
    rollout_batch_size: PositiveInt | None = None
    max_ready_groups: PositiveInt | None = None
    regenerate_stale: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    max_abort_requeues: NonNegativeInt = 8
    current_version: NonNegativeInt | None = None

    @field_validator("skip_instance_ids", mode="before")
    @classmethod
    def _ids_as_str(cls, v: Any) -> Any:
        if isinstance(v, list):
            return [str(x) if isinstance(x, int) and not isinstance(x, bool) else x for x in v]
        return v

    @model_validator(mode="after")
    def _staleness_needs_batch(self) -> StartRolloutRequest:
        if self.max_staleness is not None and self.rollout_batch_size is None:
            raise ValueError("rollout_batch_size: required with max_staleness (groups the trainer takes per step)")
        return self

    def engine_urls(self) -> list[str]:
        """The engine URLs as a list (one router, or several engines)."""
        v = self.remote_engine_url
        return [] if v is None else ([v] if isinstance(v, str) else list(v))


class EvalDatasetSpec(BaseModel):
    """One eval dataset of `/start_eval`: its file and what it overrides of the call's defaults."""

    model_config = ConfigDict(extra="forbid")

    path: str = Field(min_length=1)
    n_samples_per_eval_prompt: PositiveInt | None = None
    sampling_params: dict[str, Any] | None = None
    max_tokens: PositiveInt | None = None


class StartEvalRequest(BaseModel):
    """Body of `/start_eval` (or `/start_rollout` with `mode: "eval"`): run named eval datasets at a version.

    `task_type`, `remote_engine_url` and `tokenizer_path` default to the latest run's; generator options
    (extra keys) are taken from that run too, then overridden by this body's.
    """

    model_config = ConfigDict(extra="allow")

    mode: Literal["eval"] = "eval"
    eval_datasets: dict[str, str | EvalDatasetSpec] = Field(min_length=1)
    n_samples_per_eval_prompt: PositiveInt = 1
    eval_num_process: PositiveInt = 32
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    max_tokens: PositiveInt | None = None
    # The trainer's weight version the eval stands for; default: the latest run's trainer version, else 0.
    current_version: NonNegativeInt | None = None
    task_type: str | None = Field(default=None, min_length=1)
    remote_engine_url: EngineUrls = None
    tokenizer_path: str | None = None
    # A sample is correct (for pass@k) when its reward is at least this (slime: reward == 1).
    pass_threshold: float = 1.0

    @field_validator("eval_datasets")
    @classmethod
    def _names(cls, v: dict[str, str | EvalDatasetSpec]) -> dict[str, str | EvalDatasetSpec]:
        for name in v:
            if not name or "/" in name or name != name.strip():
                raise ValueError(f"dataset name {name!r}: must be non-empty, without '/' or surrounding spaces")
        return v

    @field_validator("pass_threshold")
    @classmethod
    def _finite_threshold(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number")
        return v

    def datasets(self) -> dict[str, EvalDatasetSpec]:
        """Every dataset as a spec, the call's defaults filled in."""
        out = {}
        for name, value in self.eval_datasets.items():
            spec = EvalDatasetSpec(path=value) if isinstance(value, str) else value
            out[name] = EvalDatasetSpec(
                path=spec.path,
                n_samples_per_eval_prompt=spec.n_samples_per_eval_prompt or self.n_samples_per_eval_prompt,
                sampling_params={**self.sampling_params, **(spec.sampling_params or {})},
                max_tokens=spec.max_tokens or self.max_tokens,
            )
        return out


class EvalResultsRequest(BaseModel):
    """Body of `/eval_results`: summaries (and records) of evals, waiting up to `wait_s` for them to finish."""

    model_config = ConfigDict(extra="forbid")

    version: NonNegativeInt | None = None  # default: each dataset's newest version
    datasets: list[str] | None = None
    wait_s: float = Field(default=0.0, ge=0.0, le=600.0)
    records: bool = False


# A role stream's name: a record's `extra_info.agent_id`.
AgentId = Annotated[str, Field(min_length=1, max_length=128)]


class GetRolloutDataRequest(BaseModel):
    """Body of `/get_rollout_data`; slime's original client sends `{}`."""

    model_config = ConfigDict(extra="ignore")

    max_groups: int | None = Field(default=None, ge=1)
    wait_s: float = Field(default=0.0, ge=0.0, le=600.0)
    lease_s: float | None = Field(default=None, gt=0.0, le=86_400.0)
    ack: str | None = None
    # The trainer's weight version now (slime: its rollout id); numeric strings accepted.
    current_version: NonNegativeInt | None = None
    order: Literal["oldest", "newest"] = "oldest"
    # A role stream (plan/act's "planner" / "actor"): only that role's records, its own leases and counters.
    agent_id: AgentId | None = None


class TrainerVersionRequest(BaseModel):
    """Body of `/trainer_version`: the trainer updated its weights without fetching."""

    current_version: NonNegativeInt
    # A trainer restarted from an older checkpoint reports an older version on purpose.
    rewind: bool = False
    agent_id: AgentId | None = None  # the version of this role's trainer (role streams)


class AckRequest(BaseModel):
    """Body of `/ack`."""

    batch_id: str = Field(min_length=1)
    agent_id: AgentId | None = None  # the stream the batch was fetched from


class OpenSessionRequest(BaseModel):
    """Body of `POST /sessions`: a harness opens an agent session in the running agent run."""

    kind: Literal["harness"] = "harness"
    instance_id: str = Field(min_length=1)
    run_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)

    @field_validator("instance_id", mode="before")
    @classmethod
    def _instance_id_as_str(cls, v: Any) -> Any:
        return str(v) if isinstance(v, int) and not isinstance(v, bool) else v


class OpenGeneratorSessionRequest(BaseModel):
    """Body of `POST /sessions` with `kind: generator`: a Ray actor of the `ray` executor opens the session of one
    trajectory the run gave it; the buffer's proxy generates its turns, and its records go back to the actor
    (`/sessions/{id}/close`), which returns them to the runner as the trajectory's outcome."""

    kind: Literal["generator"]
    run_id: str = Field(min_length=1)
    uid: str = Field(min_length=1)
    instance_id: str = Field(min_length=1)
    epoch: NonNegativeInt
    repeat: NonNegativeInt
    metadata: dict[str, Any] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _uid_of_the_run(self) -> OpenGeneratorSessionRequest:
        if not self.uid.startswith(f"{self.run_id}:"):
            raise ValueError(f"uid {self.uid!r} is not a trajectory of run {self.run_id!r} (uids start with "
                             "'{run_id}:')")
        return self


class DiscardSessionRequest(BaseModel):
    """Body of `POST /sessions/{session_id}/discard`: close a generator's session without records."""

    reason: str = Field(min_length=1, max_length=4000)


class FinishSessionRequest(BaseModel):
    """Body of `POST /sessions/{session_id}/finish`: the episode's reward, shared by every branch."""

    reward: float
    extra_info: dict[str, Any] = Field(default_factory=dict)

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        if not math.isfinite(v):
            raise ValueError("must be a finite number (NaN and infinity are refused)")
        return v
