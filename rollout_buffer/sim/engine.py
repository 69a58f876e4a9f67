"""Simulated SGLang engine: SGLang's HTTP behaviour with scripted replies, for runs and tests without a GPU.

Token-in-token-out like the real server: the prompt ids are decoded with the real tokenizer, a scripted reply
is chosen (`sim.policy`), encoded with the same tokenizer and closed with the end-of-turn id. `--sglang-version`
picks the release imitated where they differ: `0.5.23` (default) or `0.5.15` (0.5.15.post1, which slime pins).
File references below are to SGLang's sources of those releases.

Imitated (both releases unless said):

- Limits (`tokenizer_manager._validate_one_request`, `scheduler.init_req_max_new_tokens`,
  `managers.utils.validate_input_length`, `tp_worker.get_worker_info`): with context length C, a prompt of
  ≥ C tokens and prompt + `max_new_tokens` > C are refused with HTTP 400 `{"error": {"message"}}` in SGLang's
  wording (streamed: HTTP 200, one `data: {"error": {"message", "type": "invalid_request_error", "code": 400,
  "retryable": false}}` event, then `data: [DONE]`). A prompt of ≥ C - 6 tokens (`max_req_input_len`) passes
  that check but is refused by the scheduler as an abort with `status_code` 400 (below). `max_new_tokens`
  absent from `/generate` means 128 and is not checked against C; `null` (and a chat request without
  `max_tokens`) means unlimited; either way generation stops at C - 2 - prompt tokens (finish `length`).
- Finish rules per token as the scheduler checks them: length first, then stop strings, then stop token ids
  and the end-of-turn id. `output_ids` include the matched stop token; `text` leaves it out (also a
  non-special one such as Qwen3's `</tool_call>`) unless `no_stop_trim`; a matched stop string is cut from
  `text` (kept, and nothing after it, with `no_stop_trim`). Text comes from SGLang's incremental detokenizer
  (`detokenizer_manager`: 5 prompt tokens of context, an incomplete character held back).
- Streaming (`stream: true`, `scheduler_components/output_streamer.accept`): `--stream-interval` N (default
  1) tokens per event, 0.5.15 sending at tokens 1, N+1, 2N+1… and 0.5.23 at the first token then whenever
  N are unsent; an event whose last tokens could begin a stop string is held back (the tokens go with a later
  event). With `incremental_streaming_output` off (default) each event holds the output so far (`text`,
  `output_ids`, `meta_info.output_token_logprobs`); with `--incremental-streaming-output` only the new part.
  `meta_info.completion_tokens` counts the output so far in both. The last event has the finish reason, then
  `data: [DONE]`.
- Aborts: `/abort_request` (rid prefix, or `abort_all`), `/pause_generation` `abort`, `/update_weight_version`
  (which aborts by default: `abort_all_requests` is true unless sent false) and client hang-ups end running
  requests with their output so far and finish `{"type": "abort", "message": "Aborted", "status_code": null,
  "err_type": null}`. A request retracted by `/pause_generation {"mode": "retract"}` sits in the waiting queue:
  aborted there it is answered at once in `tokenizer_manager._handle_abort_req`'s shape (finish
  `{"type": "abort", "message": "Abort in waiting queue"}`, no `prompt_tokens`; streamed, 0.5.15 sends
  `output_ids` = [last token] with cumulative log-probs, 0.5.23 the whole output unless incremental). One held
  in place (`in_place`) is answered when generation continues. Requests sent while paused wait before
  validation, and no abort reaches them.
- Weight versions: `meta_info.weight_version` is the server's version when the event is built (0.5.15: an
  answer built after a version bump carries the new one). 0.5.23 adds, in the last event,
  `meta_info.weight_versions` = `[{"version", "start", "end"}]` spans of output positions per version
  (`utils/weight_versions.py`), and `weight_version` is then the last span's.
- Endpoints: `/health` and `/health_generate` run a one-token generation and answer 200 once the engine has
  shown progress since the check began, 503 after `SGLANG_HEALTH_CHECK_TIMEOUT` (20) s without (a long
  pause); `/flush_cache` (GET or POST, `?timeout=`) answers 400 while requests are running or waiting (0.5.23:
  waiting ones are ignored while paused); `/get_weight_version` is 404 (0.5.15: SGLang's deprecation message;
  0.5.23: no such route); `/model_info`, `/server_info` (`context_length` as for a server started with
  `--context-length`, `max_req_input_len`, `max_total_num_tokens`, `version`) with `get_` aliases, `/v1/models`
  (`max_model_len`), `/get_load`.
  0.5.23's JSON contract refuses unknown or mistyped sampling params with 400 `{"error": "unknown field …"}`;
  0.5.15 fails them with a bare 500 (its `SamplingParams` raises TypeError).
- `/v1/chat/completions` (not streamed): errors in OpenAI's shape `{"object": "error", "message", "type",
  "param", "code"}`, tool calls as SGLang's `--tool-call-parser` (`sim.tool_calls`), `metadata.weight_version`
  (0.5.23: and `weight_versions`).

Faults, each at its own rate from a seeded RNG (`--abort-rate`, `--error-rate` over `--error-kinds`), or
queued exactly for the next requests with `POST /sim/faults {"next": [...]}` (sent to each engine directly,
so it works behind a router):

- `abort`: the request is aborted half-way (running-abort finish, partial output).
- `refuse_400`: the scheduler refuses it as too long (`set_finish_with_abort`): non-streamed HTTP 400
  `{"error": {"message": "Input length (N tokens) exceeds the maximum allowed length (M tokens). Use a
  shorter input or enable --allow-auto-truncate."}}`; streamed, one event with finish `{"type": "abort",
  "message", "status_code": 400, "err_type": "BadRequestError"}`, `prompt_tokens` 1 and one junk output token
  (SGLang prefills a 1-token stand-in prompt), then `[DONE]`.
- `refuse_503`: the waiting queue is full (`_abort_on_queued_limit`; a waiting timeout looks the same):
  non-streamed HTTP 503 `{"object": "error", "message": "The request queue is full.", "type": "503",
  "param": null, "code": 503}`; streamed, one `_handle_abort_req` event with finish `{"type": "abort",
  "status_code": 503, "message": "The request queue is full."}`, then `[DONE]`.
- `http_500`, `hang` (longer than any client timeout), `reset` (TCP reset), `truncated_json`: failures of the
  engine or the network, not SGLang answers. `--error-kinds` defaults to these four; the refusals are opt-in.

Not imitated: batching, queueing and memory (every request runs at once; `max_running_requests`,
`max_queued_requests` and the waiting timeout exist only as the `refuse_503` fault); the one extra token real
SGLang's last decode step appends to an aborted running request; input and top log-probs (only
`output_token_logprobs`); `ignore_eos`, `min_new_tokens`, regex/grammar constraints and `n` > 1; SGLang's
per-request timing fields beyond `e2e_latency`; the ≥ 1 s a healthy real `/health` takes (its first poll is
after a second; the sim answers as soon as it sees progress); 0.5.23 dropped `/get_load` for `/v1/loads`, the
sim serves `/get_load` in both; real SGLang does not check input ids against the vocabulary, the sim refuses
them (400); streamed `/v1/chat/completions` (400).

`GET /sim/stats` counts requests by endpoint; `GET /sim/requests` lists the last requests. An aborted turn can
be resumed the way SGLang callers do it, by resending prompt + partial output: the engine remembers recent turns
and continues the same scripted reply, so the concatenation equals the uninterrupted output (per process).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import random
import socket
import struct
import threading
import time
import uuid
import zlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncGenerator, AsyncIterator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict
from starlette.responses import PlainTextResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from rollout_buffer.sim.policy import make_draw, scripted_reply
from rollout_buffer.sim.prefix_memo import Hit, PrefixMemo
from rollout_buffer.sim.tool_calls import normalize_history, parse_tool_calls

logger = logging.getLogger(__name__)

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
_TURN_MEMORY = 8192
_TEXT_CUT_WITHIN = 64  # tokens from a prompt's end a special token is looked for, to remember its text up to it
_RECENT_REQUESTS = 256

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
_CONTRACT_KEYS = frozenset(CONTRACT_SAMPLING_FIELDS)
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
            raise ValueError(f"temperature must be a non-negative finite number, got {temperature}.")
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
_CHAT_SAMPLING_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "skip_special_tokens", "no_stop_trim", "n", "min_new_tokens",
    "ignore_eos",
)


@dataclass(frozen=True)
class _Prefix:
    """A prompt's ids to right after a special token, remembered for the conversation's next request: their
    text, and their blake2b state (`SimEngine._digest`), both to be continued."""

    text: str
    hashed: hashlib.blake2b


@dataclass
class Turn:
    """The planned outcome of one generation request (before aborts cut it)."""

    policy: str
    output_ids: list[int]
    finish: dict[str, Any]
    first_position: int  # position of the first output token inside the assistant turn


@dataclass
class _Request:
    """A request admitted to the (simulated) scheduler. `wake` is set when it is aborted, paused or continued."""

    rid: str
    stream: bool
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    abort: dict[str, Any] | None = None  # the finish it is aborted with
    abort_queued: bool = False  # aborted while retracted to the waiting queue (answered by _handle_abort_req)
    elapsed: float = 0.0  # generation time spent so far (paused time excluded)
    spending_since: float | None = None  # monotonic start of the current wait
    n: int = 0  # planned output tokens
    keep: int = 0  # tokens it will produce before an `abort` fault
    total_s: float = 0.0  # generation time of all `n` tokens
    tokens: int = 0  # output tokens generated (streamed requests, token by token)
    version_events: list[tuple[str, int]] = field(default_factory=list)  # (old version, tokens at the change)
    # The server's version when it was aborted: its output ends there, whatever version its answer is built under.
    aborted_under: str | None = None

    def tokens_now(self) -> int:
        """Output tokens generated by now."""
        if self.stream or self.total_s <= 0:
            return self.tokens
        spent = self.elapsed + (time.monotonic() - self.spending_since if self.spending_since else 0.0)
        return min(self.keep, int(self.n * min(spent, self.total_s) / self.total_s + 1e-9))


@dataclass
class _Event:
    """One answer of the scheduler for a request: its first `tokens` output tokens; `finish` on the last."""

    tokens: int
    finish: dict[str, Any] | None = None
    queued_abort: bool = False  # answered by the tokenizer manager's `_handle_abort_req` (waiting queue)
    junk: bool = False  # a scheduler refusal: a 1-token stand-in prompt and one meaningless output token


@dataclass
class SimStats:
    """Per-engine counters, served at `/sim/stats`."""

    requests: int = 0
    by_endpoint: Counter[str] = field(default_factory=Counter)
    faults: Counter[str] = field(default_factory=Counter)
    finish: Counter[str] = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    in_flight: int = 0
    max_in_flight: int = 0


class _Refused(Exception):
    """A request SGLang answers with an HTTP error: status, message, and (chat) OpenAI error type."""

    def __init__(self, status: int, message: str, err_type: str = "BadRequestError"):
        super().__init__(message)
        self.status = status
        self.message = message
        self.err_type = err_type


def end_of_turn_id(tokenizer: Any) -> int:
    """The id that closes an assistant turn: ChatML's `<|im_end|>` when the vocabulary has it, else EOS."""
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    return im_end if isinstance(im_end, int) and im_end != tokenizer.unk_token_id else tokenizer.eos_token_id


