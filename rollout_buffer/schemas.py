"""Wire schemas of the HTTP protocol: what slime sends and what it gets back."""

from __future__ import annotations

import binascii
import difflib
import math
from typing import Annotated, Any, Literal, Required, TypedDict

import numpy as np
import pybase64
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    WithJsonSchema,
    field_validator,
    model_validator,
)

from rollout_buffer.policy import MAX_URLS, REDACTED, Governed, is_secret_name

TrajectoryStatus = Literal["completed", "truncated", "aborted", "failed"]


def _wire_int(value: Any) -> Any:
    # slime sends counts as numeric strings ("8"); a boolean for a count or version is a mistake (pydantic
    # would take true as 1).
    if isinstance(value, bool):
        raise ValueError("must be an integer, not a boolean")
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return value


# The store keeps integers as SQLite's 64-bit ones.
INT64_MAX = 2**63 - 1
# The largest reward (in magnitude) a record, an episode or a reward weight may carry: far beyond any reward
# function's range, far below where the sums and squares of a group's rewards overflow a float.
REWARD_LIMIT = 1e6


def check_reward(value: float | None) -> float | None:
    """`value` unless it is NaN, infinite or beyond ±REWARD_LIMIT (ValueError saying so)."""
    if value is not None and not -REWARD_LIMIT <= value <= REWARD_LIMIT:
        raise ValueError(f"must be a finite number within ±{REWARD_LIMIT:g} (reward_out_of_range)")
    return value


def _int_schema(ge: int, le: int = INT64_MAX) -> WithJsonSchema:
    """The documented form of a wire integer: a JSON integer in bounds, or its decimal digits as a string."""
    bounds = {"minimum": ge, "maximum": le}
    return WithJsonSchema({"anyOf": [{"type": "integer", **bounds}, {"type": "string", "pattern": "^[0-9]+$"}]})


# Counts and versions: an integer, or its digits as a string (as slime sends numbers). Request models are strict
# otherwise, so what they accept is what the OpenAPI document says.
NonNegativeInt = Annotated[int, BeforeValidator(_wire_int), Field(ge=0, le=INT64_MAX), _int_schema(0)]
PositiveInt = Annotated[int, BeforeValidator(_wire_int), Field(ge=1, le=INT64_MAX), _int_schema(1)]
# A whole number (a seed): any sign.
WireInt = Annotated[int, BeforeValidator(_wire_int), Field(ge=-INT64_MAX - 1, le=INT64_MAX),
                    _int_schema(-INT64_MAX - 1)]
# A non-empty string.
Text = Annotated[str, Field(min_length=1)]


def _id_as_str(value: Any) -> Any:
    # slime's data often has integer ids; the store keys on strings.
    return str(value) if isinstance(value, int) and not isinstance(value, bool) else value


# An id slime's data may give as an integer: stored as its string.
Id = Annotated[str, BeforeValidator(_id_as_str), Field(min_length=1),
               WithJsonSchema({"anyOf": [{"type": "string", "minLength": 1}, {"type": "integer"}]})]
# A role stream's name: a record's `extra_info.agent_id`.
AgentId = Annotated[str, Field(min_length=1, max_length=128)]
# An eval dataset's name: non-empty, no '/', no surrounding spaces.
DatasetName = Annotated[str, Field(pattern=r"^[^/\s](?:[^/]*[^/\s])?$")]
# Request bodies: no silent coercion (true is no 1, "1.5" no number) beyond the wire integers above.
STRICT = ConfigDict(strict=True)


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
    if isinstance(value, list) and len(value) > MAX_URLS:
        raise ValueError(f"{len(value)} engine URLs; a run names at most {MAX_URLS} (a router, or its engines)")
    return value


# `remote_engine_url`: one router URL, or several engines.
EngineUrls = Annotated[str | list[str] | None, AfterValidator(_engine_urls)]


