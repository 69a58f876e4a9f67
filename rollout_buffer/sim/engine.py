"""Simulated SGLang engine: SGLang's HTTP shape with scripted replies, for runs and tests without a GPU.

Token-in-token-out like the real server: the prompt ids are decoded with the real tokenizer, a scripted
reply is chosen (`sim.policy`), encoded with the same tokenizer and closed with the end-of-turn id.
Everything a caller relies on is honoured: `max_new_tokens` (finish `length`), stop strings and stop ids,
log-probs (deterministic negative floats), weight versions (`/update_weight_version`), `/abort_request`, and
`/pause_generation` / `/continue_generation` in SGLang's modes: `abort` answers the running requests at once
with their partial output (finish `abort`), `in_place` and `retract` hold them (their time stands still);
in every mode new requests wait until generation continues. The worker endpoints that
sglang-router calls (`/health`, `/server_info`, `/model_info` with `get_` fallbacks, `/get_load`) are served,
so the real router can sit in front of several sim engines; `model_path` is the tokenizer's absolute local
path, so nothing is ever downloaded.

A turn takes `latency_ms` plus `token_latency_ms` per output token. `/generate` with `stream: true` answers as
SGLang does by default: server-sent events, one per token as it comes out (the turn's time spread over its
tokens), each holding the output so far (`text`, `output_ids`, `meta_info.output_token_logprobs` cumulative,
`finish_reason` null until the last), then `data: [DONE]`; an abort ends the stream with finish `abort` and
the tokens streamed so far; a client that hangs up ends the generation.

Faults, each at its own rate from a seeded RNG: `abort` (partial output, finish `abort`) and errors
(`http_500`, `hang` longer than any client timeout, `reset` of the TCP connection, `truncated_json`).
Tests can queue exact faults for the next requests with `POST /sim/faults {"next": [...]}`, which works
behind a router too because it is sent to each engine directly. `GET /sim/stats` counts requests by
endpoint; `GET /sim/requests` lists the last requests (prompt length, max_new_tokens, finish, fault).

An aborted turn can be resumed the way SGLang callers do it, by resending prompt + partial output: the
engine remembers recent turns and continues the same scripted reply, so the concatenation equals the
uninterrupted output. The memory is per process: a resume sent to another engine gets a fresh reply.
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
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import orjson
from jinja2 import TemplateError
from pydantic import BaseModel, ConfigDict
from starlette.responses import Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from rollout_buffer.sim.policy import Draw, make_draw, scripted_reply
from rollout_buffer.sim.tool_calls import normalize_history, parse_tool_calls

logger = logging.getLogger(__name__)

SIM_MODEL_NAME = "sim-engine (simulated)"
PAUSE_MODES = ("abort", "in_place", "retract")
ERROR_KINDS = ("http_500", "hang", "reset", "truncated_json")
FAULT_KINDS = ("abort", *ERROR_KINDS)
_TURN_MEMORY = 8192
_RECENT_REQUESTS = 256

# SamplingParams fields SGLang accepts; anything else is refused, as SGLang does.
SGLANG_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
        "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "json_schema",
        "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens",
        "spaces_between_special_tokens", "no_stop_trim", "custom_params", "stream_interval", "logit_bias",
        "sampling_seed",
    }
)


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


@dataclass(frozen=True)
class Sampling:
    """The sampling parameters the simulation acts on, validated like SGLang's `SamplingParams.verify`."""

    max_new_tokens: int = 128
    stop: tuple[str, ...] = ()
    stop_token_ids: frozenset[int] = frozenset()
    skip_special_tokens: bool = True
    no_stop_trim: bool = False

    @classmethod
    def parse(cls, params: dict[str, Any]) -> Sampling:
        """Validate SGLang sampling params; ValueError with SGLang's wording on refusal."""
        unknown = sorted(set(params) - SGLANG_SAMPLING_KEYS)
        if unknown:
            raise ValueError(f"unexpected sampling parameter(s): {', '.join(unknown)}")
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
        max_new = int(p.get("max_new_tokens", 128))
        if max_new < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {max_new}.")
        stop = p.get("stop", ())
        if not all(isinstance(x, str) for x in ((stop,) if isinstance(stop, str) else stop)):
            raise ValueError("stop must be a string or a list of strings")
        return cls(
            max_new_tokens=max_new,
            stop=(stop,) if isinstance(stop, str) else tuple(stop),
            stop_token_ids=frozenset(int(t) for t in p.get("stop_token_ids", ())),
            skip_special_tokens=bool(p.get("skip_special_tokens", True)),
            no_stop_trim=bool(p.get("no_stop_trim", False)),
        )


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