def token_logprob(token_id: int, position: int) -> float:
    """A deterministic negative log-prob for `token_id` at `position` of the assistant turn."""
    h = zlib.crc32(f"{position}:{token_id}".encode())
    return -(0.01 + (h % 4000) / 1000.0)


def json_response(body: Any, status: int = 200) -> Response:
    return Response(orjson.dumps(body), status_code=status, media_type="application/json")


def error_response(status: int, message: str) -> Response:
    """SGLang's native error body (`http_server._create_error_response`): `{"error": {"message"}}`."""
    return json_response({"error": {"message": message}}, status)


def openai_error(status: int, message: str, err_type: str) -> Response:
    """SGLang's `ErrorResponse` (OpenAI routes, HTTPException and request validation errors)."""
    return json_response({"object": "error", "message": message, "type": err_type, "param": None,
                          "code": status}, status)


def internal_server_error() -> Response:
    """What Starlette answers for an exception SGLang's handler does not catch."""
    return PlainTextResponse("Internal Server Error", status_code=500)


def weight_version_spans(events: list[tuple[str, int]], current: str, n: int) -> list[dict[str, Any]]:
    """0.5.23's `compute_weight_version_spans` + the visible spans of `add_weight_versions_to_meta_info`."""
    spans: list[list[Any]] = []
    for version, end in [*events, (current, n)]:
        end = min(end, n)
        if spans and end <= spans[-1][2]:
            continue
        if spans and version == spans[-1][0]:
            spans[-1][2] = end
            continue
        spans.append([version, spans[-1][2] if spans else 0, end])
    return [{"version": v, "start": s, "end": min(e, n)} for v, s, e in spans if s < n or s == 0]