def _int32_bytes(value: Any) -> Any:
    # Side data arrives as SGLang encodes it (base64 of little-endian int32), as lists of ints (nested: rows of
    # routed experts), or as the bytes a conversation keeps.
    if isinstance(value, bytes):
        data = value
    elif isinstance(value, bytearray | memoryview):
        data = bytes(value)
    elif isinstance(value, str):
        try:
            data = pybase64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ValueError(f"must be base64 of little-endian int32 ({e})") from None
    elif isinstance(value, list):
        try:
            wide = np.asarray(value)
        except ValueError:
            raise ValueError("must be a list of integers (rows of equal length)") from None
        if wide.size and (wide.dtype.kind not in "iu" or wide.min() < -(2**31) or wide.max() >= 2**31):
            raise ValueError("must hold int32 values")
        data = wide.astype("<i4").tobytes()
    else:
        raise ValueError("must be base64 of little-endian int32 or a list of integers")
    if len(data) % 4:
        raise ValueError(f"{len(data)} bytes are not whole int32 values")
    return data


# Per-token side data (routed experts, top-p kept ids): little-endian int32 bytes, base64 on the wire.
Int32Bytes = Annotated[bytes, BeforeValidator(_int32_bytes),
                       WithJsonSchema({"type": "string", "contentEncoding": "base64",
                                       "description": "little-endian int32 values (or a list of integers)"})]


class ImageRef(BaseModel):
    """An image a record's tokens hold (`GET /images/{sha256}` serves it)."""

    model_config = ConfigDict(extra="forbid")

    sha256: Annotated[str, Field(pattern=r"^[0-9a-f]{64}$")]
    media_type: Annotated[str, Field(pattern=r"^image/[a-z0-9.+-]+$")]
    width: Annotated[int, Field(ge=1)]
    height: Annotated[int, Field(ge=1)]


class TrajectoryRecord(BaseModel):
    """One finished trajectory, as `/buffer/write` takes it and `/get_rollout_data` returns it.

    slime's keys (`uid`, `instance_id`, `messages`, `reward`, `extra_info`) are required; the exact
    token fields are filled when the generator ran in token mode. Unknown keys are kept.
    """

    # Not strict itself: generators' own records (numpy numbers, tuples) are validated with it too. A record sent
    # over HTTP is validated strictly (`server.bodies.validated`).
    model_config = ConfigDict(extra="allow", ser_json_bytes="base64", json_schema_extra={"examples": [{
        "uid": "run-1:q7:0:0", "instance_id": "q7", "reward": 1.0, "extra_info": {"epoch": 0},
        "messages": [{"role": "user", "content": "What is 2 + 3?"}, {"role": "assistant", "content": "5"}],
    }]})

    uid: Text
    instance_id: Id
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
    # The trajectory every record of it names: a session's branches, an episode's agents (slime's `rollout_id`).
    rollout_id: str | None = None
    # What the trainer replays (docs/consistency.md): a teacher's log-prob of each response token; the experts each
    # token but the last was routed to (`len(tokens) - 1` rows); the ids top-p kept for each response token
    # (`rollout_top_p_token_offsets`: response_length + 1 of them into `rollout_top_p_token_ids`).
    teacher_log_probs: list[float] | None = None
    # The images its tokens hold, in the order of their placeholders; its messages' image parts name them by hash.
    images: list[ImageRef] | None = None
    rollout_routed_experts: Int32Bytes | None = None
    rollout_top_p_token_ids: Int32Bytes | None = None
    rollout_top_p_token_offsets: Int32Bytes | None = None

    @field_validator("reward", "raw_reward")
    @classmethod
    def _finite(cls, v: float | None) -> float | None:
        return check_reward(v)

    @model_validator(mode="after")
    def _token_fields_align(self) -> TrajectoryRecord:
        if self.tokens is not None and self.loss_mask is not None:
            n_mask = len(self.loss_mask)
            if self.response_length is not None and n_mask not in (len(self.tokens), self.response_length):
                raise ValueError("loss_mask must cover all tokens or the last response_length tokens")
        if self.rollout_log_probs is not None and self.response_length is not None:
            if len(self.rollout_log_probs) != self.response_length:
                raise ValueError("rollout_log_probs must have response_length entries")
        if self.teacher_log_probs is not None and self.response_length is not None:
            if len(self.teacher_log_probs) != self.response_length:
                raise ValueError("teacher_log_probs must have response_length entries")
        self._side_data_aligns()
        return self

    def _side_data_aligns(self) -> None:
        rows = None if self.tokens is None else max(0, len(self.tokens) - 1)
        experts = self.rollout_routed_experts
        if experts is not None and rows is not None and (len(experts) % (4 * rows) if rows else len(experts)):
            raise ValueError(f"rollout_routed_experts: {len(experts) // 4} values are not rows for the {rows} "
                             "tokens before the last")
        ids, offsets = self.rollout_top_p_token_ids, self.rollout_top_p_token_offsets
        if (ids is None) != (offsets is None):
            raise ValueError("rollout_top_p_token_ids and rollout_top_p_token_offsets come together")
        if ids is not None and offsets is not None:
            ends = np.frombuffer(offsets, dtype="<i4")
            if self.response_length is not None and len(ends) != self.response_length + 1:
                raise ValueError(f"rollout_top_p_token_offsets: {len(ends)} for response_length "
                                 f"{self.response_length} (it needs response_length + 1)")
            if not len(ends) or ends[0] != 0 or ends[-1] != len(ids) // 4 or np.any(np.diff(ends) < 0):
                raise ValueError("rollout_top_p_token_offsets: must go from 0 up to the count of "
                                 "rollout_top_p_token_ids, never back")

    @property
    def epoch(self) -> int:
        """Epoch of the record: `extra_info.epoch`, 0 when absent."""
        try:
            return int(self.extra_info.get("epoch", 0) or 0)
        except (TypeError, ValueError):
            return 0