@dataclass
class Turn:
    """The outcome of one generation request."""

    policy: str
    output_ids: list[int]
    finish: dict[str, Any]
    first_position: int  # position of the first output token inside the assistant turn
    weight_version: str = ""  # the weights its tokens were generated with


@dataclass
class _Running:
    """A request being generated: `wake` is set when it is aborted, paused or continued."""

    wake: asyncio.Event = field(default_factory=asyncio.Event)
    aborted_with: str | None = None  # the weight version when it was aborted
    elapsed: float = 0.0  # generation time spent so far (paused time excluded)


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
    # SGLang's native endpoints answer {"error": {"message"}}; its OpenAI ones {"object": "error", "message"}.
    body = {"error": {"message": message, "code": status}, "object": "error", "message": message}
    return json_response(body, status)


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
    """State of one simulated engine: tokenizer, RNGs, fault queue, turn memory and counters."""

    def __init__(self, config: SimConfig, tokenizer: Any, tokenizer_path: str):
        self.config = config
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self.eos_id = end_of_turn_id(tokenizer)
        self.vocab_size = len(tokenizer)
        self.header_ids: list[int] = tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
        self.weight_version = config.weight_version
        self.stats = SimStats()
        self.started = time.time()
        self._policy_rng = random.Random(f"{config.seed}:policy")
        self._fault_rng = random.Random(f"{config.seed}:faults")
        self._queued_faults: deque[str] = deque()
        self._turns: OrderedDict[bytes, list[list[int]]] = OrderedDict()
        self._turns_lock = threading.Lock()
        self._running: dict[str, _Running] = {}
        self._running_tokens = 0
        self.paused: str | None = None  # the /pause_generation mode in effect
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
        """The response of a fault that replaces generation, after a hang if that is the fault."""
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

    # ------------------------------------------------------------ generation (in a worker thread)

    def _split_turn(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """(context up to the last assistant header, partial assistant output after it)."""
        h = self.header_ids
        for start in range(len(ids) - len(h), -1, -1):
            if ids[start] == h[0] and ids[start : start + len(h)] == h:
                return ids[: start + len(h)], ids[start + len(h) :]
        return ids, []

    @staticmethod
    def _digest(ids: list[int]) -> bytes:
        return hashlib.blake2b(array("q", ids).tobytes(), digest_size=16).digest()

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

    def _stop_at_string(self, out: list[int], stops: tuple[str, ...]) -> tuple[int, str] | None:
        text = self.tokenizer.decode(out, skip_special_tokens=False)
        if not any(s in text for s in stops):
            return None
        for k in range(1, len(out) + 1):
            prefix = self.tokenizer.decode(out[:k], skip_special_tokens=False)
            for s in stops:
                if s in prefix:
                    return k, s
        return None

    def plan_turn(self, ids: list[int], sampling: Sampling, draw: Draw) -> Turn:
        """Choose (or continue) the scripted reply for `ids` and apply stop rules and the length limit.

        Raises ValueError for a prompt SGLang would refuse (empty, unknown ids, too long).
        """
        self._check_prompt(ids)
        context, partial = self._split_turn(ids)
        key = self._digest(context)
        full = self._recall(key, partial) if partial else None
        policy = "continue"
        if full is None:
            text = self.tokenizer.decode(ids, skip_special_tokens=False)
            policy, reply = scripted_reply(text, draw)
            full = partial + self.tokenizer.encode(reply, add_special_tokens=False) + [self.eos_id]
            self._remember(key, full)
        out = full[len(partial) :]
        finish: dict[str, Any] = {"type": "stop", "matched": self.eos_id}
        for i, token in enumerate(out):
            if token in sampling.stop_token_ids:
                out, finish = out[: i + 1], {"type": "stop", "matched": token}
                break
        if sampling.stop:
            hit = self._stop_at_string(out, sampling.stop)
            if hit is not None:
                out, finish = out[: hit[0]], {"type": "stop", "matched": hit[1]}
        limit = sampling.max_new_tokens
        if len(out) > limit:
            out, finish = out[:limit], {"type": "length", "length": limit}
        return Turn(policy=policy, output_ids=out, finish=finish, first_position=len(partial))

    def output_text(self, turn: Turn, sampling: Sampling) -> str:
        """Detokenized output as SGLang returns it (special tokens skipped, matched stop string trimmed)."""
        text = self.tokenizer.decode(turn.output_ids, skip_special_tokens=sampling.skip_special_tokens)
        matched = turn.finish.get("matched")
        if isinstance(matched, str) and not sampling.no_stop_trim and matched in text:
            text = text[: text.index(matched)]
        return text

    # ------------------------------------------------------------ request flow

    def generation_s(self, output_tokens: int) -> float:
        """How long generating a turn of `output_tokens` takes: the request latency plus the per-token one."""
        return (self.config.latency_ms + self.config.token_latency_ms * output_tokens) / 1000.0

    async def _spend(self, running: _Running, until_s: float) -> bool:
        """Spend generation time until `running.elapsed` reaches `until_s`, standing still while generation is
        paused; False when the request was aborted first."""
        while True:
            if running.aborted_with is not None:
                return False
            if self.paused is not None:
                await running.wake.wait()
                running.wake.clear()
                continue
            if running.elapsed >= until_s:
                return True
            start = time.monotonic()
            try:
                async with asyncio.timeout(until_s - running.elapsed):
                    await running.wake.wait()
            except TimeoutError:
                pass
            running.wake.clear()
            running.elapsed = min(until_s, running.elapsed + time.monotonic() - start)

    def load(self) -> list[dict[str, int]]:
        """SGLang's `/get_load` shape: one entry per data-parallel rank."""
        return [{"dp_rank": 0, "num_reqs": len(self._running), "num_waiting_reqs": 0,
                 "num_tokens": self._running_tokens}]

    def abort(self, rid: str | None, abort_all: bool) -> int:
        """Abort running requests (all, or the one with `rid`); returns how many were signalled."""
        if abort_all:
            targets = list(self._running.values())
        else:
            targets = [self._running[rid]] if rid is not None and rid in self._running else []
        for running in targets:
            running.aborted_with = self.weight_version
            running.wake.set()
        return len(targets)

    def pause(self, mode: str) -> int:
        """SGLang's `/pause_generation`: `abort` aborts the running requests, `in_place` / `retract` hold them;
        new requests wait until `resume()`. Returns how many running requests it aborted or held."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode must be one of {', '.join(PAUSE_MODES)}, got {mode!r}")
        self.paused = mode
        if mode == "abort":
            return self.abort(None, abort_all=True)
        for running in self._running.values():
            running.wake.set()
        return len(self._running)

    def resume(self) -> None:
        """SGLang's `/continue_generation`: held and waiting requests go on."""
        self.paused = None
        for running in self._running.values():
            running.wake.set()

    async def run_turn(self, ids: list[int], sampling: Sampling, rid: str, fault: str | None) -> Turn:
        """Generate one turn with latency, abort faults and `/abort_request` applied."""
        steps = [step async for step in self.turn_steps(ids, sampling, rid, fault, stream=False)]
        return steps[-1][0]

    async def turn_steps(self, ids: list[int], sampling: Sampling, rid: str, fault: str | None,
                         stream: bool) -> AsyncIterator[tuple[Turn, int, bool]]:
        """One turn as it is generated: (turn, output tokens out so far, last). Streamed, every token comes out at
        its time (the turn's generation time spread evenly over its tokens); else the turn comes out once. The
        last step carries the final turn: finish reason, output cut by an abort, weight version."""
        draw = make_draw(self._policy_rng, self.config.correct_rate, self.config.invalid_rate)
        running = self._running[rid] = _Running()
        try:
            turn = await asyncio.to_thread(self.plan_turn, ids, sampling, draw)
            n = len(turn.output_ids)
            total = self.generation_s(n)
            keep = n // 2 if fault == "abort" else n
            tokens = len(ids) + n
            self._running_tokens += tokens
            try:
                if stream and n:
                    for k in range(1, keep + 1):
                        if not await self._spend(running, total * k / n):
                            keep = k - 1
                            break
                        if k < n:
                            turn.weight_version = self.weight_version
                            yield turn, k, False
                elif not await self._spend(running, total):
                    keep = min(keep, int(n * running.elapsed / total) if total > 0 else 0)
            finally:
                self._running_tokens -= tokens
        finally:
            self._running.pop(rid, None)
        turn.weight_version = running.aborted_with or self.weight_version
        if fault == "abort" or running.aborted_with is not None:
            reason = "simulated abort" if fault == "abort" else "aborted by /abort_request"
            turn.output_ids = turn.output_ids[:keep]
            turn.finish = {"type": "abort", "message": reason, "status_code": 200}
        yield turn, len(turn.output_ids), True

    def _record(self, endpoint: str, rid: str, ids: list[int], sampling: Sampling, turn: Turn,
                fault: str | None) -> None:
        self.stats.prompt_tokens += len(ids)
        self.stats.completion_tokens += len(turn.output_ids)
        self.stats.finish[turn.finish["type"]] += 1
        self.recent.append(
            {
                "endpoint": endpoint,
                "rid": rid,
                "prompt_tokens": len(ids),
                "max_new_tokens": sampling.max_new_tokens,
                "output_tokens": len(turn.output_ids),
                "finish": turn.finish["type"],
                "policy": turn.policy,
                "fault": fault,
                "weight_version": turn.weight_version,
            }
        )

    def _check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise ValueError("the prompt is empty")
        if any(t < 0 or t >= self.vocab_size for t in ids):
            raise ValueError(f"input_ids contain token ids outside [0, {self.vocab_size})")
        if len(ids) >= self.config.context_length:
            raise ValueError(
                f"The input ({len(ids)} tokens) is longer than the model's context length "
                f"({self.config.context_length} tokens)."
            )

    async def _admit(self, stream: bool) -> tuple[str | None, Response | None]:
        """(this request's fault, the response that replaces generation: the fault's, or a refused stream)."""
        fault = self._next_fault()
        replaced = await self._fault_response(fault)
        if replaced is None and stream:
            replaced = error_response(400, "streaming is not simulated")
        return fault, replaced

    async def generate(self, body: GenerateRequest) -> Response:
        """`POST /generate` in SGLang's native shape; `stream: true` answers server-sent events."""
        fault = self._next_fault()
        refused = await self._fault_response(fault)
        if refused is not None:
            return refused
        rid = body.rid or uuid.uuid4().hex
        try:
            sampling = Sampling.parse(body.sampling_params)
            if body.input_ids is not None:
                ids = body.input_ids
            elif body.text is not None:
                ids = await asyncio.to_thread(self.tokenizer.encode, body.text, add_special_tokens=False)
            else:
                raise ValueError("either text or input_ids should be provided")
            if body.stream:
                return StreamingResponse(self._generate_events(body, rid, ids, sampling, fault),
                                         media_type="text/event-stream")
            turn = await self.run_turn(ids, sampling, rid, fault)
        except (ValueError, TypeError) as e:
            return error_response(400, str(e))
        self._record("/generate", rid, ids, sampling, turn, fault)
        return self._finish_response(self._generate_answer(body, rid, ids, sampling, turn, len(turn.output_ids), True),
                                     fault)

    async def _generate_events(self, body: GenerateRequest, rid: str, ids: list[int], sampling: Sampling,
                               fault: str | None) -> AsyncIterator[bytes]:
        """SGLang's `/generate` stream (default `incremental_streaming_output=False`): one `data:` event per token
        holding the output so far (`text`, `output_ids`, `meta_info.output_token_logprobs` cumulative), the
        finish reason in the last one, then `data: [DONE]`. A refused request is an `{"error"}` event, as SGLang
        sends its ValueErrors inside the stream. A client that leaves ends the generation (SGLang aborts it)."""
        steps = self.turn_steps(ids, sampling, rid, fault, stream=True)
        sent: tuple[Turn, int] | None = None
        try:
            async for turn, tokens, last in steps:
                answer = self._generate_answer(body, rid, ids, sampling, turn, tokens, last)
                if last:
                    sent = None
                    self._record("/generate", rid, ids, sampling, turn, fault)
                    if fault == "truncated_json":
                        data = orjson.dumps(answer)
                        yield b"data: " + data[: len(data) // 2]
                        return
                else:
                    sent = turn, tokens
                yield b"data: " + orjson.dumps(answer) + b"\n\n"
        except (ValueError, TypeError) as e:
            yield b"data: " + orjson.dumps({"error": {"message": str(e)}}) + b"\n\n"
        finally:
            await steps.aclose()
            if sent is not None:  # the client left mid-stream: recorded as SGLang's abort of a disconnected request
                turn, tokens = sent
                turn.output_ids = turn.output_ids[:tokens]
                turn.finish = {"type": "abort", "message": "client disconnected", "status_code": 200}
                self._record("/generate", rid, ids, sampling, turn, fault)
        yield b"data: [DONE]\n\n"

    def _generate_answer(self, body: GenerateRequest, rid: str, ids: list[int], sampling: Sampling, turn: Turn,
                         tokens: int, last: bool) -> dict[str, Any]:
        """The `/generate` answer for the first `tokens` output tokens of `turn` (`last`: the turn is over)."""
        out = turn.output_ids[:tokens]
        meta: dict[str, Any] = {
            "id": rid,
            "finish_reason": turn.finish if last else None,
            "prompt_tokens": len(ids),
            "completion_tokens": tokens,
            "cached_tokens": 0,
            "weight_version": turn.weight_version,
            "model": SIM_MODEL_NAME,
        }
        if body.return_logprob:
            meta["output_token_logprobs"] = [
                [
                    token_logprob(t, turn.first_position + i),
                    t,
                    self.tokenizer.decode([t]) if body.return_text_in_logprobs else None,
                ]
                for i, t in enumerate(out)
            ]
        if last:
            text = self.output_text(turn, sampling)
        else:
            # SGLang's detokenizer holds back a character whose bytes are not all generated yet.
            text = self.tokenizer.decode(out, skip_special_tokens=sampling.skip_special_tokens).rstrip("\ufffd")
        return {"text": text, "output_ids": out, "meta_info": meta}

    async def chat(self, body: ChatRequest) -> Response:
        """`POST /v1/chat/completions` in OpenAI's shape (no streaming); tool calls parsed as SGLang's
        `--tool-call-parser` does when the engine has one (`sim.tool_calls`)."""
        fault, refused = await self._admit(body.stream)
        if refused is not None:
            return refused
        extra = body.model_extra or {}
        params = {k: extra[k] for k in _CHAT_SAMPLING_KEYS if k in extra}
        limit = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        if limit is not None:
            params["max_new_tokens"] = limit
        try:
            sampling = Sampling.parse(params)
            normalize_history(body.messages)
            text = await asyncio.to_thread(
                self.tokenizer.apply_chat_template,
                body.messages,
                tools=body.tools,
                add_generation_prompt=True,
                tokenize=False,
                **(body.chat_template_kwargs or {}),
            )
            ids = await asyncio.to_thread(self.tokenizer.encode, text, add_special_tokens=False)
            rid = body.rid or f"chatcmpl-{uuid.uuid4().hex}"
            turn = await self.run_turn(ids, sampling, rid, fault)
        except (ValueError, TypeError, KeyError, TemplateError) as e:
            return error_response(400, str(e))
        self._record("/v1/chat/completions", rid, ids, sampling, turn, fault)
        logprobs = None
        if body.logprobs:
            logprobs = {
                "content": [
                    {
                        "token": self.tokenizer.decode([t]),
                        "logprob": token_logprob(t, turn.first_position + i),
                        "top_logprobs": [],
                    }
                    for i, t in enumerate(turn.output_ids)
                ]
            }
        content, calls, finish = self.output_text(turn, sampling), None, turn.finish["type"]
        matched = turn.finish.get("matched")
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
        n_in, n_out = len(ids), len(turn.output_ids)
        payload = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": SIM_MODEL_NAME,
            "choices": [choice],
            "usage": {"prompt_tokens": n_in, "completion_tokens": n_out, "total_tokens": n_in + n_out},
            "metadata": {"weight_version": turn.weight_version},
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
        """SGLang's `/model_info`."""
        return {
            "model_path": self.tokenizer_path,
            "tokenizer_path": self.tokenizer_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": "simulated",
            "architectures": ["SimulatedForCausalLM"],
            "served_model_name": SIM_MODEL_NAME,
        }

    def server_info(self) -> dict[str, Any]:
        """SGLang's `/server_info`, reduced to what callers read."""
        return {
            "model_path": self.tokenizer_path,
            "tokenizer_path": self.tokenizer_path,
            "served_model_name": SIM_MODEL_NAME,
            "host": self.config.host,
            "port": self.config.port,
            "tp_size": 1,
            "dp_size": 1,
            "context_length": self.config.context_length,
            "max_total_num_tokens": self.config.context_length * 8,
            "max_running_requests": None,
            "version": "simulated",
            "tool_call_parser": self.config.tool_call_parser,
            "weight_version": self.weight_version,
            "simulated": True,
            "internal_states": [{"avg_spec_accept_length": None, "last_gen_throughput": 0.0}],
        }

    def stats_json(self) -> dict[str, Any]:
        """Counters for `/sim/stats`."""
        s = self.stats
        return {
            "model": SIM_MODEL_NAME,
            "port": self.config.port,
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
