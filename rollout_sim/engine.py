"""The simulated engine's scheduler and `/generate`: admission as SGLang's tokenizer manager checks it, requests
running, paused, aborted and streamed as its scheduler runs them, and answers as its tokenizer manager builds them.
What is imitated, with SGLang's sources for each rule, is listed in the package's docstring (`rollout_sim`)."""

from __future__ import annotations

import asyncio
import logging
import os
import time
import uuid
from collections import deque
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson
from starlette.responses import Response, StreamingResponse

from rollout_buffer.media.vision import VisionProcessor
from rollout_sim.contract import (
    CONTRACT_KEYS,
    FLUSH_OK,
    FORCE_STREAM_INTERVAL,
    JUNK_TOKEN_ID,
    PAUSE_MODES,
    QUEUE_FULL,
    RESERVED_INPUT_TOKENS,
    SGLANG_SAMPLING_KEYS,
    SGLANG_VERSIONS,
    GenerateRequest,
    Refused,
    Sampling,
    SimConfig,
    input_too_long,
    running_abort,
    sampling_contract_error,
)
from rollout_sim.detokenizer import Detokenizer
from rollout_sim.faults import Faults
from rollout_sim.images import seen, with_images
from rollout_sim.prefix_memo import Hit
from rollout_sim.replay import ReplayConfig, replay_fields, start_refusal
from rollout_sim.replies import (
    error_response,
    finish_response,
    input_logprob_rows,
    internal_server_error,
    json_response,
    logprob_rows,
    openai_error,
    weight_version_spans,
)
from rollout_sim.requests import Event, Output, Request, SimStats
from rollout_sim.turns import Prefix, Turn, TurnPlanner

logger = logging.getLogger(__name__)
_RECENT_REQUESTS = 256