def _is_cjk(cp: int) -> bool:
    return (0x4E00 <= cp <= 0x9FFF or 0x3400 <= cp <= 0x4DBF or 0x20000 <= cp <= 0x2A6DF
            or 0x2A700 <= cp <= 0x2B73F or 0x2B740 <= cp <= 0x2B81F or 0x2B820 <= cp <= 0x2CEAF
            or 0xF900 <= cp <= 0xFAFF or 0x2F800 <= cp <= 0x2FA1F)


def find_printable_text(text: str) -> str:
    """`sglang.utils.find_printable_text`: what the detokenizer lets out of text ending in a partial character."""
    if text.endswith("\n"):
        return text
    if text and _is_cjk(ord(text[-1])):
        return text
    if len(text) > 1 and _is_cjk(ord(text[-2])):
        return text[:-1]
    return text[: text.rfind(" ") + 1]


_TextOrIds = TypeVar("_TextOrIds", str, list[int])  # a request's text, or its ids


def trim_matched_stop(output: _TextOrIds, finish: dict[str, Any] | None, no_stop_trim: bool) -> _TextOrIds:
    """`DetokenizerManager.trim_matched_stop`: cut a matched stop string from text, a matched stop token from ids."""
    matched = finish.get("matched") if finish else None
    if not matched:
        return output
    if isinstance(matched, str) and isinstance(output, str):
        pos = output.find(matched)
        if pos == -1:
            return output
        return output[: pos + len(matched)] if no_stop_trim else output[:pos]
    if isinstance(matched, int) and isinstance(output, list):
        return output if no_stop_trim else output[:-1]
    return output


class Detokenizer:
    """One request's incremental detokenization, as `DetokenizerManager._decode_batch_token_id_output` does it."""

    def __init__(self, tokenizer: Any, prompt: list[int], skip_special_tokens: bool, no_stop_trim: bool):
        surr = max(len(prompt) - SURROUNDING_PROMPT_TOKENS, 0)
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.no_stop_trim = no_stop_trim
        self.decode_ids = list(prompt[surr:])
        self.surr_offset = 0
        self.read_offset = len(prompt) - surr
        self.decoded_text = ""
        self.sent_offset = 0

    def step(self, new_ids: list[int], finish: dict[str, Any] | None) -> str:
        """The text a batch carrying `new_ids` sends to the tokenizer manager (`finish` on the last)."""
        self.decode_ids.extend(new_ids)
        read_ids = trim_matched_stop(self.decode_ids[self.surr_offset :], finish, self.no_stop_trim)
        surr_text: str = self.tokenizer.decode(self.decode_ids[self.surr_offset : self.read_offset],
                                               skip_special_tokens=self.skip)
        new_text: str = self.tokenizer.decode(read_ids, skip_special_tokens=self.skip)[len(surr_text) :]
        if finish is None:
            pending = self.sent_offset - len(self.decoded_text)
            if new_text and not new_text.endswith("\ufffd"):
                self.decoded_text += new_text
                self.surr_offset, self.read_offset = self.read_offset, len(self.decode_ids)
                self.sent_offset = len(self.decoded_text)
                return new_text[pending:] if pending else new_text
            printable = find_printable_text(new_text)
            self.sent_offset = len(self.decoded_text) + len(printable)
            return printable[pending:] if pending else printable
        output = trim_matched_stop(self.decoded_text + new_text, finish, self.no_stop_trim)
        out = output[self.sent_offset :]
        self.sent_offset = len(output)
        return out


@dataclass
class _Output:
    """What the tokenizer manager holds of one request: tokens and text received, log-prob entries made."""

    detok: Detokenizer
    sent: int = 0  # output tokens received so far
    text: str = ""
    first: bool = True


class _ResetConnection(Response):
    """Closes the client's TCP connection with RST instead of answering (uvicorn's transport)."""

    def __init__(self) -> None:
        super().__init__(status_code=500)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        transport = getattr(getattr(receive, "__self__", None), "transport", None)
        if transport is not None:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                # Linger 0 turns close() into a reset, as a crashed engine would look to the client.
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        # Completes the ASGI cycle; the bytes go nowhere once the transport is aborted.
        await super().__call__(scope, receive, send)


