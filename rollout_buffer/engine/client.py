"""Client of SGLang engines (or an SGLang router): token-in-token-out `/generate` and OpenAI chat.

One instance per run, shared by every trajectory of the run: one pooled HTTP session, bounded retries
with exponential backoff for transient failures, resumption of aborted generations, and least-in-flight
engine choice with session affinity so the turns of one trajectory hit one engine's prefix cache.

What real SGLang does that this client follows (sources cited in tests/fixtures/sglang/): it refuses (HTTP 400) a
prompt plus `max_new_tokens` over the context length, so each request's `max_new_tokens` is cut to what fits
(`EngineLimits`); its scheduler refuses some requests inside an abort (`finish_reason.status_code` 400 or 503),
which fail or are retried rather than resumed; 0.5.23 reports which weights made which output tokens
(`meta_info.weight_versions`), kept per token in `GenerateResult.segments`.

Requests go through `http_pool.HttpPool` (which says why it is not httpx's or aiohttp's). What a generation asks
beside tokens (routed experts, top-p kept ids) is `replay`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import time
from collections import OrderedDict
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Iterator, Sequence
from typing import Any, TypeVar

import orjson

from rollout_buffer.engine.http_pool import HttpPool
from rollout_buffer.engine.limits import PROBE_TIMEOUT_S, EngineLimits, KnownLimits, overflow
from rollout_buffer.engine.outage import DEFAULT_OUTAGE_S, OUTAGE_KINDS, Outage, OutageTooLong
from rollout_buffer.engine.replay import NO_REPLAY, ReplayAsk, ReplayError, ReplayParts, top_p_params
from rollout_buffer.engine.results import (
    ChatResult,
    EngineError,
    EngineStats,
    GenerateResult,
    GenerationProgress,
    GenerationStream,
    check_images_read,
)
from rollout_buffer.engine.sglang_wire import (
    DONE,
    AttemptError,
    EnginePrompt,
    GenerateDelta,
    StreamCursor,
    chat_params,
    error_text,
    event_body,
    parse_generate,
    parse_prompt_log_probs,
    request_body,
    to_sglang_sampling_params,
)
from rollout_buffer.observability import metrics

logger = logging.getLogger(__name__)

_AFFINITY_SIZE = 100_000
# A router's queue timeout and rate limit: the request was fine, the engines were busy.
_RETRYABLE_4XX = frozenset({408, 429})
_T = TypeVar("_T")


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
        engine_hosts: Sequence[str] = (),
        engine_outage_s: float = DEFAULT_OUTAGE_S,
    ):
        if not urls:
            raise ValueError("EngineClient needs at least one engine URL")
        if max_retries < 0 or max_abort_resumes < 0:
            raise ValueError("max_retries and max_abort_resumes must be >= 0")
        self._options: dict[str, Any] = {
            "timeout_s": timeout_s, "max_retries": max_retries, "backoff_s": backoff_s, "max_backoff_s": max_backoff_s,
            "max_abort_resumes": max_abort_resumes, "max_connections": max_connections,
            "context_length": context_length, "engine_hosts": engine_hosts, "engine_outage_s": engine_outage_s}
        self.urls = [u.rstrip("/") for u in urls]
        self.engine_hosts = tuple(engine_hosts)  # the hosts a router's worker list may lead to (empty: any)
        self.timeout_s = timeout_s
        self.max_retries = max_retries
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.max_abort_resumes = max_abort_resumes
        self.max_connections = max_connections
        self.stats = EngineStats()
        self.outage = Outage(engine_outage_s)
        self._affinity: OrderedDict[str, str] = OrderedDict()
        self._pool: HttpPool | None = None
        self._limits = KnownLimits(self.urls, min(timeout_s, PROBE_TIMEOUT_S), self.engine_hosts, context_length)

    def sibling(self, urls: list[str]) -> EngineClient:
        """A client of other engines (a role's own) with this client's options: timeouts, retries, outage budget,
        host allow-list, context length."""
        return EngineClient(urls, **self._options)

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
        """What the engine at `url` takes (`KnownLimits.of`)."""
        return await self._limits.of(url)

    # ------------------------------------------------------------ HTTP with retries

    @contextlib.contextmanager
    def _counted(self, url: str, path: str) -> Iterator[None]:
        """One request to `url`: in the stats while it runs, its time observed; transport failures raised as
        `AttemptError`s (timeout, connection)."""
        stats = self.stats
        stats.requests += 1
        stats.requests_by_url[url] += 1
        stats.in_flight[url] += 1
        start = time.monotonic()
        try:
            yield
        except TimeoutError as e:  # before OSError, of which it is one
            raise AttemptError("timeout", f"no answer within {self.timeout_s}s ({type(e).__name__})") from None
        except OSError as e:
            raise AttemptError("connection", f"{type(e).__name__}: {e}") from None
        finally:
            elapsed = time.monotonic() - start
            stats.in_flight[url] -= 1
            stats.latency_sum_s += elapsed
            stats.latency_count += 1
            metrics.ENGINE_REQUEST_SECONDS.labels(path).observe(elapsed)

    async def _attempt(self, url: str, path: str, payload: dict[str, Any]) -> Any:
        with self._counted(url, path):
            status, content = await self._http().post(url, path, request_body(payload))
        if status >= 400:
            kind = "http_5xx" if status >= 500 else "http_4xx"
            raise AttemptError(kind, f"HTTP {status}: {error_text(content)}", status)
        try:
            return orjson.loads(content)
        except orjson.JSONDecodeError as e:
            raise AttemptError("bad_response", f"undecodable JSON ({len(content)} bytes): {e}") from None

    def _backoff(self, attempt: int) -> float:
        delay = min(self.max_backoff_s, self.backoff_s * 2.0 ** attempt)
        return delay * (0.5 + random.random() / 2)  # jitter spreads the retries of many trajectories

    async def _post(self, path: str, payload: dict[str, Any], session_id: str,
                    parse: Callable[[Any], _T]) -> tuple[_T, str, int]:
        """POST with bounded retries; returns (parsed body, engine URL, attempts).

        `parse` reads the decoded body and may raise `AttemptError("bad_response")`, which is retried.
        """
        async def attempt(url: str) -> _T:
            return parse(await self._attempt(url, path, payload))

        return await self._retried(path, session_id, attempt)

    async def _retried(self, path: str, session_id: str, attempt: Callable[[str], Awaitable[_T]]
                       ) -> tuple[_T, str, int]:
        """`attempt(engine URL)` with bounded retries; returns (its result, engine URL, attempts). Past its retries a
        failure of an engine that is down (refused, 5xx, no answer) is an outage (`engine_outage`): the request
        waits for the engines, retrying with backoff, until one answers or the outage outlasts its budget."""
        avoid: set[str] = set()
        n = 0
        while True:
            n += 1
            url = self._pick(session_id, avoid)
            try:
                result = await attempt(url)
            except AttemptError as e:
                self._count_error(e)
                refused = e.kind == "http_4xx" and e.status not in _RETRYABLE_4XX
                down = e.kind in OUTAGE_KINDS and self.outage.budget_s > 0
                if refused or (n > self.max_retries and not down):
                    raise EngineError(e.kind, url, n, e.reason, e.status) from None
                if n > self.max_retries:
                    try:
                        self.outage.failed(url, f"{e.kind}: {e.reason}")
                    except OutageTooLong as too_long:
                        raise EngineError("outage", url, n, str(too_long), e.status) from None
                if e.kind == "connection" and len(self.urls) > 1:
                    # The session's engine may be gone: let the retry go to another one.
                    avoid.add(url)
                    self._affinity.pop(session_id, None)
                self.stats.retries += 1
                metrics.ENGINE_RETRIES.inc()
                delay = self._backoff(n - 1)
                # During an outage every request in flight retries: the outage's own lines say it once.
                logger.log(logging.DEBUG if self.outage.active else logging.INFO,
                           "engine %s%s: %s (%s); retry %d in %.2fs", url, path, e.kind, e.reason, n, delay)
                await asyncio.sleep(delay)
            else:
                self.outage.answered()
                return result, url, n

    def _count_error(self, e: AttemptError) -> None:
        self.stats.errors[e.kind] += 1
        metrics.ENGINE_ERRORS.labels(e.kind).inc()

    # ------------------------------------------------------------ streams

    async def _events(self, url: str, payload: dict[str, Any]) -> AsyncGenerator[Any, None]:
        """The decoded `data:` events of one streamed `/generate` request, up to `data: [DONE]`.

        Raises `AttemptError` for a refused request (status, or SGLang's `{"error"}` event, a 400), a broken
        connection and an undecodable event. Closing the iterator closes the connection: SGLang then aborts
        the request.
        """
        with self._counted(url, "/generate"):
            async with self._http().stream(url, "/generate", request_body(payload)) as response:
                if response.status >= 400:
                    kind = "http_5xx" if response.status >= 500 else "http_4xx"
                    reason = f"HTTP {response.status}: {error_text(await response.read())}"
                    raise AttemptError(kind, reason, response.status)
                pending = b""
                async for data in response:
                    pending += data
                    *events, pending = pending.split(b"\n\n")
                    for event in events:
                        body = event_body(event)
                        if body is DONE:
                            return
                        if body is not None:
                            yield body
                if pending.strip():
                    event_body(pending)  # raises: a stream cut inside an event
                raise AttemptError("bad_response", "the stream ended without data: [DONE]")

    async def _open_stream(self, payload: dict[str, Any], session_id: str
                           ) -> tuple[Any, AsyncGenerator[Any, None], str, int]:
        """A streamed `/generate` request once its first event arrived, retried like any request until then:
        (first event, the rest, engine URL, attempts)."""
        async def attempt(url: str) -> tuple[Any, AsyncGenerator[Any, None]]:
            events = self._events(url, payload)
            try:
                return await anext(events), events
            except StopAsyncIteration:
                raise AttemptError("bad_response", "the stream ended before any event") from None
            except BaseException:
                await events.aclose()
                raise

        (first, events), url, attempts = await self._retried("/generate", session_id, attempt)
        return first, events, url, attempts

    async def _stream_segment(self, payload: dict[str, Any], session_id: str, cursor: StreamCursor,
                              progress: GenerationProgress) -> AsyncIterator[GenerateDelta]:
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
        except AttemptError as e:
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

    async def generate(self, input_ids: list[int] | EnginePrompt, sampling_params: dict[str, Any], *, session_id: str,
                       return_logprob: bool = True, replay: ReplayAsk = NO_REPLAY,
                       image_data: list[str] | None = None) -> GenerateResult:
        """Token-in-token-out generation; an aborted generation is resumed from its partial output.

        A resume resends `input_ids + output so far` with `max_new_tokens` reduced by what was generated,
        at most `max_abort_resumes` times; output ids and log-probs are concatenated. If the engine still
        aborts, the result says `finish_reason="abort"`. `replay` asks for routed experts and top-p ids too
        (`engine.replay`); an answer without what it asked, or with it malformed, fails the generation
        (`EngineError` kind `replay_missing`, `bad_replay`). `image_data`: the images the prompt's placeholders
        stand for, in order (data URLs), sent with every request of the generation.
        """
        progress = GenerationProgress()
        async for _ in self._generation(input_ids, sampling_params, session_id, return_logprob, progress, False,
                                        replay, image_data):
            pass
        return progress.result()

    def generate_stream(self, input_ids: list[int] | EnginePrompt, sampling_params: dict[str, Any], *, session_id: str,
                        return_logprob: bool = True, replay: ReplayAsk = NO_REPLAY,
                        image_data: list[str] | None = None) -> GenerationStream:
        """`generate` streamed: iterate the result for the tokens as the engine produces them (`GenerateDelta`),
        then read `.result`, the same `GenerateResult` as `generate`'s.

        Same guarantees: a request that fails before its first token is retried; an abort (a weight update)
        or a stream broken after some tokens is resumed from the tokens already streamed, which are kept.
        Leaving the iteration early (`aclose`) closes the engine request, which the engine then aborts.
        """
        progress = GenerationProgress()
        deltas = self._generation(input_ids, sampling_params, session_id, return_logprob, progress, True, replay,
                                  image_data)
        return GenerationStream(deltas, progress)

    async def _generation(self, input_ids: list[int] | EnginePrompt, sampling_params: dict[str, Any], session_id: str,
                          return_logprob: bool, progress: GenerationProgress, stream: bool, replay: ReplayAsk,
                          image_data: list[str] | None = None) -> AsyncGenerator[GenerateDelta, None]:
        """The engine requests of one generation, abort resumes included; streamed ones yield their deltas.

        Each request's `max_new_tokens` is cut to what fits the engine's context; a prompt that fills it is not
        sent (finish "length"). A context refusal (400) teaches the engine's limits and is fitted once. A refusal
        abort with a 4xx fails at once (kind "refused"), one with a 5xx is retried like a 5xx (`max_retries`,
        backoff) from the output so far; a plain abort (a weight update) is resumed.
        """
        params = to_sglang_sampling_params(sampling_params)
        if replay.top_p:
            params = top_p_params(params)
        if replay:
            progress.replay = ReplayParts(routed_width=replay.routed_width, top_p=replay.top_p)
        budget = params.get("max_new_tokens")
        stop = params.get("stop") or []
        stops = [stop] if isinstance(stop, str) else list(stop)
        refusals = 0
        fitted = False
        while True:
            prompt_length = len(input_ids) + len(progress.out_ids)
            await self._limits.probe_all()  # before picking: no await between choosing an engine and sending
            progress.url = self._pick(session_id, set())
            room = self._limits.known(progress.url).room(prompt_length)
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
            ids: Any = (input_ids.payload(progress.out_ids) if isinstance(input_ids, EnginePrompt)
                        else [*input_ids, *progress.out_ids])
            payload = {"input_ids": ids, "sampling_params": params, "return_logprob": return_logprob}
            if image_data:
                payload["image_data"] = image_data
            if progress.replay is not None:
                payload.update(progress.replay.request_fields(replay))
            try:
                if stream:
                    payload["stream"] = True
                    async for delta in self._stream_segment(payload, session_id, StreamCursor(return_logprob, stops),
                                                            progress):
                        yield delta
                else:
                    chunk, progress.url, n = await self._post(
                        "/generate", payload, session_id, lambda body: parse_generate(body, return_logprob)
                    )
                    progress.attempts += n
                    progress.add(GenerateDelta(chunk.output_ids, chunk.log_probs, chunk.text, chunk.weight_version))
                    progress.end_segment(len(chunk.output_ids), chunk.text, chunk)
            except EngineError as e:
                progress.attempts += e.attempts
                if fitted or e.status != 400 or not self._limits.fit(e.url, e.reason, prompt_length, want):
                    raise
                fitted = True
                continue
            if progress.refusal is None and progress.replay is not None:
                self._take_replay(replay, progress, prompt_length)
            if image_data and progress.refusal is None:
                check_images_read(progress, prompt_length)
            if progress.refusal is not None:
                fitted, refusals = await self._refused(progress, prompt_length, want, fitted, refusals)
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

    async def _refused(self, progress: GenerationProgress, prompt_length: int, want: int | None, fitted: bool,
                       refusals: int) -> tuple[bool, int]:
        """The refusal abort of the answer just read: a context refusal fitted to once (then `fitted`), a retryable
        one tried again after a backoff (one more of `refusals`); EngineError when it fails for good."""
        assert progress.refusal is not None
        status, message = progress.refusal
        progress.refusal = None
        kind = "http_5xx" if status >= 500 else "http_4xx" if status in _RETRYABLE_4XX else "refused"
        self._count_error(AttemptError(kind, message, status))
        if kind == "refused" and not fitted and self._limits.fit(progress.url, message, prompt_length, want):
            return True, refusals
        if kind == "refused" or refusals >= self.max_retries:
            raise EngineError(kind, progress.url, progress.attempts, message, status)
        self.stats.retries += 1
        metrics.ENGINE_RETRIES.inc()
        delay = self._backoff(refusals)
        logger.info("engine %s/generate refused (%d: %s); retry %d/%d in %.2fs", progress.url, status,
                    message, refusals + 1, self.max_retries, delay)
        await asyncio.sleep(delay)
        return fitted, refusals + 1

    async def prompt_log_probs(self, input_ids: list[int] | EnginePrompt, count: int, temperature: float, *,
                               session_id: str, image_data: list[str] | None = None) -> list[float]:
        """The log-probs of the last `count` of `input_ids` (with the images their pads stand for), each given those
        before it, at `temperature`: one prefill, nothing generated (a teacher's log-probs of a response, as slime's
        on-policy distillation asks them). Retried like any request; EngineError when it fails for good."""
        if count <= 0:
            return []
        if count >= len(input_ids):
            raise ValueError(f"{count} log-probs asked of {len(input_ids)} tokens: the first one has none")
        # SGLang gives the first position of the range it is asked no log-prob: one more is asked, and dropped.
        ids = input_ids.payload([]) if isinstance(input_ids, EnginePrompt) else input_ids
        payload = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0, "temperature": temperature},
                   "return_logprob": True, "logprob_start_len": len(input_ids) - count - 1,
                   **({"image_data": image_data} if image_data else {})}
        values, _, _ = await self._post("/generate", payload, session_id, lambda b: parse_prompt_log_probs(b, count))
        return values

    def _take_replay(self, replay: ReplayAsk, progress: GenerationProgress, prompt_length: int) -> None:
        """The replay data of the answer just read (`engine.replay`); EngineError when it lacks or garbles it."""
        assert progress.replay is not None
        last = progress.last
        try:
            progress.replay.add(replay, None if last is None else (last.replay or {}), prompt_length,
                                progress.last_tokens, "abort" if last is None else last.finish_reason, progress.url)
        except ReplayError as e:
            version = self._limits.known(progress.url).version
            kind = "replay_missing" if e.missing else "bad_replay"
            self._count_error(AttemptError(kind, str(e)))
            raise EngineError(kind, progress.url, progress.attempts,
                              f"{e} (the engine reports SGLang {version or 'of an unknown version'})") from None

    async def chat(self, messages: list[dict[str, Any]], sampling_params: dict[str, Any], *, session_id: str,
                   tools: list[dict[str, Any]] | None = None) -> ChatResult:
        """OpenAI chat completion (messages in, message out); no abort resumption in this mode.

        The engine counts the prompt's tokens here, so the context is fitted only from its refusal: a request
        refused for overflowing the context is sent once more with `max_tokens` what the refusal leaves, or not at
        all when the prompt alone fills it (`context_full`).
        """
        payload: dict[str, Any] = {"model": "default", **chat_params(sampling_params), "messages": messages}
        if tools:
            payload["tools"] = tools
        try:
            result, url, attempts = await self._post("/v1/chat/completions", payload, session_id, ChatResult.of)
        except EngineError as e:
            seen = overflow(e.reason, 0) if e.status == 400 else None
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
            result, url, attempts = await self._post("/v1/chat/completions", payload, session_id, ChatResult.of)
            attempts += e.attempts
        result.engine_url, result.attempts = url, attempts
        metrics.TOKENS_GENERATED.inc(metrics.chat_tokens(result.raw))
        if result.finish_reason == "abort":
            self.stats.aborted_results += 1
        return result

    async def aclose(self) -> None:
        """Close the pooled connections (and stop engine probes still running)."""
        self._limits.cancel_probes()
        if self._pool is not None:
            await self._pool.aclose()
