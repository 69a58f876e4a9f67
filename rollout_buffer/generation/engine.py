"""Client of SGLang engines (or an SGLang router): token-in-token-out `/generate` and OpenAI chat.

One instance per run, shared by every trajectory of the run: one pooled HTTP session, bounded retries
with exponential backoff for transient failures, resumption of aborted generations, and least-in-flight
engine choice with session affinity so the turns of one trajectory hit one engine's prefix cache.

What real SGLang does that this client follows (sources cited in tests/fixtures/sglang/): it refuses (HTTP 400) a
prompt plus `max_new_tokens` over the context length, so each request's `max_new_tokens` is cut to what fits
(`EngineLimits`); its scheduler refuses some requests inside an abort (`finish_reason.status_code` 400 or 503),
which fail or are retried rather than resumed; 0.5.23 reports which weights made which output tokens
(`meta_info.weight_versions`), kept per token in `GenerateResult.segments`.

Requests go through `http_pool.HttpPool` (keep-alive HTTP/1.1 parsed by httptools), not httpx or aiohttp:
httpcore's pool scans every connection for every request (several milliseconds of CPU per request at a thousand
in flight), and aiohttp's client costs about four times this one's CPU per request; the buffer must not
become the bottleneck.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import re
import time
from collections import Counter, OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, TypeVar

import httpx
import orjson

from rollout_buffer.generation.http_pool import HttpPool
from rollout_buffer.observability import metrics

logger = logging.getLogger(__name__)

# SamplingParams fields SGLang's /generate accepts (python/sglang/srt/sampling/sampling_params.py).
_SGLANG_KEYS = frozenset(
    {
        "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "stop_regex",
        "repetition_penalty", "frequency_penalty", "presence_penalty", "min_new_tokens", "ignore_eos",
        "skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "n", "logit_bias",
        "sampling_seed", "json_schema", "regex", "ebnf", "structural_tag", "custom_params",
    }
)
# Other common names (OpenAI, vLLM) mapped onto SGLang's.
_RENAMES = {
    "max_tokens": "max_new_tokens",
    "max_completion_tokens": "max_new_tokens",
    "seed": "sampling_seed",
    "include_stop_str_in_output": "no_stop_trim",
}
# OpenAI chat fields SGLang's /v1/chat/completions accepts besides messages and tools.
_CHAT_KEYS = frozenset(
    {
        "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
        "stop_token_ids", "repetition_penalty", "frequency_penalty", "presence_penalty", "n", "seed",
        "skip_special_tokens", "no_stop_trim", "ignore_eos", "min_tokens", "logit_bias", "logprobs",
        "top_logprobs", "response_format", "tool_choice", "chat_template_kwargs", "separate_reasoning",
        "stream_reasoning", "continue_final_message", "rid",
    }
)
# What sglang-router (sgl-router 0.3.2) does not pass on: its typed `SamplingParams` for `/generate`
# (sgl-router/src/protocols/sampling_params.rs) has none of these fields and re-serialises the request without
# them; its chat request drops `rid`. /start_rollout refuses them when the engine URL is a router.
ROUTER_DROPPED_SAMPLING_KEYS = frozenset(
    {"stop_regex", "logit_bias", "spaces_between_special_tokens", "structural_tag", "custom_params"}
)
ROUTER_DROPPED_CHAT_KEYS = frozenset({"rid"})
ROUTER_MAX_CHAT_STOPS = 4  # the router's chat validation: "maximum 4 stop sequences allowed"
_AFFINITY_SIZE = 100_000
# A router's queue timeout and rate limit: the request was fine, the engines were busy.
_RETRYABLE_4XX = frozenset({408, 429})
_T = TypeVar("_T")
_ERROR_TEXT_CHARS = 500
# Engine info (`probe_engine`): asked once per engine, again this long after it did not answer.
_PROBE_TIMEOUT_S = 10.0
_PROBE_RETRY_S = 30.0
# SGLang's refusals of a request that does not fit (TokenizerManager._validate_one_request; the scheduler's
# validate_input_length), with the numbers they carry. Input counts include speculative-decoding reserved tokens.
_TOTAL_OVER = re.compile(
    r"maximum context length of (\d+) tokens\. You requested a total of (\d+) tokens: (\d+) tokens"
)
_INPUT_OVER = re.compile(r"The input \((\d+) tokens\) is longer than the model's context length \((\d+) tokens\)")
_INPUT_LIMIT = re.compile(r"Input length \((\d+) tokens\) exceeds the maximum allowed length \((\d+) tokens\)")


def to_sglang_sampling_params(params: dict[str, Any], max_new_tokens: int | None = None) -> dict[str, Any]:
    """SGLang `/generate` sampling params from OpenAI-style or SGLang-style ones.

    `max_tokens` (and `max_completion_tokens`) become `max_new_tokens`, `seed` becomes `sampling_seed`,
    `include_stop_str_in_output` becomes `no_stop_trim`; an explicit `max_new_tokens` argument wins.
    Keys SGLang would refuse are dropped (logged at debug level) and `None` values are left out.
    Raises ValueError for `n` other than 1: repeats are separate requests here.
    """
    out: dict[str, Any] = {}
    dropped: list[str] = []
    for key, value in params.items():
        name = _RENAMES.get(key, key)
        if value is None:
            continue
        if name not in _SGLANG_KEYS:
            dropped.append(key)
        elif name == "max_new_tokens" and key != name and "max_new_tokens" in params:
            continue  # the SGLang name wins over its aliases
        else:
            out[name] = value
    if int(out.pop("n", 1)) != 1:
        raise ValueError("n must be 1: each sample is its own request (use num_repeat_per_sample)")
    if max_new_tokens is not None:
        out["max_new_tokens"] = max_new_tokens
    if dropped:
        logger.debug("sampling params not understood by SGLang, dropped: %s", ", ".join(sorted(dropped)))
    return out


def _chat_params(params: dict[str, Any]) -> dict[str, Any]:
    """OpenAI chat params, keeping OpenAI names (`max_new_tokens` is accepted as `max_tokens`)."""
    out = {k: v for k, v in params.items() if k in _CHAT_KEYS and v is not None}
    if "max_new_tokens" in params and "max_tokens" not in out:
        out["max_tokens"] = params["max_new_tokens"]
    if int(out.get("n", 1)) != 1:
        raise ValueError("n must be 1: each sample is its own request (use num_repeat_per_sample)")
    return out


@dataclass
class GenerateResult:
    """Output of one `/generate` call, abort resumes included."""

    output_ids: list[int]
    log_probs: list[float]  # one per output id when log-probs were requested, else empty
    text: str
    finish_reason: str  # "stop" | "length" | "abort"
    weight_version: str | None  # of the last segment
    engine_url: str
    attempts: int  # HTTP requests sent, over all resumes
    resumed: int  # abort resumes done
    # (output tokens, weight_version) in order, over the output: one per engine answer, or per span of SGLang's
    # `weight_versions` when the answer has them (weights updated in place during the request); an abort resume
    # that crosses a weight update continues with another version than the part before it.
    segments: list[tuple[int, str | None]] = field(default_factory=list)
    # The prompt fills the engine's context: no request was sent, nothing generated (`finish_reason` "length").
    context_full: bool = False


@dataclass
class _Progress:
    """A generation over its engine requests (abort resumes): what they produced so far."""

    out_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # one per engine answer
    segments: list[tuple[int, str | None]] = field(default_factory=list)
    attempts: int = 0
    resumed: int = 0
    version: str | None = None
    url: str = ""
    finish: str = ""
    refusal: tuple[int, str] | None = None  # the last answer's refusal abort: (status_code, message)
    context_full: bool = False

    def add(self, delta: GenerateDelta) -> None:
        self.out_ids += delta.output_ids
        self.log_probs += delta.log_probs

    def end_segment(self, tokens: int, text: str, last: _Chunk | None) -> None:
        """One engine answer is over: `tokens` output ids (already added), its whole text, and its last event
        (None: a stream broken after some tokens, ended as an abort to resume)."""
        self.texts.append(text)
        if last is None:
            self.segments.append((tokens, self.version))
            self.finish, self.refusal = "abort", None
            return
        spans = last.spans
        if spans is None or sum(n for n, _ in spans) != tokens:
            spans = [(tokens, last.weight_version)]
        self.segments += spans
        self.version = spans[-1][1] or self.version
        self.finish, self.refusal = last.finish_reason, last.refusal

    def result(self) -> GenerateResult:
        return GenerateResult(
            output_ids=self.out_ids, log_probs=self.log_probs, text="".join(self.texts), finish_reason=self.finish,
            weight_version=self.version, engine_url=self.url, attempts=self.attempts, resumed=self.resumed,
            segments=self.segments, context_full=self.context_full,
        )


class GenerationStream:
    """A streamed generation: an async iterator of `GenerateDelta`; `result` once it is exhausted."""

    def __init__(self, deltas: AsyncGenerator[GenerateDelta, None], progress: _Progress):
        self._deltas = deltas
        self._progress = progress
        self._done = False

    def __aiter__(self) -> GenerationStream:
        return self

    async def __anext__(self) -> GenerateDelta:
        try:
            return await anext(self._deltas)
        except StopAsyncIteration:
            self._done = True
            raise

    async def aclose(self) -> None:
        """Stop early: the engine request is closed (and aborted by the engine)."""
        await self._deltas.aclose()

    @property
    def result(self) -> GenerateResult:
        """The whole generation, as `EngineClient.generate` returns it; only after the last delta."""
        if not self._done:
            raise RuntimeError("the generation is still being streamed")
        return self._progress.result()


@dataclass
class ChatResult:
    """Output of one `/v1/chat/completions` call.

    With a tool-call parser (`--tool-call-parser`) SGLang answers the calls as OpenAI `message.tool_calls`
    (`text` is then the content without the call tags) and finish reason `tool_calls`; that reason is
    reported here as `stop`, what `/generate` says for the same turn, so generators read both modes alike.
    """

    text: str
    finish_reason: str
    engine_url: str
    attempts: int
    raw: dict[str, Any]
    tool_calls: list[dict[str, Any]] | None = None  # OpenAI shape: {"id", "type", "function": {"name", "arguments"}}
    reasoning_content: str | None = None  # set when the server separates reasoning (`--reasoning-parser`)
    weight_version: str | None = None  # SGLang's `metadata.weight_version`, when the answer has it
    # The prompt fills the engine's context (SGLang refused it): nothing generated, `finish_reason` "length".
    context_full: bool = False


class EngineError(Exception):
    """An engine call failed for good: retries exhausted, or the engine refused the request (4xx)."""

    def __init__(self, kind: str, url: str, attempts: int, reason: str, status: int | None = None):
        super().__init__(f"engine {url} failed ({kind}) after {attempts} attempt(s): {reason}")
        # "http_5xx" | "http_4xx" | "timeout" | "connection" | "bad_response" | "refused" (a refusal abort)
        self.kind = kind
        self.url = url
        self.attempts = attempts
        self.reason = reason
        self.status = status


class _AttemptError(Exception):
    def __init__(self, kind: str, reason: str, status: int | None = None):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.status = status


@dataclass
class EngineStats:
    """Counters of the client; the metrics module exports them."""

    requests: int = 0
    errors: Counter[str] = field(default_factory=Counter)
    retries: int = 0
    aborts_resumed: int = 0
    aborted_results: int = 0
    requests_by_url: Counter[str] = field(default_factory=Counter)
    in_flight: Counter[str] = field(default_factory=Counter)
    latency_sum_s: float = 0.0
    latency_count: int = 0
    clamped: int = 0  # requests whose max_new_tokens was cut to the engine's context
    context_full: int = 0  # generations not sent (or not resumed): the prompt fills the context

    def snapshot(self) -> dict[str, Any]:
        """A plain-dict copy, for logs and `/status`."""
        return {
            "requests": self.requests,
            "errors": dict(self.errors),
            "retries": self.retries,
            "aborts_resumed": self.aborts_resumed,
            "aborted_results": self.aborted_results,
            "requests_by_url": dict(self.requests_by_url),
            "in_flight": {u: n for u, n in self.in_flight.items() if n},
            "latency_sum_s": self.latency_sum_s,
            "latency_count": self.latency_count,
            "clamped": self.clamped,
            "context_full": self.context_full,
        }


def _error_text(content: bytes) -> str:
    """The engine's own message from an error body (`{"error": {"message"}}`, `{"message"}`, `{"detail"}`)."""
    try:
        body = orjson.loads(content)
    except orjson.JSONDecodeError:
        body = None
    if isinstance(body, dict):
        err = body.get("error")
        for message in (err.get("message") if isinstance(err, dict) else err, body.get("message"),
                        body.get("detail")):
            if message:
                return str(message)[:_ERROR_TEXT_CHARS]
    return content.decode(errors="replace")[:_ERROR_TEXT_CHARS]