class SimEngine:
    """State of one simulated engine: tokenizer, turn planner, faults, requests and counters."""

    def __init__(self, config: SimConfig, tokenizer: Any, tokenizer_path: str):
        if config.sglang_version not in SGLANG_VERSIONS:
            raise ValueError(f"sglang_version must be one of {', '.join(SGLANG_VERSIONS)}")
        self.config = config
        self.v23 = config.sglang_version == "0.5.23"
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self.vocab_size = len(tokenizer)
        self.weight_version = config.weight_version
        self.weights = ""  # the checkpoint loaded last ("": the one it started with); its log-probs depend on it
        self.vision = VisionProcessor.of(tokenizer_path, tokenizer)  # a Qwen-VL checkpoint's, when it has one
        self.replay = ReplayConfig(config.enable_return_routed_experts, config.moe_layers, config.moe_top_k,
                                   config.moe_experts, config.top_p_replay)
        self.max_req_len = config.context_length - 1
        self.max_req_input_len = self.max_req_len - RESERVED_INPUT_TOKENS
        self.stats = SimStats()
        self.started = time.time()
        self.faults = Faults(config, self.stats.faults)
        self.turns = TurnPlanner(config, tokenizer)
        self._requests: dict[int, Request] = {}  # admitted to the scheduler, not answered yet
        self._running_tokens = 0
        self.paused: str | None = None  # the /pause_generation mode in effect
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self._progress = asyncio.Event()  # set whenever the engine answers anything (SGLang's last_receive_tstamp)
        self.last_progress = time.time()
        self.recent: deque[dict[str, Any]] = deque(maxlen=_RECENT_REQUESTS)

    # ------------------------------------------------------------ request flow

    def generation_s(self, output_tokens: int) -> float:
        """How long generating a turn of `output_tokens` takes: the request latency plus the per-token one."""
        return (self.config.latency_ms + self.config.token_latency_ms * output_tokens) / 1000.0

    def _mark_progress(self) -> None:
        self.last_progress = time.time()
        self._progress.set()

    async def _spend(self, req: Request, until_s: float) -> bool:
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

    def load_weights(self, model_path: str, version: str | None, abort_all: bool, flush: bool) -> dict[str, Any]:
        """SGLang's `/update_weights_from_disk` answer (`weight_updater.py`, `tokenizer_manager.py`): a folder that
        does not exist fails the load; requests still in the scheduler (held in place, or aborted and not yet
        answered) make the cache flush after the load fail, and then the version is not updated either, though
        the weights are swapped. A load changes the log-probs answered from then on (`weights`), version or not."""
        if abort_all:
            self.abort(None, abort_all=True)
        if not os.path.isdir(model_path):
            return {"success": False, "num_paused_requests": 0, "message": f"Failed to get weights iterator: "
                    f"Invalid HF URI 'hf://{model_path}'. Repository id must be 'namespace/name', got "
                    f"'{model_path.strip('/')}'. ."}
        self.weights = model_path
        if flush and self.pending():
            return {"success": False, "num_paused_requests": 0, "message": (
                "Weights were updated, but the cache was not flushed because requests are still running or queued."
                " Retract or finish them, then call /flush_cache.")}
        message = "Succeeded to update model weights."
        if version is not None:
            self.set_weight_version(str(version))
            message += f" Weight version updated to {version}."
        return {"success": True, "message": message, "num_paused_requests": 0}

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

    async def admit(self, ids: list[int], params: dict[str, Any]) -> tuple[Sampling, Hit[Prefix] | None]:
        """Wait while generation is paused, then validate like `TokenizerManager._tokenize_one_request`: the
        sampling parameters, and the remembered prefix of `ids` the checks used (planning the turn goes on from it).

        Raises `Refused(400)` with SGLang's wording, TypeError for an unknown sampling key (0.5.15)."""
        await self._unpaused.wait()
        if not ids:
            raise Refused(400, "the prompt is empty")
        # Real SGLang does not check (undefined behaviour). A conversation's earlier request, remembered, was
        # checked: only what follows it is (a resent context would cost the simulator as much as the context).
        known = self.turns.prefixes.find(ids)
        new = ids[known.length :] if known is not None else ids
        if new and (min(new) < 0 or max(new) >= self.vocab_size):
            raise Refused(400, f"input_ids contain token ids outside [0, {self.vocab_size})")
        context = self.config.context_length
        if len(ids) >= context:
            raise Refused(400, f"The input ({len(ids)} tokens) is longer than the model's context length "
                                f"({context} tokens).")
        max_new = params.get("max_new_tokens")
        if isinstance(max_new, int) and not isinstance(max_new, bool) and max_new + len(ids) > context:
            raise Refused(400, (
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {max_new + len(ids)} tokens: {len(ids)} tokens from the input messages and "
                f"{max_new} tokens for the completion. Please reduce the number of tokens in the input messages or "
                "the completion to fit within the limit."))
        try:
            return Sampling.parse(params, CONTRACT_KEYS if self.v23 else SGLANG_SAMPLING_KEYS), known
        except ValueError as e:
            raise Refused(400, str(e)) from e

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

    async def run(self, rid: str, ids: list[int], sampling: Sampling, known: Hit[Prefix] | None,
                   fault: str | None, stream: bool, refusal: str | None = None, note: str | None = None
                   ) -> AsyncGenerator[tuple[Event, Turn | None, Request | None]]:
        """The scheduler's answers for one admitted request, in order; the last carries the finish. `refusal`: the
        scheduler's reason to refuse it (its request's own fields); `note`: what the model saw in its images."""
        if fault == "refuse_503":
            yield Event(0, {"type": "abort", "status_code": 503, "message": QUEUE_FULL}, queued_abort=True), \
                None, None
            return
        if fault == "refuse_400" or refusal is not None or len(ids) >= self.max_req_input_len:
            finish = {"type": "abort", "message": refusal or input_too_long(len(ids), self.max_req_input_len),
                      "status_code": 400, "err_type": "BadRequestError"}
            yield Event(1, finish, junk=True), None, None
            return
        max_new = self._max_new(len(ids), sampling)
        turn = await asyncio.to_thread(self.turns.plan_turn, ids, sampling, max_new, known, note)
        n = len(turn.output_ids)
        req = Request(rid=rid, stream=stream, n=n, keep=n // 2 if fault == "abort" else n,
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
                        yield Event(k), turn, req
            elif await self._spend(req, req.total_s * req.keep / n if n else req.total_s):
                req.tokens = req.keep
            else:
                req.tokens = req.tokens_now()
        finally:
            self._running_tokens -= tokens
            self._requests.pop(id(req), None)
        self._mark_progress()
        if req.abort is not None:
            yield Event(req.tokens, req.abort, queued_abort=req.abort_queued), turn, req
        elif fault == "abort":
            yield Event(req.keep, running_abort()), turn, req
        else:
            yield Event(n, turn.finish), turn, req

    # ------------------------------------------------------------ answers (the tokenizer manager)

    def answer(self, body: GenerateRequest, rid: str, ids: list[int], sampling: Sampling, event: Event,
                turn: Turn | None, req: Request | None, out: Output, started: float) -> dict[str, Any]:
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
            if self.v23 or body.logprob_start_len >= 0:
                meta["input_token_logprobs"] = [] if event.junk else input_logprob_rows(
                    self.tokenizer, ids, body.logprob_start_len, self.weights, body.return_text_in_logprobs)
            meta["output_token_logprobs"] = lps[before:] if incremental else lps
            if self.v23:
                meta["output_token_logprobs_length"] = len(lps)
        meta.update({"reasoning_tokens": 0, "completion_tokens": event.tokens, "cached_tokens": 0})
        if finished and self.v23:
            meta.update(self._spans(req, event.tokens))
        if finished and not event.junk:
            meta.update(replay_fields(self.replay, body, ids, output[: event.tokens], self.vocab_size, self.weights))
        if self.v23:
            meta.update({"cached_tokens_details": None, "dp_rank": None})  # details only of cached tokens
        if finished:
            meta["e2e_latency"] = time.time() - started
        if out.first:
            out.first = False
            meta["response_sent_to_client_ts"] = time.time()
        if incremental:
            return {"text": delta, "output_ids": output[before : event.tokens], "meta_info": meta}
        return {"text": out.text, "output_ids": output[: event.tokens], "meta_info": meta}

    def _spans(self, req: Request | None, n: int) -> dict[str, Any]:
        # 0.5.23 answers an aborted request from the scheduler at the abort (`/update_weight_version` aborts, then
        # sets the version): its spans end under the version it was aborted under.
        current = req.aborted_under if req is not None and req.aborted_under is not None else self.weight_version
        spans = weight_version_spans(req.version_events if req else [], current, n)
        return {"weight_versions": spans, "weight_version": spans[-1]["version"]}

    def _logprobs(self, body: GenerateRequest, out: list[int], first: int) -> list[list[Any]]:
        return logprob_rows(self.tokenizer, out, first, self.weights, body.return_text_in_logprobs)

    def record(self, endpoint: str, rid: str, ids: list[int], sampling: Sampling | None, answer: dict[str, Any],
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
        fault = self.faults.next()
        replaced = await self.faults.response(fault)
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
            ids, note = await self._looked_at(body, await self._prompt_ids(body))
            sampling, known = await self.admit(ids, body.sampling_params)
        except Refused as e:
            return error_response(e.status, e.message)
        except TypeError:
            logger.exception("unexpected sampling parameter (SGLang 0.5.15 answers 500)")
            return internal_server_error()
        out = Output(Detokenizer(self.tokenizer, ids, sampling.skip_special_tokens, sampling.no_stop_trim))
        answer: dict[str, Any] = {}
        policy = None
        async for event, turn, req in self.run(rid, ids, sampling, known, fault, False, _refusal(body, ids), note):
            answer = self.answer(body, rid, ids, sampling, event, turn, req, out, started)
            policy = turn.policy if turn else None
        self.record("/generate", rid, ids, sampling, answer, policy, fault)
        finish = answer["meta_info"]["finish_reason"]
        status = finish.get("status_code") if finish.get("type") == "abort" else None
        if status == 400:
            return error_response(400, finish["message"])
        if isinstance(status, int) and status >= 400:
            return openai_error(status, finish["message"], str(status))
        return finish_response(answer, fault)

    async def _looked_at(self, body: GenerateRequest, ids: list[int]) -> tuple[list[int], str | None]:
        """The prompt as the model reads it (each image's pad expanded, `images`) and the colour of its last image
        (None without images); Refused (400) as SGLang refuses images that do not load or pads without an image."""
        urls = [body.image_data] if isinstance(body.image_data, str) else body.image_data or []
        if not urls:
            return ids, None
        try:
            looked = await asyncio.to_thread(lambda: [seen(u) for u in urls])
            expanded = with_images(ids, looked, self.vision)
        except ValueError as e:
            raise Refused(400, str(e)) from None
        used = sum(1 for t in ids if self.vision is not None and t == self.vision.pad_id)
        return expanded, looked[used - 1].colour if used else None

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
            ids, note = await self._looked_at(body, await self._prompt_ids(body))
            sampling, known = await self.admit(ids, body.sampling_params)
        except Refused as e:
            error = {"message": e.message, "type": "invalid_request_error", "code": 400, "retryable": False}
            yield b"data: " + orjson.dumps({"error": error}) + b"\n\n"
            yield b"data: [DONE]\n\n"
            return
        except TypeError as e:  # 0.5.15: the exception escapes the stream; the connection breaks
            raise RuntimeError("SGLang 0.5.15 fails an unexpected sampling parameter") from e
        out = Output(Detokenizer(self.tokenizer, ids, sampling.skip_special_tokens, sampling.no_stop_trim))
        steps = self.run(rid, ids, sampling, known, fault, True, _refusal(body, ids), note)
        last: tuple[dict[str, Any], Request | None, Turn | None] | None = None
        answered = False
        try:
            async for event, turn, req in steps:
                answer = self.answer(body, rid, ids, sampling, event, turn, req, out, started)
                if event.finish is not None:
                    answered = True
                    self.record("/generate", rid, ids, sampling, answer, turn.policy if turn else None, fault)
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
                    self.record("/generate", rid, ids, sampling, answer, last[2].policy if last[2] else None,
                                 fault)
        yield b"data: [DONE]\n\n"


def _refusal(body: GenerateRequest, ids: list[int]) -> str | None:
    """Why the scheduler refuses the request for its own fields (a routed-experts start outside the prompt)."""
    return start_refusal(body.routed_experts_start_len, len(ids)) if body.return_routed_experts else None