class SimEngine:
    """State of one simulated engine: tokenizer, RNGs, fault queue, turn memory, requests and counters."""

    def __init__(self, config: SimConfig, tokenizer: Any, tokenizer_path: str):
        if config.sglang_version not in SGLANG_VERSIONS:
            raise ValueError(f"sglang_version must be one of {', '.join(SGLANG_VERSIONS)}")
        self.config = config
        self.v23 = config.sglang_version == "0.5.23"
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self.eos_id = end_of_turn_id(tokenizer)
        self.vocab_size = len(tokenizer)
        self.header_ids: list[int] = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self.weight_version = config.weight_version
        self.max_req_len = config.context_length - 1
        self.max_req_input_len = self.max_req_len - RESERVED_INPUT_TOKENS
        self.stats = SimStats()
        self.started = time.time()
        self._policy_rng = random.Random(f"{config.seed}:policy")
        self._fault_rng = random.Random(f"{config.seed}:faults")
        self._queued_faults: deque[str] = deque()
        self._turns: OrderedDict[bytes, list[list[int]]] = OrderedDict()
        self._turns_lock = threading.Lock()
        self.prefixes: PrefixMemo[list[int], _Prefix] = PrefixMemo()  # prompts to right after a special token
        self._special_ids = frozenset(tokenizer.all_special_ids)
        self._requests: dict[int, _Request] = {}  # admitted to the scheduler, not answered yet
        self._running_tokens = 0
        self.paused: str | None = None  # the /pause_generation mode in effect
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._progress = asyncio.Event()  # set whenever the engine answers anything (SGLang's last_receive_tstamp)
        self.last_progress = time.time()
        self.recent: deque[dict[str, Any]] = deque(maxlen=_RECENT_REQUESTS)

    # ------------------------------------------------------------ faults

    def queued_faults(self) -> list[str]:
        """Faults waiting for the next requests."""
        return list(self._queued_faults)

    def queue_faults(self, kinds: list[str]) -> None:
        """Make the next requests fail in the given ways, in order."""
        bad = [k for k in kinds if k not in (*FAULT_KINDS, "none")]
        if bad:
            raise ValueError(f"unknown fault kind(s) {bad}; known: {', '.join(FAULT_KINDS)}, none")
        self._queued_faults.extend(kinds)

    def _next_fault(self) -> str | None:
        # Both numbers are drawn on every request so the sequence depends on the seed only.
        error_roll, abort_roll = self._fault_rng.random(), self._fault_rng.random()
        kind_index = self._fault_rng.randrange(len(self.config.error_kinds) or 1)
        if self._queued_faults:
            queued = self._queued_faults.popleft()
            return None if queued == "none" else queued
        if error_roll < self.config.error_rate and self.config.error_kinds:
            return self.config.error_kinds[kind_index]
        if abort_roll < self.config.abort_rate:
            return "abort"
        return None

    async def _fault_response(self, fault: str | None) -> Response | None:
        """The response of a fault that replaces the engine's answer, after a hang if that is the fault."""
        if fault is not None:
            self.stats.faults[fault] += 1
            logger.debug("simulated fault: %s", fault)
        if fault == "http_500":
            return error_response(500, "simulated internal server error")
        if fault == "reset":
            return _ResetConnection()
        if fault == "hang":
            await asyncio.sleep(self.config.hang_s)
        return None

    # ------------------------------------------------------------ planning (in a worker thread)

    def _split_turn(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """(context up to the last assistant header, partial assistant output after it)."""
        h = self.header_ids
        for start in range(len(ids) - len(h), -1, -1):
            if ids[start : start + len(h)] == h:
                return ids[: start + len(h)], ids[start + len(h) :]
        return ids, []

    @staticmethod
    def _digest(context: list[int], prefix: Hit[_Prefix] | None) -> bytes:
        """A key of `context` (a prompt up to its assistant header); continued from the remembered `prefix`'s."""
        if prefix is not None and prefix.length <= len(context):
            hashed = prefix.value.hashed.copy()
            hashed.update(array("q", context[prefix.length :]).tobytes())
            return hashed.digest()
        return hashlib.blake2b(array("q", context).tobytes(), digest_size=16).digest()

    def _recall(self, key: bytes, partial: list[int]) -> list[int] | None:
        with self._turns_lock:
            for full in reversed(self._turns.get(key, ())):
                if len(full) > len(partial) and full[: len(partial)] == partial:
                    return full
        return None

    def _remember(self, key: bytes, full: list[int]) -> None:
        with self._turns_lock:
            self._turns.setdefault(key, []).append(full)
            self._turns.move_to_end(key)
            del self._turns[key][:-8]
            while len(self._turns) > _TURN_MEMORY:
                self._turns.popitem(last=False)

    def prompt_text(self, ids: list[int], prefix: Hit[_Prefix] | None) -> str:
        """`ids` decoded (special tokens kept), from the remembered `prefix` of them on (`self.prefixes.find`,
        a conversation's previous request); remembers them, to right after their last special token, for the next.
        A text cut right after a special token decodes as its two parts do (an added token is decoded on its own)."""
        start = prefix.length if prefix is not None else 0
        decoded: str = self.tokenizer.decode(ids[start:], skip_special_tokens=False)
        text = (prefix.value.text if prefix is not None else "") + decoded
        cut = len(ids)
        while cut > max(start, len(ids) - _TEXT_CUT_WITHIN) and ids[cut - 1] not in self._special_ids:
            cut -= 1
        if cut > start and ids[cut - 1] in self._special_ids:
            tail: str = self.tokenizer.decode(ids[cut:], skip_special_tokens=False) if cut < len(ids) else ""
            hashed = prefix.value.hashed.copy() if prefix is not None else hashlib.blake2b(digest_size=16)
            hashed.update(array("q", ids[start:cut]).tobytes())
            self.prefixes.put(ids[:cut], _Prefix(text[: len(text) - len(tail)], hashed), replacing=prefix)
        return text

    def _stop_at_string(self, out: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
        """(tokens up to and including the one completing a stop string, that string), or None."""
        text = self.tokenizer.decode(out, skip_special_tokens=False)
        if not any(s in text for s in stops):
            return None
        for k in range(1, len(out) + 1):
            prefix = self.tokenizer.decode(out[:k], skip_special_tokens=False)
            for s in stops:
                if s in prefix:
                    return k, s
        return None

    def plan_turn(self, ids: list[int], sampling: Sampling, max_new: int, prefix: Hit[_Prefix] | None) -> Turn:
        """Choose (or continue) the scripted reply for `ids` and apply the finish rules in the scheduler's order
        (`Req.update_finish_state`): at each token, length, then stop strings, then stop ids and end of turn.
        `prefix`: the remembered prefix of `ids` (`self.prefixes.find`, looked up at admission)."""
        context, partial = self._split_turn(ids)
        key = self._digest(context, prefix)
        full = self._recall(key, partial) if partial else None
        policy = "continue"
        if full is None:
            draw = make_draw(self._policy_rng, self.config.correct_rate, self.config.invalid_rate)
            policy, reply = scripted_reply(self.prompt_text(ids, prefix), draw)
            full = partial + self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos_id]
            self._remember(key, full)
        out = full[len(partial) :]
        candidates: list[tuple[int, int, dict[str, Any]]] = []  # (tokens, priority, finish)
        if max_new < len(out) or max_new == 0:
            candidates.append((max(max_new, 1), 0, {"type": "length", "length": max_new}))
        if sampling.stop:
            hit = self._stop_at_string(out, sampling.stop)
            if hit is not None:
                candidates.append((hit[0], 1, {"type": "stop", "matched": hit[1]}))
        for i, token in enumerate(out):
            if token in sampling.stop_token_ids or token == self.eos_id:
                candidates.append((i + 1, 2, {"type": "stop", "matched": token}))
                break
        end, _, finish = min(candidates, key=lambda c: (c[0], c[1]))
        if finish["type"] == "length":
            end = max_new  # `finished_len`: max_new_tokens, also 0
        return Turn(policy=policy, output_ids=out[:end], finish=finish, first_position=len(partial))

    # ------------------------------------------------------------ request flow

    def generation_s(self, output_tokens: int) -> float:
        """How long generating a turn of `output_tokens` takes: the request latency plus the per-token one."""
        return (self.config.latency_ms + self.config.token_latency_ms * output_tokens) / 1000.0

    def _mark_progress(self) -> None:
        self.last_progress = time.time()
        self._progress.set()

    async def _spend(self, req: _Request, until_s: float) -> bool:
        """Spend generation time until `req.elapsed` reaches `until_s`, standing still while the scheduler is paused;
        False when the request was aborted first (held in place until generation continues)."""
        while True:
            frozen = self.paused in ("in_place", "retract")
            if req.abort is not None and not (frozen and self.paused == "in_place" and not req.abort_queued):
                return False
            if frozen:
                await req.wake.wait()
                req.wake.clear()
                continue
            if req.elapsed >= until_s:
                return True
            start = req.spending_since = time.monotonic()
            try:
                async with asyncio.timeout(until_s - req.elapsed):
                    await req.wake.wait()
            except TimeoutError:
                pass
            req.wake.clear()
            req.elapsed = min(until_s, req.elapsed + time.monotonic() - start)
            req.spending_since = None

    def load(self) -> list[dict[str, Any]]:
        """0.5.15's `/get_load` shape (one entry per data-parallel rank)."""
        waiting = len(self._requests) if self.paused == "retract" else 0
        return [{"dp_rank": 0, "num_reqs": len(self._requests), "num_waiting_reqs": waiting,
                 "num_tokens": self._running_tokens, "num_pending_tokens": 0, "ts_tic": time.perf_counter()}]

    def abort(self, rid: str | None, abort_all: bool) -> int:
        """The scheduler's `abort_request`: requests whose rid starts with `rid` (all with `abort_all`); requests
        waiting for a pause to end are not in the scheduler yet. Returns how many were signalled."""
        if not abort_all and not rid:
            return 0
        targets = [r for r in self._requests.values()
                   if r.abort is None and (abort_all or (rid is not None and r.rid.startswith(rid)))]
        for req in targets:
            # Retracted requests sit in the waiting queue: `_handle_abort_req` answers them with its default message.
            req.abort_queued = self.paused == "retract"
            req.abort = {"type": "abort", "message": "Abort in waiting queue"} if req.abort_queued \
                else running_abort()
            req.aborted_under = self.weight_version
            req.wake.set()
        return len(targets)

    def set_weight_version(self, version: str) -> None:
        """A new weight version; 0.5.23's scheduler records it for the requests that have output
        (`record_weight_version_change`)."""
        if version == self.weight_version:
            return
        for req in self._requests.values():
            tokens = req.tokens_now()
            if tokens:
                req.version_events.append((self.weight_version, tokens))
        self.weight_version = version

    async def pause(self, mode: str) -> int:
        """SGLang's `/pause_generation`: `abort` aborts every request in the scheduler (returning once they have
        answered), `in_place` holds them, `retract` moves them to the waiting queue; in every mode new requests wait
        until `resume()`. Returns how many requests it aborted or held."""
        if mode not in PAUSE_MODES:
            raise ValueError(mode)
        self.paused = mode
        self._unpaused.clear()
        if mode == "abort":
            count = self.abort(None, abort_all=True)
            for _ in range(500):  # bounded: 500 x 10 ms
                if not self._requests:
                    break
                await asyncio.sleep(0.01)
            return count
        for req in self._requests.values():
            req.wake.set()
        return len(self._requests)

    def resume(self) -> None:
        """SGLang's `/continue_generation`: held, retracted and waiting requests go on."""
        self.paused = None
        self._unpaused.set()
        for req in self._requests.values():
            req.wake.set()

    def pending(self) -> bool:
        """Requests the scheduler would call running or waiting for `/flush_cache` (0.5.23 ignores the waiting queue
        while paused)."""
        if self.v23 and self.paused == "retract":
            return False
        return bool(self._requests)

    async def flush_cache(self, timeout_s: float) -> tuple[int, str]:
        """SGLang's `/flush_cache` (`SchedulerFlushWrapper`): (status, body)."""
        if timeout_s <= 0:
            return (400, "Flush cache failed.\n") if self.pending() else (200, FLUSH_OK)
        deadline = time.monotonic() + timeout_s
        while self._requests:  # the deferred flush waits for a fully idle scheduler
            if time.monotonic() >= deadline:
                return 400, "Timed out waiting for idle state."
            await asyncio.sleep(0.01)
        return 200, FLUSH_OK

    async def health(self) -> int:
        """`/health_generate`: a one-token generation; 200 once the engine shows progress after the check began,
        503 when it shows none for `health_check_timeout_s`."""
        tic = time.time()

        async def one_token() -> None:
            await self._unpaused.wait()
            self._mark_progress()

        task = asyncio.create_task(one_token())
        try:
            deadline = time.monotonic() + self.config.health_check_timeout_s
            while self.last_progress <= tic:
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.error("Health check failed: no progress for %.0f s", self.config.health_check_timeout_s)
                    return 503
                self._progress.clear()
                if self.last_progress > tic:
                    break
                try:
                    async with asyncio.timeout(min(left, 1.0)):
                        await self._progress.wait()
                except TimeoutError:
                    pass
            return 200
        finally:
            task.cancel()

    # ------------------------------------------------------------ admission (the tokenizer manager's checks)

    async def _admit(self, ids: list[int], params: dict[str, Any]) -> tuple[Sampling, Hit[_Prefix] | None]:
        """Wait while generation is paused, then validate like `TokenizerManager._tokenize_one_request`: the
        sampling parameters, and the remembered prefix of `ids` the checks used (planning the turn goes on from it).

        Raises `_Refused(400)` with SGLang's wording, TypeError for an unknown sampling key (0.5.15)."""
        await self._unpaused.wait()
        if not ids:
            raise _Refused(400, "the prompt is empty")
        # Real SGLang does not check (undefined behaviour). A conversation's earlier request, remembered, was
        # checked: only what follows it is (a resent context would cost the simulator as much as the context).
        known = self.prefixes.find(ids)
        new = ids[known.length :] if known is not None else ids
        if new and (min(new) < 0 or max(new) >= self.vocab_size):
            raise _Refused(400, f"input_ids contain token ids outside [0, {self.vocab_size})")
        context = self.config.context_length
        if len(ids) >= context:
            raise _Refused(400, f"The input ({len(ids)} tokens) is longer than the model's context length "
                                f"({context} tokens).")
        max_new = params.get("max_new_tokens")
        if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new + len(ids) > context:
            raise _Refused(400, (
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {max_new + len(ids)} tokens: {len(ids)} tokens from the input messages and "
                f"{max_new} tokens for the completion. Please reduce the number of tokens in the input messages or "
                "the completion to fit within the limit."))
        try:
            return Sampling.parse(params, _CONTRACT_KEYS if self.v23 else SGLANG_SAMPLING_KEYS), known
        except ValueError as e:
            raise _Refused(400, str(e)) from e

    def _max_new(self, n_prompt: int, sampling: Sampling) -> int:
        """`Scheduler.init_req_max_new_tokens`: the limit, never past the context."""
        wanted = sampling.max_new_tokens if sampling.max_new_tokens is not None else 1 << 30
        return max(0, min(wanted, self.max_req_len - n_prompt - 1))

    # ------------------------------------------------------------ generation (the scheduler)

    def _interval(self, sampling: Sampling) -> int:
        return sampling.stream_interval or self.config.stream_interval

    def _emit(self, k: int, sent: int, interval: int) -> bool:
        """Does the streamer send after token `k` (`sent` already sent)? 0.5.15: at 1, N+1, 2N+1…; 0.5.23: the
        first token at once, then whenever N are unsent."""
        if not self.v23:
            return k % interval == 1 if interval > 1 else True
        unsent = k - sent
        return interval == 1 or unsent >= interval or (sent == 0 and unsent > 0)

    def _holds_stop_prefix(self, out: list[int], stops: tuple[str, ...], max_stop_tokens: int) -> bool:
        """`Req.check_match_stop_str_prefix`: the tail may be the start of a stop string."""
        tail = self.tokenizer.decode(out[-(max_stop_tokens + 1) :])
        if not tail:
            return False
        for stop in stops:
            if not stop:
                continue
            if stop in tail:
                return True
            if any(tail[-i:] == stop[:i] for i in range(1, min(len(tail), len(stop)) + 1)):
                return True
        return False

    async def _run(self, rid: str, ids: list[int], sampling: Sampling, known: Hit[_Prefix] | None,
                   fault: str | None, stream: bool) -> AsyncGenerator[tuple[_Event, Turn | None, _Request | None]]:
        """The scheduler's answers for one admitted request, in order; the last carries the finish."""
        if fault == "refuse_503":
            yield _Event(0, {"type": "abort", "status_code": 503, "message": QUEUE_FULL}, queued_abort=True), \
                None, None
            return
        if fault == "refuse_400" or len(ids) >= self.max_req_input_len:
            finish = {"type": "abort", "message": input_too_long(len(ids), self.max_req_input_len),
                      "status_code": 400, "err_type": "BadRequestError"}
            yield _Event(1, finish, junk=True), None, None
            return
        max_new = self._max_new(len(ids), sampling)
        turn = await asyncio.to_thread(self.plan_turn, ids, sampling, max_new, known)
        n = len(turn.output_ids)
        req = _Request(rid=rid, stream=stream, n=n, keep=n // 2 if fault == "abort" else n,
                       total_s=self.generation_s(n))
        self._requests[id(req)] = req  # keyed by identity: SGLang callers may reuse a rid
        tokens = len(ids) + n
        self._running_tokens += tokens
        stops = sampling.stop
        max_stop_tokens = max((len(self.tokenizer.encode(s, add_special_tokens=False)) for s in stops), default=0)
        interval, sent = self._interval(sampling), 0
        try:
            if stream and n:
                for k in range(1, req.keep + 1):
                    if not await self._spend(req, req.total_s * k / n):
                        break
                    req.tokens = k
                    self._mark_progress()
                    if k < n and self._emit(k, sent, interval) and not (
                            stops and self._holds_stop_prefix(turn.output_ids[:k], stops, max_stop_tokens)):
                        sent = k
                        yield _Event(k), turn, req
            elif await self._spend(req, req.total_s * req.keep / n if n else req.total_s):
                req.tokens = req.keep
            else:
                req.tokens = req.tokens_now()
        finally:
            self._running_tokens -= tokens
            self._requests.pop(id(req), None)
        self._mark_progress()
        if req.abort is not None:
            yield _Event(req.tokens, req.abort, queued_abort=req.abort_queued), turn, req
        elif fault == "abort":
            yield _Event(req.keep, running_abort()), turn, req
        else:
            yield _Event(n, turn.finish), turn, req

    # ------------------------------------------------------------ answers (the tokenizer manager)

    def _answer(self, body: GenerateRequest, rid: str, ids: list[int], sampling: Sampling, event: _Event,
                turn: Turn | None, req: _Request | None, out: _Output, started: float) -> dict[str, Any]:
        """The `/generate` answer (or stream event) for `event`, as `TokenizerManager._handle_batch_output` (or, for a
        request aborted in the waiting queue, `_handle_abort_req`) builds it; advances `out`."""
        output = [JUNK_TOKEN_ID] if event.junk else (turn.output_ids if turn else [])
        first = turn.first_position if turn else 0
        incremental = body.stream and self.config.incremental_streaming_output
        if event.queued_abort:
            if not body.stream:  # what reached the tokenizer manager while it ran: every FORCE_STREAM_INTERVAL tokens
                for cut in range(FORCE_STREAM_INTERVAL, event.tokens + 1, FORCE_STREAM_INTERVAL):
                    out.text += out.detok.step(output[out.sent : cut], None)
                    out.sent = cut
            meta: dict[str, Any] = {"id": rid, "finish_reason": event.finish, "weight_version": self.weight_version,
                                    "e2e_latency": time.time() - started}
            if self.v23:
                meta.update(self._spans(req, out.sent))
            if body.return_logprob:
                meta["output_token_logprobs"] = self._logprobs(body, output[: out.sent], first)
            meta["completion_tokens"] = out.sent
            ids_out = output[: out.sent]
            if body.stream and (incremental or not self.v23):
                ids_out = ids_out[-1:]
            return {"text": out.text, "output_ids": ids_out, "meta_info": meta}
        finished = event.finish is not None
        before = out.sent
        if not body.stream and not finished:
            raise AssertionError("a non-streamed request is answered once")
        # A non-streamed request reaches the tokenizer manager every FORCE_STREAM_INTERVAL tokens and at the end.
        delta = ""
        if not body.stream:
            for cut in range(FORCE_STREAM_INTERVAL, event.tokens, FORCE_STREAM_INTERVAL):
                delta += out.detok.step(output[out.sent : cut], None)
                out.sent = cut
        delta += out.detok.step(output[out.sent : event.tokens], event.finish)
        out.sent = event.tokens
        out.text += delta
        meta = {"id": rid, "finish_reason": event.finish, "prompt_tokens": 1 if event.junk else len(ids),
                "weight_version": self.weight_version, "num_retractions": 0}
        if body.return_logprob:
            lps = [] if event.junk else self._logprobs(body, output[: event.tokens], first)
            meta["output_token_logprobs"] = lps[before:] if incremental else lps
        meta.update({"reasoning_tokens": 0, "completion_tokens": event.tokens, "cached_tokens": 0})
        if finished:
            if self.v23:
                meta.update(self._spans(req, event.tokens))
            meta["e2e_latency"] = time.time() - started
        if out.first:
            out.first = False
            meta["response_sent_to_client_ts"] = time.time()
        if incremental:
            return {"text": delta, "output_ids": output[before : event.tokens], "meta_info": meta}
        return {"text": out.text, "output_ids": output[: event.tokens], "meta_info": meta}

    def _spans(self, req: _Request | None, n: int) -> dict[str, Any]:
        # 0.5.23 answers an aborted request from the scheduler at the abort (`/update_weight_version` aborts, then
        # sets the version): its spans end under the version it was aborted under.
        current = req.aborted_under if req is not None and req.aborted_under is not None else self.weight_version
        spans = weight_version_spans(req.version_events if req else [], current, n)
        return {"weight_versions": spans, "weight_version": spans[-1]["version"]}

    def _logprobs(self, body: GenerateRequest, out: list[int], first: int) -> list[list[Any]]:
        return [[token_logprob(t, first + i), t, self.tokenizer.decode([t]) if body.return_text_in_logprobs
                 else None] for i, t in enumerate(out)]

    def _record(self, endpoint: str, rid: str, ids: list[int], sampling: Sampling | None, answer: dict[str, Any],
                policy: str | None, fault: str | None) -> None:
        meta = answer["meta_info"]
        finish = meta["finish_reason"] or {"type": "abort"}
        n_out = meta.get("completion_tokens", 0)
        self.stats.prompt_tokens += len(ids)
        self.stats.completion_tokens += n_out
        self.stats.finish[finish["type"]] += 1
        self.recent.append({
            "endpoint": endpoint, "rid": rid, "prompt_tokens": len(ids),
            "max_new_tokens": sampling.max_new_tokens if sampling else None, "output_tokens": n_out,
            "finish": finish["type"], "status_code": finish.get("status_code"), "policy": policy, "fault": fault,
            "weight_version": meta.get("weight_version"), "weight_versions": meta.get("weight_versions"),
        })

    # ------------------------------------------------------------ /generate

    async def generate(self, body: GenerateRequest) -> Response:
        """`POST /generate` in SGLang's native shape; `stream: true` answers server-sent events."""
        fault = self._next_fault()
        replaced = await self._fault_response(fault)
        if replaced is not None:
            return replaced
        if self.v23:
            contract = sampling_contract_error(body.sampling_params)
            if contract is not None:
                return json_response({"error": contract}, 400)
        rid = body.rid or uuid.uuid4().hex
        if body.input_ids is None and body.text is None:
            return error_response(400, "Either text, input_ids or input_embeds should be provided.")
        if body.stream:
            return StreamingResponse(self._generate_events(body, rid, fault), media_type="text/event-stream")
        started = time.time()
        try:
            ids = await self._prompt_ids(body)
            sampling, known = await self._admit(ids, body.sampling_params)
        except _Refused as e:
            return error_response(e.status, e.message)
        except TypeError:
            logger.exception("unexpected sampling parameter (SGLang 0.5.15 answers 500)")
            return internal_server_error()
        out = _Output(Detokenizer(self.tokenizer, ids, sampling.skip_special_tokens, sampling.no_stop_trim))
        answer: dict[str, Any] = {}
        policy = None
        async for event, turn, req in self._run(rid, ids, sampling, known, fault, stream=False):
            answer = self._answer(body, rid, ids, sampling, event, turn, req, out, started)
            policy = turn.policy if turn else None
        self._record("/generate", rid, ids, sampling, answer, policy, fault)
        finish = answer["meta_info"]["finish_reason"]
        status = finish.get("status_code") if finish.get("type") == "abort" else None
        if status == 400:
            return error_response(400, finish["message"])
        if isinstance(status, int) and status >= 400:
            return openai_error(status, finish["message"], str(status))
        return self._finish_response(answer, fault)

    async def _prompt_ids(self, body: GenerateRequest) -> list[int]:
        if body.input_ids is not None:
            return list(body.input_ids)
        return await asyncio.to_thread(self.tokenizer.encode, body.text or "", add_special_tokens=False)

    async def _generate_events(self, body: GenerateRequest, rid: str, fault: str | None) -> AsyncIterator[bytes]:
        """SGLang's `/generate` stream: `data:` events as the streamer sends them, the finish reason in the last, then
        `data: [DONE]`. A refused request is one `{"error"}` event (SGLang reports its ValueErrors inside the
        stream). A client that leaves ends the generation (SGLang aborts it)."""
        started = time.time()
        try:
            ids = await self._prompt_ids(body)
            sampling, known = await self._admit(ids, body.sampling_params)
        except _Refused as e:
            error = {"message": e.message, "type": "invalid_request_error", "code": 400, "retryable": False}
            yield b"data: " + orjson.dumps({"error": error}) + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        except TypeError as e:  # 0.5.15: the exception escapes the stream; the connection breaks
            raise RuntimeError("SGLang 0.5.15 fails an unexpected sampling parameter") from e
        out = _Output(Detokenizer(self.tokenizer, ids, sampling.skip_special_tokens, sampling.no_stop_trim))
        steps = self._run(rid, ids, sampling, known, fault, stream=True)
        last: tuple[dict[str, Any], _Request | None, Turn | None] | None = None
        answered = False
        try:
            async for event, turn, req in steps:
                answer = self._answer(body, rid, ids, sampling, event, turn, req, out, started)
                if event.finish is not None:
                    answered = True
                    self._record("/generate", rid, ids, sampling, answer, turn.policy if turn else None, fault)
                    if fault == "truncated_json":
                        data = orjson.dumps(answer)
                        yield b"data: " + data[: len(data) // 2]
                        return
                else:
                    last = answer, req, turn
                yield b"data: " + orjson.dumps(answer) + b"\n\n"
        finally:
            if not answered:  # the client left mid-stream: SGLang aborts the request
                if last is not None and last[1] is not None:
                    last[1].abort = running_abort()
                await steps.aclose()
                if last is not None:
                    answer = {**last[0], "meta_info": {**last[0]["meta_info"], "finish_reason": running_abort()}}
                    self._record("/generate", rid, ids, sampling, answer, last[2].policy if last[2] else None,
                                 fault)
        yield b"data: [DONE]\n\n"

    # ------------------------------------------------------------ /v1/chat/completions

    async def chat(self, body: ChatRequest) -> Response:
        """`POST /v1/chat/completions` in OpenAI's shape (no streaming); tool calls parsed as SGLang's
        `--tool-call-parser` does when the engine has one (`sim.tool_calls`)."""
        fault = self._next_fault()
        replaced = await self._fault_response(fault)
        if replaced is not None:
            return replaced
        if body.stream:
            return openai_error(400, "streaming is not simulated", "BadRequestError")
        extra = body.model_extra or {}
        params = {k: extra[k] for k in _CHAT_SAMPLING_KEYS if k in extra}
        # `max_completion_tokens or max_tokens`: absent means no limit but the context.
        params["max_new_tokens"] = body.max_completion_tokens or body.max_tokens
        started = time.time()
        try:
            normalize_history(body.messages)
            text = await asyncio.to_thread(
                self.tokenizer.apply_chat_template, body.messages, tools=body.tools, add_generation_prompt=True,
                tokenize=False, **(body.chat_template_kwargs or {}),
            )
            ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)
            sampling, known = await self._admit(ids, params)
        except _Refused as e:
            return openai_error(e.status, e.message, e.err_type)
        except (ValueError, TypeError, KeyError, TemplateError) as e:
            return openai_error(400, str(e), "BadRequest")
        rid = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
        gen = GenerateRequest(input_ids=ids, return_logprob=body.logprobs, rid=rid)
        out = _Output(Detokenizer(self.tokenizer, ids, sampling.skip_special_tokens, sampling.no_stop_trim))
        answer: dict[str, Any] = {}
        turn: Turn | None = None
        async for event, turn, req in self._run(rid, ids, sampling, known, fault, stream=False):
            answer = self._answer(gen, rid, ids, sampling, event, turn, req, out, started)
        self._record("/v1/chat/completions", rid, ids, sampling, answer, turn.policy if turn else None, fault)
        meta = answer["meta_info"]
        finish_reason = meta["finish_reason"]
        status = finish_reason.get("status_code") if finish_reason.get("type") == "abort" else None
        if status == 400:
            return openai_error(400, finish_reason["message"], "BadRequestError")
        if isinstance(status, int) and status >= 400:
            return openai_error(status, finish_reason["message"], str(status))
        output = answer["output_ids"]
        logprobs = None
        if body.logprobs:
            first = turn.first_position if turn else 0
            logprobs = {"content": [{"token": self.tokenizer.decode([t]), "logprob": token_logprob(t, first + i),
                                     "top_logprobs": []} for i, t in enumerate(output)]}
        content, calls, finish = answer["text"], None, finish_reason["type"]
        matched = finish_reason.get("matched")
        if self.config.tool_call_parser and body.tools and extra.get("tool_choice", "auto") != "none":
            parsed = parse_tool_calls(content, body.tools)
            if parsed is not None:
                (content, calls), finish = parsed, "tool_calls" if finish == "stop" else finish
                matched = None if finish == "tool_calls" else matched
        choice = {
            "index": 0,
            "message": {"role": "assistant", "content": content, "tool_calls": calls, "reasoning_content": None},
            "logprobs": logprobs,
            "finish_reason": finish,
            "matched_stop": matched,
        }
        n_in, n_out = len(ids), len(output)
        metadata = {"weight_version": meta["weight_version"]}
        if "weight_versions" in meta:
            metadata["weight_versions"] = meta["weight_versions"]
        payload = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": SIM_MODEL_NAME,
            "choices": [choice],
            "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
            "metadata": metadata,
        }
        return self._finish_response(payload, fault)

    @staticmethod
    def _finish_response(payload: dict[str, Any], fault: str | None) -> Response:
        data = orjson.dumps(payload)
        if fault == "truncated_json":
            return Response(data[: len(data) // 2], media_type="application/json")
        return Response(data, media_type="application/json")

    # ------------------------------------------------------------ info endpoints

    def model_info(self) -> dict[str, Any]:
        """SGLang's `/model_info` of the imitated release."""
        info: dict[str, Any] = {
            "model_path": self.tokenizer_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
        }
        if self.v23:
            info = {"model_path": self.tokenizer_path, "served_model_name": SIM_MODEL_NAME, **info,
                    "load_format": "auto", "reasoning_parser": None, "tool_call_parser": self.config.tool_call_parser,
                    "disaggregation_mode": "null"}
        return {**info, "has_image_understanding": False, "has_audio_understanding": False,
                "model_type": "simulated", "architectures": ["SimulatedForCausalLM"]}

    def server_info(self) -> dict[str, Any]:
        """SGLang's `/server_info` (server args + scheduler info), reduced to what callers read."""
        return {
            "model_path": self.tokenizer_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": SIM_MODEL_NAME,
            "host": self.config.host,
            "port": self.config.port,
            "tp_size": 1,
            "dp_size": 1,
            "context_length": self.config.context_length,
            "stream_interval": self.config.stream_interval,
            "incremental_streaming_output": self.config.incremental_streaming_output,
            "allow_auto_truncate": False,
            "max_running_requests": None,
            "max_queued_requests": None,
            "tool_call_parser": self.config.tool_call_parser,
            "weight_version": self.weight_version,
            "status": "ready",
            "max_total_num_tokens": self.config.context_length * 8,
            "max_req_input_len": self.max_req_input_len,
            "internal_states": [{"avg_spec_accept_length": None, "last_gen_throughput": 0.0}],
            "version": SGLANG_RELEASES[self.config.sglang_version],
            "simulated": True,
        }

    def stats_json(self) -> dict[str, Any]:
        """Counters for `/sim/stats`."""
        s = self.stats
        return {
            "model": SIM_MODEL_NAME,
            "port": self.config.port,
            "sglang_version": self.config.sglang_version,
            "requests": s.requests,
            "by_endpoint": dict(s.by_endpoint),
            "faults": dict(s.faults),
            "finish": dict(s.finish),
            "prompt_tokens": s.prompt_tokens,
            "completion_tokens": s.completion_tokens,
            "in_flight": s.in_flight,
            "max_in_flight": s.max_in_flight,
            "queued_faults": self.queued_faults(),
            "weight_version": self.weight_version,
            "paused": self.paused,
            "uptime_s": time.time() - self.started,
        }