@dataclass
class _Chunk:
    output_ids: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str  # "" for a stream's event before the last
    weight_version: str | None
    spans: list[tuple[int, str | None]] | None = None  # SGLang 0.5.23's weight_versions: (tokens, version) in order
    refusal: tuple[int, str] | None = None  # an abort with a status_code: (status_code, message)


@dataclass
class GenerateDelta:
    """Tokens a streamed generation produced since the previous delta (an abort resume continues after them)."""

    output_ids: list[int]
    log_probs: list[float]  # one per output id when log-probs were requested, else empty
    text: str  # the engine's text of these tokens (text that may still become a stop string is held back)
    weight_version: str | None


class _StreamCursor:
    """Turns the events of one SGLang `/generate` stream into increments.

    SGLang sends the output so far in each event by default, only the new part with
    `--incremental-streaming-output`; `meta_info.completion_tokens` counts the output so far in both modes, so
    the new tokens are the last `completion_tokens - seen` of the event's, whichever mode the engine runs.
    """

    def __init__(self, want_logprobs: bool, stops: list[str]):
        self.want_logprobs = want_logprobs
        self.stops = stops
        self.tokens = 0
        self.text = ""  # the segment's text so far, as the engine detokenized it
        self.sent_chars = 0  # of `text`, given out in deltas

    def advance(self, body: Any) -> tuple[_Chunk, GenerateDelta]:
        """(the event read as an answer, what it adds); `_AttemptError("bad_response")` when it is not that shape."""
        chunk = _parse_generate(body, self.want_logprobs, partial=True)
        if chunk.refusal is not None and not chunk.output_ids:
            return chunk, GenerateDelta([], [], "", chunk.weight_version)
        try:
            total = int(body["meta_info"].get("completion_tokens", len(chunk.output_ids)))
        except (TypeError, ValueError) as e:
            raise _AttemptError("bad_response", f"unexpected /generate stream event: {e}") from None
        new = max(0, total - self.tokens)
        if new > len(chunk.output_ids):  # tokens the event does not carry (an abort's [last id] without log-probs)
            raise _AttemptError("bad_response", f"stream event with {len(chunk.output_ids)} of {new} new tokens")
        # The output so far, or only its new part (incremental); an abort answered by the tokenizer manager's
        # `_handle_abort_req` (a request in the waiting queue; its meta_info has no prompt_tokens) has the whole
        # text whatever its ids.
        cumulative = len(chunk.output_ids) == total or (chunk.finish_reason == "abort" and
                                                        "prompt_tokens" not in body["meta_info"])
        ids = chunk.output_ids[len(chunk.output_ids) - new:] if new else []
        log_probs = chunk.log_probs[len(chunk.log_probs) - new:] if new and self.want_logprobs else []
        self.tokens = total
        self.text = chunk.text if cumulative else self.text + chunk.text
        end = len(self.text) if chunk.finish_reason else len(self.text) - _stop_prefix(self.text, self.stops)
        text = self.text[self.sent_chars:end] if end > self.sent_chars else ""
        self.sent_chars = max(self.sent_chars, end)
        return replace(chunk, output_ids=ids, log_probs=log_probs, text=self.text), \
            GenerateDelta(ids, log_probs, text, chunk.weight_version)


