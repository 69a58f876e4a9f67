"""What the engine client hands back: a generation's result (`GenerateResult`, built up over its abort resumes
by a `GenerationProgress`), a streamed generation (`GenerationStream`), a chat answer, the error of a call that
failed for good, and the client's counters.

Kept apart from the client (`engine.EngineClient`): these are what callers read and catch; how the client
produces them (routing, retries, resumes) is there.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from rollout_buffer.engine.replay import ReplayParts
from rollout_buffer.engine.sglang_wire import AttemptError, Chunk, GenerateDelta, tool_calls


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
    # Indices into `segments` of those generated after the weights changed within the same engine request (an
    # update under an in-place pause): the request's earlier KV cache was computed by older weights.
    mid_request: list[int] = field(default_factory=list)
    # The prompt fills the engine's context: no request was sent, nothing generated (`finish_reason` "length").
    context_full: bool = False
    # What the generation asked beside tokens (routed experts, top-p ids), when it asked (`engine.replay`).
    replay: ReplayParts | None = None


@dataclass
class GenerationProgress:
    """A generation over its engine requests (abort resumes): what they produced so far."""

    out_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)  # one per engine answer
    segments: list[tuple[int, str | None]] = field(default_factory=list)
    mid_request: list[int] = field(default_factory=list)
    attempts: int = 0
    resumed: int = 0
    version: str | None = None
    url: str = ""
    finish: str = ""
    refusal: tuple[int, str] | None = None  # the last answer's refusal abort: (status_code, message)
    context_full: bool = False
    replay: ReplayParts | None = None
    # The last answer: its tokens and its last event (None: a stream broken after some tokens).
    last_tokens: int = 0
    last: Chunk | None = None

    def add(self, delta: GenerateDelta) -> None:
        self.out_ids += delta.output_ids
        self.log_probs += delta.log_probs

    def end_segment(self, tokens: int, text: str, last: Chunk | None) -> None:
        """One engine answer is over: `tokens` output ids (already added), its whole text, and its last event
        (None: a stream broken after some tokens, ended as an abort to resume)."""
        self.texts.append(text)
        self.last_tokens, self.last = tokens, last
        if last is None:
            self.segments.append((tokens, self.version))
            self.finish, self.refusal = "abort", None
            return
        spans = last.spans
        if spans is None or sum(n for n, _ in spans) != tokens:
            spans = [(tokens, last.weight_version)]
        self.mid_request += range(len(self.segments) + 1, len(self.segments) + len(spans))
        self.segments += spans
        self.version = spans[-1][1] or self.version
        self.finish, self.refusal = last.finish_reason, last.refusal

    def result(self) -> GenerateResult:
        return GenerateResult(
            output_ids=self.out_ids, log_probs=self.log_probs, text="".join(self.texts), finish_reason=self.finish,
            weight_version=self.version, engine_url=self.url, attempts=self.attempts, resumed=self.resumed,
            segments=self.segments, mid_request=self.mid_request, context_full=self.context_full,
            replay=self.replay,
        )


class GenerationStream:
    """A streamed generation: an async iterator of `GenerateDelta`; `result` once it is exhausted."""

    def __init__(self, deltas: AsyncGenerator[GenerateDelta, None], progress: GenerationProgress):
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

    @classmethod
    def of(cls, body: Any) -> ChatResult:
        """A chat answer read (its URL and attempts the client's to fill); `AttemptError("bad_response")` when it
        is not that shape."""
        try:
            choice = body["choices"][0]
            message = choice["message"]
            text = message.get("content") or ""
            finish = str(choice.get("finish_reason") or "stop")
            calls = tool_calls(message.get("tool_calls"))
            version = (body.get("metadata") or {}).get("weight_version")
        except (KeyError, TypeError, IndexError, AttributeError, ValueError) as e:
            raise AttemptError("bad_response", f"unexpected chat response: {e}") from None
        return cls(text=text, finish_reason="stop" if finish == "tool_calls" else finish, engine_url="", attempts=0,
                   raw=body, tool_calls=calls, reasoning_content=message.get("reasoning_content") or None,
                   weight_version=None if version is None else str(version))


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



def check_images_read(progress: GenerationProgress, prompt_length: int) -> None:
    """EngineError when the engine read a prompt with images as another number of tokens than the buffer holds
    (`prompt_length`): its processor expanded them otherwise, and the record's tokens would not be those it generated
    from."""
    read = None if progress.last is None else progress.last.prompt_tokens
    if read is not None and read != prompt_length:
        raise EngineError("image_tokens", progress.url, progress.attempts, (
            f"the engine read the prompt as {read} tokens where the buffer holds {prompt_length}: it expanded the "
            "images to other counts (its checkpoint's preprocessor_config.json is not the run's tokenizer_path's, "
            "or SGLANG_MM_AVOID_RETOKENIZE is off)"))
