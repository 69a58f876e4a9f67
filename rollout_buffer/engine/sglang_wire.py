"""SGLang's wire format, both ways: the sampling params a request may carry (OpenAI and vLLM names mapped onto
SGLang's, what sglang-router drops), and the reading of its answers: a `/generate` body or stream event, the
server-sent events of a stream, chat tool calls and error bodies.

Kept apart from the client (`engine.EngineClient`), which decides what to send where and when to retry: this is
what real SGLang's requests and answers look like, with the sources cited, and nothing of retries or routing.
An answer that is not the expected shape raises `AttemptError`, which the client retries.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, replace
from typing import Any

import orjson

from rollout_buffer.engine.http_pool import Body
from rollout_buffer.engine.replay import META_KEYS as REPLAY_META_KEYS

logger = logging.getLogger(__name__)


class EnginePrompt:
    """A conversation's prompt as the engine gets it: how many ids, and their JSON array in pieces, written as
    the conversation grew (`TokenSequence.ids_json`). A long conversation resends its whole context every turn;
    serializing or copying its ids anew would cost as much as the context, not as the turn."""

    def __init__(self, length: int, ids_json: list[bytes]):
        self.length = length
        self.ids_json = ids_json

    def __len__(self) -> int:
        return self.length

    def payload(self, tail: list[int]) -> IdsJson:
        """These ids followed by `tail` (output of an interrupted generation), as a JSON array in pieces."""
        if not tail:
            return IdsJson(self.ids_json)
        more = orjson.dumps(tail)[1:-1]
        return IdsJson([*self.ids_json[:-1], b"," + more if self.length else more, b"]"])


@dataclass(frozen=True)
class IdsJson:
    """A JSON array of ids in pieces, as `request_body` puts them in a request without copying them."""

    pieces: list[bytes]


def request_body(payload: dict[str, Any]) -> Body:
    """An engine request's body; in pieces when its `input_ids` are (`IdsJson`), the ids not copied."""
    ids = payload.get("input_ids")
    if not isinstance(ids, IdsJson):
        return orjson.dumps(payload)
    rest = orjson.dumps({k: v for k, v in payload.items() if k != "input_ids"})
    return [b'{"input_ids":', *ids.pieces, b"}" if rest == b"{}" else b"," + rest[1:]]


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
_ERROR_TEXT_CHARS = 500


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


def chat_params(params: dict[str, Any]) -> dict[str, Any]:
    """OpenAI chat params, keeping OpenAI names (`max_new_tokens` is accepted as `max_tokens`)."""
    out = {k: v for k, v in params.items() if k in _CHAT_KEYS and v is not None}
    if "max_new_tokens" in params and "max_tokens" not in out:
        out["max_tokens"] = params["max_new_tokens"]
    if int(out.get("n", 1)) != 1:
        raise ValueError("n must be 1: each sample is its own request (use num_repeat_per_sample)")
    return out


class AttemptError(Exception):
    """One engine request failed (`kind` as `EngineError`'s): the client retries it or gives up."""

    def __init__(self, kind: str, reason: str, status: int | None = None):
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.status = status


def error_text(content: bytes) -> str:
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
class Chunk:
    output_ids: list[int]
    log_probs: list[float]
    text: str
    finish_reason: str  # "" for a stream's event before the last
    weight_version: str | None
    spans: list[tuple[int, str | None]] | None = None  # SGLang 0.5.23's weight_versions: (tokens, version) in order
    refusal: tuple[int, str] | None = None  # an abort with a status_code: (status_code, message)
    # The answer's replay fields (routed experts, top-p ids: `engine.replay`), as sent, when it has any.
    replay: dict[str, Any] | None = None
    prompt_tokens: int | None = None  # how many tokens the engine read the prompt as (its images expanded)


@dataclass
class GenerateDelta:
    """Tokens a streamed generation produced since the previous delta (an abort resume continues after them)."""

    output_ids: list[int]
    log_probs: list[float]  # one per output id when log-probs were requested, else empty
    text: str  # the engine's text of these tokens (text that may still become a stop string is held back)
    weight_version: str | None


class StreamCursor:
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

    def advance(self, body: Any) -> tuple[Chunk, GenerateDelta]:
        """(the event read as an answer, what it adds); `AttemptError("bad_response")` when it is not that shape."""
        chunk = parse_generate(body, self.want_logprobs, partial=True)
        if chunk.refusal is not None and not chunk.output_ids:
            return chunk, GenerateDelta([], [], "", chunk.weight_version)
        try:
            total = int(body["meta_info"].get("completion_tokens", len(chunk.output_ids)))
        except (TypeError, ValueError) as e:
            raise AttemptError("bad_response", f"unexpected /generate stream event: {e}") from None
        new = max(0, total - self.tokens)
        if new > len(chunk.output_ids):  # tokens the event does not carry (an abort's [last id] without log-probs)
            raise AttemptError("bad_response", f"stream event with {len(chunk.output_ids)} of {new} new tokens")
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


DONE = object()


def event_body(event: bytes) -> Any:
    """The JSON of one server-sent event, `DONE` for `[DONE]`, None for an event without data (a comment)."""
    data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
    if not data:
        return None
    if data == b"[DONE]":
        return DONE
    try:
        body = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise AttemptError("bad_response", f"undecodable stream event ({len(data)} bytes): {e}") from None
    if isinstance(body, dict) and body.get("error") and "meta_info" not in body:
        # SGLang reports a refused request inside the stream (its ValueErrors), after a 200 status.
        raise AttemptError("http_4xx", f"HTTP 400: {error_text(data)}", 400)
    return body


def parse_generate(body: Any, want_logprobs: bool, partial: bool = False) -> Chunk:
    """Read SGLang's `/generate` answer; `AttemptError("bad_response")` when it is not that shape.

    `partial`: a stream's event, whose `finish_reason` is null (`Chunk.finish_reason` "") until the last one.
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
                return Chunk([], [], "", kind, version, refusal=refusal)
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
        replay = {k: meta[k] for k in REPLAY_META_KEYS if k in meta} or None
        prompt = meta.get("prompt_tokens")
        return Chunk(ids, log_probs, str(body.get("text") or ""), kind, version, spans or None, refusal, replay,
                     prompt if isinstance(prompt, int) else None)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as e:
        raise AttemptError("bad_response", f"unexpected /generate response: {e}") from None


def parse_prompt_log_probs(body: Any, count: int) -> list[float]:
    """The last `count` prompt log-probs of a `/generate` answer asked them (`logprob_start_len` one before them:
    the first row of the range has none); `AttemptError("bad_response")` when it is not that shape."""
    try:
        values = [float(row[0]) for row in body["meta_info"]["input_token_logprobs"][1:]]
    except (KeyError, TypeError, IndexError, ValueError) as e:
        raise AttemptError("bad_response", f"unexpected prompt log-probs: {e}") from None
    if len(values) != count:
        raise AttemptError("bad_response", f"{len(values)} prompt log-probs for {count} tokens")
    return values


def tool_calls(calls: Any) -> list[dict[str, Any]] | None:
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