class Trajectory(TypedDict, total=False):
    """What a native generator's `run_rollout` returns for one trajectory (or a list of them, one per agent of an
    episode), as `RolloutContext.trajectory` builds it: a `TrajectoryRecord` but for what the runner fills in (`uid`,
    `instance_id`, `rollout_id` and the run's part of `extra_info`), which a generator may set itself. Keys beyond
    these are kept in the record as they are."""

    messages: Required[list[dict[str, Any]]]
    reward: Required[float]
    status: TrajectoryStatus
    extra_info: dict[str, Any]
    uid: str
    instance_id: str
    rollout_id: str
    raw_reward: float
    tokens: list[int]
    loss_mask: list[int]
    rollout_log_probs: list[float]
    response_length: int
    weight_versions: list[str]
    teacher_log_probs: list[float]
    images: list[dict[str, Any]]
    rollout_routed_experts: bytes
    rollout_top_p_token_ids: bytes
    rollout_top_p_token_offsets: bytes
    tools: list[dict[str, Any]]  # chat mode: the tool schemas the engine saw, for the trainer's loss mask


class StartRolloutRequest(BaseModel):
    """slime's `/start_rollout` payload. Numbers may arrive as strings, as slime sends them."""

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"examples": [{
        "task_type": "math", "input_file": "/data/math.jsonl", "num_repeat_per_sample": "8", "num_epoch": "1",
        "num_process": "256", "remote_engine_url": "http://127.0.0.1:30000", "max_tokens": "1024",
        "sampling_params": {"temperature": 1.0, "top_p": 1.0}, "tokenizer_path": "/models/Qwen3-4B",
    }]})

    task_type: Text
    # Required unless the generator runs without input (an `agent` run that only hosts sessions).
    input_file: Annotated[Text | None, Governed("read")] = None
    num_repeat_per_sample: Annotated[int, BeforeValidator(_wire_int), Field(ge=1, le=4096), _int_schema(1, 4096)] = 8
    num_epoch: PositiveInt = 1
    num_process: Annotated[int, BeforeValidator(_wire_int), Field(ge=1, le=1_000_000), _int_schema(1, 1_000_000)] = 256
    remote_engine_url: Annotated[EngineUrls, Governed("urls")] = None
    # slime's URL of the buffer; a slime-style generator posts its records to this server whatever it says.
    remote_buffer_url: str | None = None
    max_tokens: PositiveInt | None = None
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    tokenizer_path: Annotated[str | None, Governed("read")] = None
    skip_instance_ids: list[Id] | None = None
    # Group policy: slime's validity rule by default, DAPO dynamic sampling on request.
    drop_zero_variance: bool = False
    normalize_rewards: bool = True
    shuffle: bool = True
    seed: WireInt = 42
    # Fully asynchronous control (README "Staleness and weight versions").
    max_staleness: NonNegativeInt | None = None
    rollout_batch_size: PositiveInt | None = None
    max_ready_groups: PositiveInt | None = None
    regenerate_stale: bool = False
    mask_offpolicy_in_partial_rollout: bool = False
    max_abort_requeues: NonNegativeInt = 8
    current_version: NonNegativeInt | None = None

    def near_misses(self, run_options: dict[str, Any]) -> list[str]:
        """Warnings for the payload's extra keys spelled like one of its options (`num_repeats_per_sample`) or like
        one of the `run_options` (a generator's, the sessions', the executor's: name -> default) without being
        one: a generator may read any key, so they are kept, but such a key most likely leaves the option it was
        meant for at its default."""
        own, extra = type(self).model_fields, self.model_extra or {}
        known = [*own, *run_options]
        warnings = []
        for key in extra:
            if key in run_options or not (close := difflib.get_close_matches(key, known, n=1, cutoff=0.85)):
                continue
            name = close[0]
            value = getattr(self, name) if name in own else extra.get(name, run_options[name])
            value = REDACTED if is_secret_name(name) and value else value
            warnings.append(f"{key}: not an option of /start_rollout; did you mean {name}? (kept for the generator; "
                            f"{name} stays {value!r})")
        return warnings

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
    """One eval dataset of `/start_eval`: its file and what it overrides of the call's defaults.

    Without `path`, a generator that lists its own input (an environment's taskset) lists it; `options` are
    generator options of this dataset alone (e.g. another environment's `env_id` and `env_args`).
    """

    model_config = ConfigDict(extra="forbid", strict=True)

    path: Text | None = None
    n_samples_per_eval_prompt: PositiveInt | None = None
    sampling_params: dict[str, Any] | None = None
    max_tokens: PositiveInt | None = None
    options: dict[str, Any] | None = None