def _stop_prefix(text: str, stops: list[str]) -> int:
    """Length of the longest end of `text` that begins a stop string (the engine may still trim it)."""
    longest = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:n]):
                longest = n
                break
    return longest


_DONE = object()


def _event_body(event: bytes) -> Any:
    """The JSON of one server-sent event, `_DONE` for `[DONE]`, None for an event without data (a comment)."""
    data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    if not data:
        return None
    if data == b"[DONE]":
        return _DONE
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise _AttemptError("bad_response", f"undecodable stream event ({len(data)} bytes): {e}") from None
    if isinstance(body, dict) and body.get("error") and "meta_info" not in body:
        # SGLang reports a refused request inside the stream (its ValueErrors), after a 200 status.
        raise _AttemptError("http_4xx", f"HTTP 400: {_error_text(data)}", 400)
    return body


def _parse_generate(body: Any, want_logprobs: bool, partial: bool = False) -> _Chunk:
    """Read SGLang's `/generate` answer; `_AttemptError("bad_response")` when it is not that shape.

    `partial`: a stream's event, whose `finish_reason` is null (`_Chunk.finish_reason` "") until the last one.
    An abort whose finish_reason carries an error `status_code` (the scheduler's FINISH_ABORT / AbortReq refusals)
    is a refusal; a 4xx one carries no output of the request (Req.set_finish_with_abort prefills a stand-in
    token without log-probs), a 5xx one its real partial output. `weight_versions` (SGLang 0.5.23, in a finished
    answer) are read as (tokens, version) spans.
    """
    try:
        meta = body["meta_info"]
        finish = meta.get("finish_reason")
        kind = str(finish.get("type")) if isinstance(finish, dict) else str(finish or "")
        if kind not in ("stop", "length", "abort") and not (partial and finish is None):
            raise ValueError(f"unknown finish_reason {finish!r}")
        version = meta.get("weight_version")
        version = None if version is None else str(version)
        refusal = None
        status = finish.get("status_code") if kind == "abort" and isinstance(finish, dict) else None
        if isinstance(status, int) and 400 <= status < 600:  # as TokenizerManager._handle_abort_finish_reason
            refusal = (status, str(finish.get("message") or "aborted"))
            if status < 500:
                return _Chunk([], [], "", kind, version, refusal=refusal)
        entries = meta.get("output_token_logprobs") or []
        ids = body.get("output_ids")
        # Fewer ids than log-prob entries: 0.5.15's streamed `_handle_abort_req` keeps only the last output id.
        ids = [int(e[1]) for e in entries] if ids is None or len(ids) < len(entries) else [int(t) for t in ids]
        log_probs = [float(e[0]) for e in entries] if want_logprobs else []
        if want_logprobs and len(log_probs) != len(ids):
            raise ValueError(f"{len(log_probs)} log-probs for {len(ids)} output tokens")
        spans = meta.get("weight_versions")
        if spans:
            spans = [(int(s["end"]) - int(s["start"]), str(s["version"])) for s in spans]
        return _Chunk(ids, log_probs, str(body.get("text") or ""), kind, version, spans or None, refusal)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise _AttemptError("bad_response", f"unexpected /generate response: {e}") from None


