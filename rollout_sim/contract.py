"""SGLang's request contract as the simulated engine keeps it: its limits and messages, the sampling parameters it
validates (0.5.15's keyword arguments, 0.5.23's JSON contract), the request bodies, and the engine's settings."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel, ConfigDict

SIM_MODEL_NAME = "sim-engine (simulated)"
SGLANG_VERSIONS = ("0.5.15", "0.5.23")
# What `/server_info.version` reports for each imitated release.
SGLANG_RELEASES = {"0.5.15": "0.5.15.post1", "0.5.23": "0.5.23"}
PAUSE_MODES = ("abort", "in_place", "retract")
ERROR_KINDS = ("http_500", "hang", "reset", "truncated_json")
REFUSAL_KINDS = ("refuse_400", "refuse_503")
ALL_ERROR_KINDS = (*ERROR_KINDS, *REFUSAL_KINDS)
FAULT_KINDS = ("abort", *ALL_ERROR_KINDS)
HEALTH_CHECK_TIMEOUT_S = 20.0  # SGLang's SGLANG_HEALTH_CHECK_TIMEOUT default
DEFAULT_MAX_NEW_TOKENS = 128  # SamplingParams.max_new_tokens default
RESERVED_INPUT_TOKENS = 5  # max_req_input_len = max_req_len - 5 (tp_worker.get_worker_info)
FORCE_STREAM_INTERVAL = 50  # SGLANG_FORCE_STREAM_INTERVAL: a non-streamed request reaches the tokenizer manager
SURROUNDING_PROMPT_TOKENS = 5  # INIT_INCREMENTAL_DETOKENIZATION_OFFSET
JUNK_TOKEN_ID = 0  # the token a refused request's 1-token stand-in prefill yields (any token: it means nothing)

# SamplingParams fields in SGLang's order (0.5.23's JSON contract `_FIELDS_SamplingParams`).
CONTRACT_SAMPLING_FIELDS = (
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema", "regex",
    "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "beam_width", "watermark",
    "choice",
)
# 0.5.15's SamplingParams keyword arguments; any other key is a TypeError there.
SGLANG_SAMPLING_KEYS = frozenset(CONTRACT_SAMPLING_FIELDS) - {"beam_width", "watermark", "choice"}
CONTRACT_KEYS = frozenset(CONTRACT_SAMPLING_FIELDS)
_INT_FIELDS = frozenset({"max_new_tokens", "top_k", "min_new_tokens", "n", "stream_interval", "sampling_seed",
                         "beam_width"})
_FLOAT_FIELDS = frozenset({"temperature", "top_p", "min_p", "frequency_penalty", "presence_penalty",
                           "repetition_penalty"})
_BOOL_FIELDS = frozenset({"ignore_eos", "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim"})

FLUSH_OK = ("Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            "requests, the operation will not be performed.)\n")
WEIGHT_VERSION_GONE = ("Endpoint '/get_weight_version' or '/weight_version' is deprecated. Please use "
                       "'/model_info' instead.")
QUEUE_FULL = "The request queue is full."


def running_abort() -> dict[str, Any]:
    """`FINISH_ABORT().to_json()`: the finish of an aborted running request."""
    return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def input_too_long(n: int, max_req_input_len: int) -> str:
    """`managers.utils.validate_input_length`'s refusal."""
    return (f"Input length ({n} tokens) exceeds the maximum allowed length ({max_req_input_len} tokens). "
            "Use a shorter input or enable --allow-auto-truncate.")