class StartEvalRequest(BaseModel):
    """Body of `/start_eval` (or `/start_rollout` with `mode: "eval"`): run named eval datasets at a version.

    `task_type`, `remote_engine_url` and `tokenizer_path` default to the latest run's; generator options
    (extra keys) are taken from that run too, then overridden by this body's.
    """

    model_config = ConfigDict(extra="allow", strict=True, json_schema_extra={"examples": [{
        "eval_datasets": {"aime": "/data/aime.jsonl", "gsm8k": {"path": "/data/gsm8k.jsonl", "max_tokens": 512}},
        "n_samples_per_eval_prompt": 4, "current_version": 3,
    }]})

    mode: Literal["eval"] = "eval"
    eval_datasets: dict[DatasetName, Text | EvalDatasetSpec] = Field(min_length=1)
    n_samples_per_eval_prompt: PositiveInt = 1
    eval_num_process: PositiveInt = 32
    sampling_params: dict[str, Any] = Field(default_factory=dict)
    max_tokens: PositiveInt | None = None
    # The trainer's weight version the eval stands for; default: the latest run's trainer version, else 0.
    current_version: NonNegativeInt | None = None
    task_type: Text | None = None
    remote_engine_url: Annotated[EngineUrls, Governed("urls")] = None
    tokenizer_path: Annotated[str | None, Governed("read")] = None
    # A sample is correct (for pass@k) when its reward is at least this (slime: reward == 1).
    pass_threshold: float = 1.0

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
                options=spec.options,
            )
        return out


class EvalResultsRequest(BaseModel):
    """Body of `/eval_results`: summaries (and records) of evals, waiting up to `wait_s` for them to finish."""

    model_config = ConfigDict(extra="forbid", strict=True)

    version: NonNegativeInt | None = None  # default: each dataset's newest version
    datasets: list[str] | None = None
    wait_s: float = Field(default=0.0, ge=0.0, le=600.0)
    records: bool = False