def _tool_calls(calls: Any) -> list[dict[str, Any]] | None:
    """`message.tool_calls` of a chat answer in the OpenAI request shape (what goes back into `messages`):
    `id`, `type` and `function` with its `name` and `arguments` as a JSON string; None when there are none.
    ValueError when they are not that shape."""
    if not calls:
        return None
    out = []
    for call in calls:
        function = call["function"]
        name, arguments = function["name"], function.get("arguments")
        if not isinstance(name, str):
            raise ValueError(f"tool call name {name!r} is not a string")
        if not isinstance(arguments, str):  # some servers send an object: written as SGLang's parser writes it
            arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
        out.append({"id": call.get("id"), "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


@dataclass(frozen=True)
class EngineLimits:
    """What one engine URL takes. SGLang refuses (HTTP 400) a prompt plus `max_new_tokens` over `context_length`
    and a prompt of `max_input_tokens` or more (its scheduler's `max_req_input_len`); `router`: the URL is an
    sglang-router, and the limits (when known) are those of its first worker."""

    context_length: int | None = None
    max_input_tokens: int | None = None
    router: bool = False

    def room(self, prompt_tokens: int) -> int | None:
        """Output tokens that fit after a prompt of `prompt_tokens`; None when the context length is unknown."""
        if self.max_input_tokens is not None and prompt_tokens >= self.max_input_tokens:
            return 0
        return None if self.context_length is None else max(0, self.context_length - prompt_tokens)


_UNKNOWN = EngineLimits()


def _positive(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


async def _get_json(http: httpx.AsyncClient, url: str) -> Any:
    """The decoded JSON of a GET, None when it is not a 200 with JSON; transport failures raise httpx.HTTPError."""
    response = await http.get(url)
    if response.status_code != 200:
        return None
    try:
        return orjson.loads(response.content)
    except orjson.JSONDecodeError:
        return None


async def _engine_limits(http: httpx.AsyncClient, url: str, info: Any) -> EngineLimits:
    """An SGLang engine's limits: `/v1/models` `max_model_len` (its model_config.context_len, what its length
    check uses), else `/get_server_info` `context_length` (the --context-length flag, null when not given);
    `max_req_input_len` from `/get_server_info` (the scheduler's, merged in there)."""
    if not isinstance(info, dict):
        info = {}
    models = await _get_json(http, f"{url}/v1/models")
    cards = models.get("data") if isinstance(models, dict) else None
    card = cards[0] if isinstance(cards, list) and cards and isinstance(cards[0], dict) else {}
    context = _positive(card.get("max_model_len")) or _positive(info.get("context_length"))
    return EngineLimits(context, _positive(info.get("max_req_input_len")))


async def probe_engine(url: str, timeout_s: float = _PROBE_TIMEOUT_S) -> EngineLimits | None:
    """Ask an engine URL what it takes; None when it does not answer.

    `/get_server_info` tells a router from an engine: sglang-router answers it itself with
    `{"router_manager": true, ...}` (and serves its own `/v1/models`, without `max_model_len`), so behind a router
    the limits are read from its first worker listed by `/workers`, when that worker answers this process.
    """
    url = url.rstrip("/")
    async with httpx.AsyncClient(timeout=timeout_s, trust_env=False) as http:  # no proxies, as HttpPool
        try:
            info = await _get_json(http, f"{url}/get_server_info")
            if not (isinstance(info, dict) and "router_manager" in info):
                return await _engine_limits(http, url, info)
        except httpx.HTTPError:
            return None
        try:
            listed = await _get_json(http, f"{url}/workers")
            workers = listed.get("workers") if isinstance(listed, dict) else None
            worker = workers[0].get("url") if isinstance(workers, list) and workers else None
            if isinstance(worker, str):
                worker = worker.rstrip("/")
                return replace(await _engine_limits(http, worker, await _get_json(http, f"{worker}/get_server_info")),
                               router=True)
        except (httpx.HTTPError, AttributeError):
            pass
        return EngineLimits(router=True)


def _overflow(reason: str, prompt_tokens: int) -> EngineLimits | None:
    """The limits SGLang's context refusal `reason` tells of, for a prompt of `prompt_tokens`; None for another
    refusal, or one whose numbers do not say the request overflows. The context length learnt is net of the tokens
    the engine reserves (speculative decoding)."""
    if (m := _TOTAL_OVER.search(reason)) and int(m[2]) > int(m[1]):
        return EngineLimits(int(m[1]) - int(m[3]) + prompt_tokens)
    if (m := _INPUT_OVER.search(reason)) and int(m[1]) >= int(m[2]):
        return EngineLimits(int(m[2]) - int(m[1]) + prompt_tokens)
    if (m := _INPUT_LIMIT.search(reason)) and int(m[1]) >= int(m[2]):
        return EngineLimits(max_input_tokens=int(m[2]))
    return None


class EngineClient:
    """Calls SGLang engines with retries, abort resumption and least-in-flight + session-affinity routing.

    Give one URL for a router (or a single engine), several for engines balanced by this client.
    Connection errors, timeouts, 5xx, undecodable answers and a router's 408/429 are retried with
    exponential backoff; other 4xx fail at once; SGLang's refusal aborts (an abort with a `status_code`) go by
    their status the same way. Each engine's context length is read once (`limits`) and every request fitted
    to it; `context_length` overrides what the engines report.
    """

    def __init__(
        self,
        urls: list[str],
        *,
        timeout_s: float = 600.0,
        max_retries: int = 3,
        backoff_s: float = 0.5,
        max_backoff_s: float = 10.0,
        max_abort_resumes: int = 3,
        max_connections: int = 4096,
        context_length: int | None = None,
    ):
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        if max_retries < 0 or max_abort_resumes < 0:
            raise ValueError("max_retries and max_abort_resumes must be >= 0")
        self.urls = [u.rstrip("/") for u in urls]
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_abort_resumes = max_abort_resumes
        self.max_connections = max_connections
        self.stats = EngineStats()
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._pool: HttpPool | None = None
        # Per engine URL: its limits, probed once (or the run's context_length), refined by its refusals.
        self._limits: dict[str, EngineLimits] = {}
        if context_length is not None:
            self._limits = dict.fromkeys(self.urls, EngineLimits(int(context_length)))
        self._probes: dict[str, asyncio.Future[EngineLimits | None]] = {}
        self._probe_after: dict[str, float] = {}

    def _http(self) -> HttpPool:
        # Created on first use, and again under another event loop: connections belong to the loop.
        if self._pool is None or self._pool.closed or self._pool.loop is not asyncio.get_running_loop():
            self._pool = HttpPool(self.max_connections, self.timeout_s)
        return self._pool

    # ------------------------------------------------------------ routing

    def _pick(self, session_id: str, avoid: set[str]) -> str:
        """The session's engine, or the least-in-flight one (ties: fewest requests so far)."""
        url = self._affinity.get(session_id)
        if url is not None and url not in avoid:
            self._affinity.move_to_end(session_id)
            return url
        candidates = [u for u in self.urls if u not in avoid] or self.urls
        url = min(candidates, key=lambda u: (self.stats.in_flight[u], self.stats.requests_by_url[u]))
        self._affinity[session_id] = url
        self._affinity.move_to_end(session_id)
        if len(self._affinity) > _AFFINITY_SIZE:
            self._affinity.popitem(last=False)
        return url

    def release(self, session_id: str) -> None:
        """Forget the engine of a finished session."""
        self._affinity.pop(session_id, None)

    async def limits(self, url: str) -> EngineLimits:
        """What the engine at `url` takes: probed on first use (one probe shared by concurrent callers), then
        kept; an engine that did not answer is asked again after a while, unknown meanwhile."""
        limits = self._limits.get(url)
        if limits is not None:
            return limits
        probe = self._probes.get(url)
        if probe is None or probe.get_loop() is not asyncio.get_running_loop():
            if time.monotonic() < self._probe_after.get(url, 0.0):
                return _UNKNOWN
            probe = self._probes[url] = asyncio.ensure_future(probe_engine(url, min(self.timeout_s, _PROBE_TIMEOUT_S)))
        found = await asyncio.shield(probe)  # a cancelled turn leaves the shared probe running
        if self._probes.get(url) is probe:
            del self._probes[url]
        if found is None:
            self._probe_after[url] = time.monotonic() + _PROBE_RETRY_S
            return _UNKNOWN
        return self._limits.setdefault(url, found)

    async def _probe_all(self) -> None:
        """Probe every engine whose limits are not known yet, so that choosing one and sending to it needs no
        await between them (least-in-flight counts a request only once it is sent)."""
        now = time.monotonic()
        unknown = [u for u in self.urls if u not in self._limits and now >= self._probe_after.get(u, 0.0)]
        if unknown:
            await asyncio.gather(*map(self.limits, unknown))

    def _fit(self, url: str, reason: str, prompt_tokens: int, sent: int | None) -> bool:
        """Whether `reason` is SGLang's refusal of a request that does not fit (asking `sent` new tokens), one that
        fitting changes; the limits it tells of are kept."""
        seen = _overflow(reason, prompt_tokens)
        if seen is None:
            return False
        known = self._limits.get(url, _UNKNOWN)
        self._limits[url] = replace(known, context_length=seen.context_length or known.context_length,
                                    max_input_tokens=seen.max_input_tokens or known.max_input_tokens)
        room = seen.room(prompt_tokens)
        return room is not None and (room == 0 or sent is None or room < sent)

    # ------------------------------------------------------------ HTTP with retries

    @contextlib.contextmanager
    def _counted(self, url: str, path: str) -> Iterator[None]:
        """One request to `url`: in the stats while it runs, its time observed; transport failures raised as
        `_AttemptError`s (timeout, connection)."""
        stats = self.stats
        stats.requests += 1
        stats.requests_by_url[url] += 1
        stats.in_flight[url] += 1
        start = time.monotonic()
        try:
            yield
        except TimeoutError as e:  # before OSError, of which it is one
            raise _AttemptError("timeout", f"no answer within {self.timeout_s}s ({type(e).__name__})") from None
        except OSError as e:
            raise _AttemptError("connection", f"{type(e).__name__}: {e}") from None
        finally:
            elapsed = time.monotonic() - start
            stats.in_flight[url] -= 1
            stats.latency_sum_s += elapsed
            stats.latency_count += 1
            metrics.ENGINE_REQUEST_SECONDS.labels(path).observe(elapsed)

    async def _attempt(self, url: str, path: str, payload: dict[str, Any]) -> Any:
        with self._counted(url, path):
            status, content = await self._http().post(url, path, orjson.dumps(payload))
        if status >= 400:
            kind = "http_5xx" if status >= 500 else "http_4xx"
            raise _AttemptError(kind, f"HTTP {status}: {_error_text(content)}", status)
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError as e:
            raise _AttemptError("bad_response", f"undecodable JSON ({len(content)} bytes): {e}") from None

    def _backoff(self, attempt: int) -> float:
        delay = min(self.max_backoff_s, self.backoff_s * 2**attempt)
        return delay * (0.5 + random.random() / 2)  # jitter spreads the retries of many trajectories

    async def _post(self, path: str, payload: dict[str, Any], session_id: str,
                    parse: Callable[[Any], _T]) -> tuple[_T, str, int]:
        """POST with bounded retries; returns (parsed body, engine URL, attempts).

        `parse` reads the decoded body and may raise `_AttemptError("bad_response")`, which is retried.
        """
        async def attempt(url: str) -> _T:
            return parse(await self._attempt(url, path, payload))

        return await self._retried(path, session_id, attempt)

    async def _retried(self, path: str, session_id: str, attempt: Callable[[str], Awaitable[_T]]
                       ) -> tuple[_T, str, int]:
        """`attempt(engine URL)` with bounded retries; returns (its result, engine URL, attempts)."""
        avoid: set[str] = set()
        n = 0
        while True:
            n += 1
            url = self._pick(session_id, avoid)
            try:
                return await attempt(url), url, n
            except _AttemptError as e:
                self._count_error(e)
                if (e.kind == "http_4xx" and e.status not in _RETRYABLE_4XX) or n > self.max_retries:
                    raise EngineError(e.kind, url, n, e.reason, e.status) from None
                if e.kind == "connection" and len(self.urls) > 1:
                    # The session's engine may be gone: let the retry go to another one.
                    avoid.add(url)
                    self._affinity.pop(session_id, None)
                self.stats.retries += 1
                metrics.ENGINE_RETRIES.inc()
                delay = self._backoff(n - 1)
                logger.info("engine %s%s: %s (%s); retry %d/%d in %.2fs", url, path, e.kind, e.reason,
                            n, self.max_retries, delay)
                await asyncio.sleep(delay)

    def _count_error(self, e: _AttemptError) -> None:
        self.stats.errors[e.kind] += 1
        metrics.ENGINE_ERRORS.labels(e.kind).inc()

    # ------------------------------------------------------------ streams

    async def _events(self, url: str, payload: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """The decoded `data:` events of one streamed `/generate` request, up to `data: [DONE]`.

        Raises `_AttemptError` for a refused request (status, or SGLang's `{"error"}` event, a 400), a broken
        connection and an undecodable event. Closing the iterator closes the connection: SGLang then aborts
        the request.
        """
        with self._counted(url, "/generate"):
            async with self._http().stream(url, "/generate", orjson.dumps(payload)) as response:
                if response.status >= 400:
                    kind = "http_5xx" if response.status >= 500 else "http_4xx"
                    reason = f"HTTP {response.status}: {_error_text(await response.read())}"
                    raise _AttemptError(kind, reason, response.status)
                pending = b""
                async for data in response:
                    pending += data
                    *events, pending = pending.split(b"\n\n")
                    for event in events:
                        body = _event_body(event)
                        if body is _DONE:
                            return
                        if body is not None:
                            yield body
                if pending.strip():
                    _event_body(pending)  # raises: a stream cut inside an event
                raise _AttemptError("bad_response", "the stream ended without data: [DONE]")

    async def _open_stream(self, payload: dict[str, Any], session_id: str
                           ) -> tuple[Any, AsyncGenerator[Any, None], str, int]:
        """A streamed `/generate` request once its first event arrived, retried like any request until then:
        (first event, the rest, engine URL, attempts)."""
        async def attempt(url: str) -> tuple[Any, AsyncGenerator[Any, None]]:
            events = self._events(url, payload)
            try:
                return await anext(events), events
            except StopAsyncIteration:
                raise _AttemptError("bad_response", "the stream ended before any event") from None
            except BaseException:
                await events.aclose()
                raise

        (first, events), url, attempts = await self._retried("/generate", session_id, attempt)
        return first, events, url, attempts

    async def _stream_segment(self, payload: dict[str, Any], session_id: str, cursor: _StreamCursor,
                              progress: _Progress) -> AsyncIterator[GenerateDelta]:
        """One streamed engine request: its deltas; `progress` gets its chunks. A stream broken after its first
        event ends the segment as an abort, to be resumed from the tokens it gave."""
        first, events, url, attempts = await self._open_stream(payload, session_id)
        progress.url = url
        progress.attempts += attempts
        chunk = None
        try:
            body: Any = first
            while True:
                chunk, delta = cursor.advance(body)
                progress.add(delta)
                if delta.output_ids or delta.text:
                    yield delta
                if chunk.finish_reason:
                    break
                body = await anext(events)
        except _AttemptError as e:
            self._count_error(e)
            logger.info("engine %s/generate: stream broken after %d token(s): %s (%s); resuming",
                        url, cursor.tokens, e.kind, e.reason)
            chunk = None
        except StopAsyncIteration:
            chunk = None
        finally:
            await events.aclose()
        progress.end_segment(cursor.tokens, cursor.text, chunk)

    # ------------------------------------------------------------ public API

    async def generate(self, input_ids: list[int], sampling_params: dict[str, Any], *, session_id: str,
                       return_logprob: bool = True) -> GenerateResult:
        """Token-in-token-out generation; an aborted generation is resumed from its partial output.

        A resume resends `input_ids + output so far` with `max_new_tokens` reduced by what was generated,
        at most `max_abort_resumes` times; output ids and log-probs are concatenated. If the engine still
        aborts, the result says `finish_reason="abort"`.
        """
        progress = _Progress()
        async for _ in self._generation(input_ids, sampling_params, session_id, return_logprob, progress, False):
            pass
        return progress.result()

    def generate_stream(self, input_ids: list[int], sampling_params: dict[str, Any], *, session_id: str,
                        return_logprob: bool = True) -> GenerationStream:
        """`generate` streamed: iterate the result for the tokens as the engine produces them (`GenerateDelta`),
        then read `.result`, the same `GenerateResult` as `generate`'s.

        Same guarantees: a request that fails before its first token is retried; an abort (a weight update)
        or a stream broken after some tokens is resumed from the tokens already streamed, which are kept.
        Leaving the iteration early (`aclose`) closes the engine request, which the engine then aborts.
        """
        progress = _Progress()
        deltas = self._generation(input_ids, sampling_params, session_id, return_logprob, progress, True)
        return GenerationStream(deltas, progress)

    async def _generation(self, input_ids: list[int], sampling_params: dict[str, Any], session_id: str,
                          return_logprob: bool, progress: _Progress, stream: bool
                          ) -> AsyncGenerator[GenerateDelta, None]:
        """The engine requests of one generation, abort resumes included; streamed ones yield their deltas.

        Each request's `max_new_tokens` is cut to what fits the engine's context; a prompt that fills it is not
        sent (finish "length"). A context refusal (400) teaches the engine's limits and is fitted once. A refusal
        abort with a 4xx fails at once (kind "refused"), one with a 5xx is retried like a 5xx (`max_retries`,
        backoff) from the output so far; a plain abort (a weight update) is resumed.
        """
        params = to_sglang_sampling_params(sampling_params)
        budget = params.get("max_new_tokens")
        stop = params.get("stop") or []
        stops = [stop] if isinstance(stop, str) else list(stop)
        refusals = 0
        fitted = False
        while True:
            prompt = [*input_ids, *progress.out_ids]
            if len(self._limits) < len(self.urls):
                await self._probe_all()
            progress.url = self._pick(session_id, set())
            room = self._limits.get(progress.url, _UNKNOWN).room(len(prompt))
            want = None if budget is None else budget - len(progress.out_ids)
            if room == 0:
                progress.finish, progress.context_full = "length", not progress.out_ids
                self.stats.context_full += 1
                break
            if room is not None and want is not None and want > room:
                want = room
                self.stats.clamped += 1
            if want is not None:
                params["max_new_tokens"] = want
            payload = {"input_ids": prompt, "sampling_params": params, "return_logprob": return_logprob}
            try:
                if stream:
                    payload["stream"] = True
                    async for delta in self._stream_segment(payload, session_id, _StreamCursor(return_logprob, stops),
                                                            progress):
                        yield delta
                else:
                    chunk, progress.url, n = await self._post(
                        "/generate", payload, session_id, lambda body: _parse_generate(body, return_logprob)
                    )
                    progress.attempts += n
                    progress.add(GenerateDelta(chunk.output_ids, chunk.log_probs, chunk.text, chunk.weight_version))
                    progress.end_segment(len(chunk.output_ids), chunk.text, chunk)
            except EngineError as e:
                progress.attempts += e.attempts
                if fitted or e.status != 400 or not self._fit(e.url, e.reason, len(prompt), want):
                    raise
                fitted = True
                continue
            if progress.refusal is not None:
                status, message = progress.refusal
                progress.refusal = None
                kind = "http_5xx" if status >= 500 else "http_4xx" if status in _RETRYABLE_4XX else "refused"
                self._count_error(_AttemptError(kind, message, status))
                if kind == "refused" and not fitted and self._fit(progress.url, message, len(prompt), want):
                    fitted = True
                    continue
                if kind == "refused" or refusals >= self.max_retries:
                    raise EngineError(kind, progress.url, progress.attempts, message, status)
                refusals += 1
                self.stats.retries += 1
                metrics.ENGINE_RETRIES.inc()
                delay = self._backoff(refusals - 1)
                logger.info("engine %s/generate refused (%d: %s); retry %d/%d in %.2fs", progress.url, status,
                            message, refusals, self.max_retries, delay)
                await asyncio.sleep(delay)
                continue
            if progress.finish != "abort" or progress.resumed >= self.max_abort_resumes:
                break
            progress.resumed += 1
            self.stats.aborts_resumed += 1
            metrics.ENGINE_ABORT_RESUMES.inc()
            await asyncio.sleep(self._backoff(progress.resumed - 1))
        metrics.TOKENS_GENERATED.inc(len(progress.out_ids))
        if progress.finish == "abort":
            self.stats.aborted_results += 1

    async def chat(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any], *, session_id: str,
                   tools: list[dict[str, Any]] | None = None) -> ChatResult:
        """OpenAI chat completion (messages in, message out); no abort resumption in this mode.

        The engine counts the prompt's tokens here, so the context is fitted only from its refusal: a request
        refused for overflowing the context is sent once more with `max_tokens` what the refusal leaves, or not at
        all when the prompt alone fills it (`context_full`).
        """
        payload: dict[str, Any] = {"model": "default", **_chat_params(sampling_params), "messages": messages}
        if tools:
            payload["tools"] = tools

        def check(body: Any) -> ChatResult:
            try:
                choice = body["choices"][0]
                message = choice["message"]
                text = message.get("content") or ""
                finish = str(choice.get("finish_reason") or "stop")
                calls = _tool_calls(message.get("tool_calls"))
                version = (body.get("metadata") or {}).get("weight_version")
            except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
                raise _AttemptError("bad_response", f"unexpected chat response: {e}") from None
            return ChatResult(text=text, finish_reason="stop" if finish == "tool_calls" else finish, engine_url="",
                              attempts=0, raw=body, tool_calls=calls,
                              reasoning_content=message.get("reasoning_content") or None,
                              weight_version=None if version is None else str(version))

        try:
            result, url, attempts = await self._post("/v1/chat/completions", payload, session_id, check)
        except EngineError as e:
            seen = _overflow(e.reason, 0) if e.status == 400 else None
            if seen is None:
                raise
            room = seen.room(0) or 0  # with 0 for the prompt: what the refusal leaves of the context
            sent = payload.get("max_completion_tokens") or payload.get("max_tokens")
            if room and sent is not None and room >= sent:
                raise
            if room == 0:
                self.stats.context_full += 1
                return ChatResult(text="", finish_reason="length", engine_url=e.url, attempts=e.attempts, raw={},
                                  context_full=True)
            self.stats.clamped += 1
            payload.pop("max_completion_tokens", None)
            payload["max_tokens"] = room
            result, url, attempts = await self._post("/v1/chat/completions", payload, session_id, check)
            attempts += e.attempts
        result.engine_url, result.attempts = url, attempts
        metrics.TOKENS_GENERATED.inc(metrics.chat_tokens(result.raw))
        if result.finish_reason == "abort":
            self.stats.aborted_results += 1
        return result

    async def aclose(self) -> None:
        """Close the pooled connections (and stop engine probes still running)."""
        for probe in self._probes.values():
            probe.cancel()
        if self._pool is not None:
            await self._pool.aclose()