@dataclass(frozen=True)
class SimConfig:
    """Settings of one simulated engine."""

    port: int = 30000
    host: str = "127.0.0.1"
    tokenizer_path: str | None = None
    latency_ms: float = 0.0
    token_latency_ms: float = 0.0  # added per output token: a long answer takes longer, a stream trickles
    abort_rate: float = 0.0
    error_rate: float = 0.0
    error_kinds: tuple[str, ...] = ERROR_KINDS
    correct_rate: float = 0.6
    invalid_rate: float = 0.0
    seed: int = 0
    weight_version: str = "default"
    hang_s: float = 3600.0
    context_length: int = 32768
    tool_call_parser: str | None = None  # SGLang's --tool-call-parser (`sim.tool_calls.TOOL_CALL_PARSERS`)
    sglang_version: str = "0.5.23"
    stream_interval: int = 1
    incremental_streaming_output: bool = False
    health_check_timeout_s: float = HEALTH_CHECK_TIMEOUT_S
    # An MoE model's routing, returned with SGLang's --enable-return-routed-experts; top-p replay (`replay`).
    enable_return_routed_experts: bool = False
    moe_layers: int = 0
    moe_top_k: int = 2
    moe_experts: int = 64
    top_p_replay: bool = False


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters the simulation acts on, validated like SGLang's `SamplingParams.verify`."""

    max_new_tokens: int | None = DEFAULT_MAX_NEW_TOKENS  # None: unlimited (up to the context)
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stream_interval: int | None = None

    @classmethod
    def parse(cls, params: dict[str, Any], known: frozenset[str] = SGLANG_SAMPLING_KEYS) -> Sampling:
        """Validate SGLang sampling params: TypeError for a key not in `known` (0.5.15's SamplingParams), ValueError
        with SGLang's wording for a refused value."""
        unknown = [k for k in params if k not in known]
        if unknown:
            raise TypeError(f"Unexpected keyword argument '{unknown[0]}'")
        p = {k: v for k, v in params.items() if v is not None}
        temperature, top_p = float(p.get("temperature", 1.0)), float(p.get("top_p", 1.0))
        if temperature < 0.0:
            raise ValueError(f"temperature must be a non-negative finite number, got {_number(temperature)}.")
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}.")
        if not 0.0 <= float(p.get("min_p", 0.0)) <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {p['min_p']}.")
        top_k = int(p.get("top_k", -1))
        if top_k < 1 and top_k != -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {top_k}.")
        for name in ("frequency_penalty", "presence_penalty"):
            if not -2.0 <= float(p.get(name, 0.0)) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {p[name]}.")
        if not 0.0 < float(p.get("repetition_penalty", 1.0)) <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2], got {p['repetition_penalty']}.")
        if int(p.get("n", 1)) != 1:
            raise ValueError("the simulated engine generates one sample per request (n must be 1)")
        # Absent: SamplingParams' default; explicit null: no limit but the context.
        max_new = None if "max_new_tokens" in params and params["max_new_tokens"] is None \
            else int(p.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS))
        if max_new is not None and max_new < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {max_new}.")
        stop = p.get("stop", ())
        if not all(isinstance(x, str) for x in ((stop,) if isinstance(stop, str) else stop)):
            raise ValueError("stop must be a string or a list of strings")
        interval = p.get("stream_interval")
        return cls(
            max_new_tokens=max_new,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=frozenset(int(t) for t in p.get("stop_token_ids", ())),
            skip_special_tokens=bool(p.get("skip_special_tokens", True)),
            no_stop_trim=bool(p.get("no_stop_trim", False)),
            stream_interval=int(interval) if interval else None,
        )


def _unexpected(v: Any) -> str:
    """serde's `Unexpected` wording, as 0.5.23's generated contract writes it."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"boolean `{'true' if v else 'false'}`"
    if isinstance(v, int):
        return f"integer `{v}`"
    if isinstance(v, float):
        return f"floating point `{v}`"
    if isinstance(v, str):
        return f'string "{v}"'
    return "sequence" if isinstance(v, list) else "map" if isinstance(v, dict) else type(v).__name__


def sampling_contract_error(params: Any) -> str | None:
    """0.5.23's `/generate` JSON contract on `sampling_params` (`sglang/api/v1/api_types.decode_SamplingParams`):
    the refusal text, or None."""
    if params is None:
        return None
    if not isinstance(params, dict):
        return f"invalid type: {_unexpected(params)}, expected struct SamplingParams"
    for key, x in params.items():
        if key not in CONTRACT_SAMPLING_FIELDS:
            listed = ", ".join(f"`{f}`" for f in CONTRACT_SAMPLING_FIELDS)
            return f"unknown field `{key}`, expected one of {listed}"
        if x is None:
            continue
        if key in _INT_FIELDS and (not isinstance(x, int) or isinstance(x, bool)):
            return f"invalid type: {_unexpected(x)}, expected i64"
        if key in _FLOAT_FIELDS and (not isinstance(x, int | float) or isinstance(x, bool)):
            return f"invalid type: {_unexpected(x)}, expected f64"
        if key in _BOOL_FIELDS and not isinstance(x, bool):
            return f"invalid type: {_unexpected(x)}, expected a boolean"
    return None


class GenerateRequest(BaseModel):
    """The part of SGLang's `GenerateReqInput` the simulation uses (one prompt)."""

    model_config = ConfigDict(extra="allow")

    text: str | None = None
    input_ids: list[int] | None = None
    sampling_params: dict[str, Any] = {}
    return_logprob: bool = False
    logprob_start_len: int = -1
    return_routed_experts: bool = False
    routed_experts_start_len: int = 0
    image_data: list[str] | str | None = None
    return_text_in_logprobs: bool = False
    rid: str | None = None
    stream: bool = False


class ChatRequest(BaseModel):
    """The part of an OpenAI chat-completions request the simulation uses."""

    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]]
    model: str | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    stream: bool = False
    rid: str | None = None


# OpenAI chat fields that map one-to-one onto SGLang sampling params.
CHAT_SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "skip_special_tokens", "no_stop_trim", "n", "min_new_tokens",
    "ignore_eos",
)



class Refused(Exception):
    """A request SGLang answers with an HTTP error: status, message, and (chat) OpenAI error type."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


def _number(value: float) -> str:
    """A number as 0.5.23's validation writes it (Rust's float display: `-1`, not `-1.0`)."""
    return str(int(value)) if value.is_integer() else repr(value)