class GetRolloutDataRequest(BaseModel):
    """Body of `/get_rollout_data`; slime's original client sends `{}`."""

    model_config = ConfigDict(extra="ignore", strict=True, json_schema_extra={"examples": [
        {"max_groups": 4, "wait_s": 30, "lease_s": 600, "current_version": 12}, {}]})

    max_groups: PositiveInt | None = None
    wait_s: float = Field(default=0.0, ge=0.0, le=600.0)
    lease_s: float | None = Field(default=None, gt=0.0, le=86_400.0)
    ack: str | None = None
    # The trainer's weight version now (slime: its rollout id); numeric strings accepted.
    current_version: NonNegativeInt | None = None
    order: Literal["oldest", "newest"] = "oldest"
    # A role stream (plan/act's "planner" / "actor"): only that role's records, its own leases and counters.
    agent_id: AgentId | None = None
    # The run to fetch from; default: the current run (an earlier run's leftovers only when named here).
    run_id: Text | None = None


class TrainerVersionRequest(BaseModel):
    """Body of `/trainer_version`: the trainer updated its weights without fetching."""

    model_config = STRICT

    current_version: NonNegativeInt
    # A trainer restarted from an older checkpoint reports an older version on purpose.
    rewind: bool = False
    agent_id: AgentId | None = None  # the version of this role's trainer (role streams)


class AckRequest(BaseModel):
    """Body of `/ack`."""

    model_config = STRICT

    batch_id: str = Field(min_length=1)
    agent_id: AgentId | None = None  # the stream the batch was fetched from


class OpenSessionRequest(BaseModel):
    """Body of `POST /sessions`: a harness opens an agent session in the running agent run."""

    model_config = ConfigDict(strict=True, json_schema_extra={"examples": [{"instance_id": "task-17"}]})

    kind: Literal["harness"] = "harness"
    instance_id: Id
    run_id: str | None = None
    metadata: dict[str, Any] = Field(default_factory=dict)
    # With session workers: the node of the agent that will use the session (its address, or its Ray node id);
    # a worker on that node is preferred, else the least loaded.
    node: Text | None = None


class OpenGeneratorSessionRequest(BaseModel):
    """Body of `POST /sessions` with `kind: generator`: a Ray actor of the `ray` executor opens the session of one
    trajectory the run gave it; the buffer's proxy generates its turns, and its records go back to the actor
    (`/sessions/{id}/close`), which returns them to the runner as the trajectory's outcome."""

    model_config = STRICT

    kind: Literal["generator"]
    run_id: Text
    uid: Text
    instance_id: Text
    epoch: NonNegativeInt
    repeat: NonNegativeInt
    metadata: dict[str, Any] = Field(default_factory=dict)
    node: Text | None = None  # the actor's Ray node id: a session worker there serves the session, if any

    @model_validator(mode="after")
    def _uid_of_the_run(self) -> OpenGeneratorSessionRequest:
        if not self.uid.startswith(f"{self.run_id}:"):
            raise ValueError(f"uid {self.uid!r} is not a trajectory of run {self.run_id!r} (uids start with "
                             "'{run_id}:')")
        return self


class DiscardSessionRequest(BaseModel):
    """Body of `POST /sessions/{session_id}/discard`: close a generator's session without records."""

    model_config = STRICT

    reason: str = Field(min_length=1, max_length=4000)


class FinishSessionRequest(BaseModel):
    """Body of `POST /sessions/{session_id}/finish`: the episode's reward, shared by every branch."""

    model_config = ConfigDict(strict=True, json_schema_extra={"examples": [{"reward": 1.0, "extra_info": {}}]})

    reward: float
    extra_info: dict[str, Any] = Field(default_factory=dict)

    @field_validator("reward")
    @classmethod
    def _finite(cls, v: float) -> float:
        return check_reward(v)  # type: ignore[return-value]  # a float in, a float out
