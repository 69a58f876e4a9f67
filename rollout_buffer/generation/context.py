"""What a native generator receives: the engine, the tokenizer and its trajectory's identity."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

from rollout_buffer.delivery.versions import ordered_versions
from rollout_buffer.engine.client import EngineClient
from rollout_buffer.engine.outage import Outage
from rollout_buffer.engine.replay import NO_REPLAY
from rollout_buffer.engine.sglang_wire import GenerateDelta, to_sglang_sampling_params
from rollout_buffer.generation.options import RunOptions
from rollout_buffer.generation.sessions import AgentSession, SessionHost
from rollout_buffer.generation.trainer_signals import TrainerSignals
from rollout_buffer.media.images import has_image_parts
from rollout_buffer.media.run_images import RunImages
from rollout_buffer.observability import metrics
from rollout_buffer.schemas import Trajectory, TrajectoryStatus
from rollout_buffer.tokens.conversation import Conversation

T = TypeVar("T")
OptionsT = TypeVar("OptionsT", bound=RunOptions)

STATUS_BY_FINISH: dict[str, TrajectoryStatus] = {"stop": "completed", "length": "truncated", "abort": "aborted"}


@dataclass
class RunResources:
    """Shared by every trajectory of one run."""

    run_id: str
    task_type: str
    config: dict[str, Any]
    engine: EngineClient
    tokenizer: Any | None
    sampling_params: dict[str, Any]
    max_tokens: int | None
    sanity_check: str = "strict"
    chat_template_kwargs: dict[str, Any] | None = None
    # slime's option: loss 0 on tokens generated with older weights than the trajectory's newest.
    mask_offpolicy: bool = False
    # Per-run objects generators create once (tool clients, caches), keyed by the generator's choice;
    # values with an async `aclose()` are closed when the run ends.
    shared: dict[str, Any] = field(default_factory=dict)
    # The agent proxy's sessions, when the server has the proxy.
    sessions: SessionHost | None = None
    # What the run's trainer replays beside the tokens (routed experts, top-p kept ids, teacher log-probs).
    signals: TrainerSignals | None = None
    # The images its trajectories saw (None: the run takes none).
    images: RunImages | None = None
    _building: dict[str, asyncio.Lock] = field(default_factory=dict, repr=False)
    _options: dict[type[RunOptions], RunOptions] = field(default_factory=dict, repr=False)

    def options(self, kind: type[OptionsT]) -> OptionsT:
        """The run's options of type `kind`, parsed from its payload once for every trajectory of the run
        (ValueError naming the bad ones)."""
        parsed = self._options.get(kind)
        if parsed is None:
            parsed = self._options[kind] = kind.from_run(self.config)
        assert isinstance(parsed, kind)
        return parsed

    def outages(self) -> list[Outage]:
        """The outages of the run's engines: the policy engine's, and the teacher's when the run has one."""
        teacher = self.signals.teacher if self.signals is not None else None
        return [self.engine.outage, *([teacher.outage] if teacher is not None else [])]

    async def once(self, key: str, build: Callable[[], Awaitable[T]]) -> T:
        """`shared[key]`, made by `build()` the first time it is asked for: trajectories that arrive together
        wait for the one build instead of making their own."""
        if key not in self.shared:
            async with self._building.setdefault(key, asyncio.Lock()):
                if key not in self.shared:
                    self.shared[key] = await build()
        value: T = self.shared[key]
        return value


@dataclass
class RolloutContext:
    """One trajectory's view of the run: `run_rollout(item, ctx)` gets this."""

    run: RunResources
    instance_id: str
    epoch: int
    repeat: int
    uid: str
    # Filled by generate(): what the engine did for this trajectory, reported in extra_info.
    engine_stats: dict[str, Any] = field(default_factory=lambda: {"turns": 0, "abort_resumes": 0, "engines": []})

    @property
    def config(self) -> dict[str, Any]:
        """The run's `/start_rollout` payload, extra keys included (generator options live here)."""
        return self.run.config

    def options(self, kind: type[OptionsT]) -> OptionsT:
        """The run's options of type `kind` (a generator's `RunOptions`), parsed once for the whole run."""
        return self.run.options(kind)

    @property
    def engine(self) -> EngineClient:
        return self.run.engine

    @property
    def tokenizer(self) -> Any | None:
        return self.run.tokenizer

    async def conversation(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None,
                           tokenizer: Any | None = None) -> Conversation:
        """A conversation in token mode when the run has a tokenizer, chat mode otherwise.

        The prompt is rendered and tokenized in a worker thread. An image part (`{"type": "image", "image": ...}`:
        bytes, a data URL or base64) is stored and named by its hash; the checkpoint's processor gives it its tokens.
        """
        if self.run.images is not None:
            messages = await self.run.images.canonical(messages)
        elif has_image_parts(messages):
            raise ValueError("the messages hold images, but this run keeps none here: images are taken by the "
                             "buffer and its session workers, not on a Ray actor, and only with a tokenizer_path")
        return await Conversation.acreate(
            messages,
            tokenizer if tokenizer is not None else self.run.tokenizer,
            tools=tools,
            sanity_check=self.run.sanity_check,  # type: ignore[arg-type]
            chat_template_kwargs=self.run.chat_template_kwargs,
            images=self.run.images,
        )

    async def generate(self, conv: Conversation, engine: EngineClient | None = None, session: str | None = None,
                       return_logprob: bool = True, on_delta: Callable[[GenerateDelta], None] | None = None,
                       **sampling_overrides: Any) -> str:
        """One assistant turn: ask the engine, append its output to `conv`, return the finish reason.

        Token mode sends the exact token sequence and appends the engine's own output ids; chat mode
        sends the messages. The response budget (`max_tokens` over the whole trajectory) is enforced here; the
        engine client cuts each turn to what fits the engine's context, and a prompt that fills it ends the
        conversation with "length" without a turn, as a spent budget does.
        With `on_delta` (token mode), the engine streams and `on_delta` sees the tokens as they come; `conv`
        gets the turn only once it is whole, exactly as without streaming.
        """
        engine = engine or self.run.engine
        session = session or self.uid
        params = {**self.run.sampling_params, **sampling_overrides}
        per_turn = params.get("max_tokens") or params.get("max_new_tokens") or self.run.max_tokens
        if conv.token_mode:
            budget = per_turn
            if self.run.max_tokens is not None:
                budget = min(budget or self.run.max_tokens, self.run.max_tokens - conv.response_tokens_used())
            if budget is not None and budget <= 0:
                return "length"
            ids, engine_params = conv.engine_prompt(), to_sglang_sampling_params(params, budget)
            replay = self.run.signals.ask(conv) if self.run.signals is not None else NO_REPLAY
            images = await self._image_data(conv)
            if on_delta is None:
                result = await engine.generate(ids, engine_params, session_id=session, return_logprob=return_logprob,
                                               replay=replay, image_data=images)
            else:
                stream = engine.generate_stream(ids, engine_params, session_id=session, return_logprob=return_logprob,
                                                replay=replay, image_data=images)
                try:
                    async for delta in stream:
                        on_delta(delta)
                finally:
                    await stream.aclose()  # a turn cancelled mid-stream closes (aborts) the engine request
                result = stream.result
            if result.context_full:
                return "length"
            self._count_turn(result.engine_url, result.resumed)
            await conv.aadd_assistant(
                result.output_ids, result.log_probs if return_logprob else None, result.text,
                weight_version=result.weight_version, finish_reason=result.finish_reason,
                version_segments=result.segments, mid_request=result.mid_request, replay=result.replay,
                resumed=result.resumed,
            )
            return result.finish_reason
        chat_params = {k: v for k, v in params.items() if k != "max_new_tokens"}
        if per_turn is not None:
            chat_params["max_tokens"] = per_turn
        chat = await engine.chat(conv.messages, chat_params, session_id=session, tools=conv.tools)
        if chat.context_full:
            return "length"
        self._count_turn(chat.engine_url, 0)
        conv.add_assistant_text(chat.text, finish_reason=chat.finish_reason, tool_calls=chat.tool_calls,
                                reasoning_content=chat.reasoning_content, weight_version=chat.weight_version)
        return chat.finish_reason

    async def _image_data(self, conv: Conversation) -> list[str] | None:
        """The images of `conv`'s tokens as the engine's `image_data`; None without any."""
        return await self.run.images.data_urls(conv.image_shas) if conv.images and self.run.images else None

    async def open_session(self, metadata: dict[str, Any] | None = None) -> AgentSession:
        """An agent session recording this trajectory: point an OpenAI or Anthropic client at its base URL."""
        if self.run.sessions is None:
            raise RuntimeError("agent sessions need the server's agent proxy, which this run does not have")
        return await self.run.sessions.open(self, metadata)

    def _count_turn(self, engine_url: str, resumed: int) -> None:
        stats = self.engine_stats
        stats["turns"] += 1
        stats["abort_resumes"] += resumed
        if engine_url not in stats["engines"]:
            stats["engines"].append(engine_url)

    async def trajectory(self, conv: Conversation, reward: float, finish_reason: str = "stop",
                         **extra_info: Any) -> Trajectory:
        """The trajectory of a finished conversation (what `run_rollout` returns): exact tokens in token mode; in
        chat mode the tool schemas the engine saw (`tools`), which the trainer's loss-mask generator needs to render
        the prompt.

        `extra_info` gets the oldest and newest weight version the conversation was generated with
        (`weight_version_min` / `weight_version_max`) and, in token mode, `weight_version_spans`:
        `[start, end, version]` over positions of `tokens`, and `mid_request_update_spans`, those of them generated
        after the weights changed within their engine request (over a KV cache of older weights), when any.
        """
        # Its own conversation's turns and resumes (a session's branch: its own, not the session's).
        info: dict[str, Any] = {"finish_reason": finish_reason, **self.engine_stats, "turns": conv.assistant_turns,
                                "abort_resumes": conv.abort_resumes, **extra_info}
        known = ordered_versions(conv.weight_versions)
        if known:
            info["weight_version_min"], info["weight_version_max"] = known[0][1], known[-1][1]
        elif conv.weight_versions:  # versions that cannot be ordered: first and last as generated
            info["weight_version_min"], info["weight_version_max"] = conv.weight_versions[0], conv.weight_versions[-1]
        fields: dict[str, Any] = {}
        if conv.token_mode:
            mismatch = await conv.acheck()
            if mismatch is not None:
                info["tokenization_mismatch"] = mismatch
                metrics.TOKENIZATION_MISMATCHES.inc()
            signals = {} if self.run.signals is None else await self.run.signals.complete(
                conv, self.engine, self.uid, await self._image_data(conv))
            fields = {**conv.record_fields(mask_offpolicy=self.run.mask_offpolicy), **signals}
            info["weight_version_spans"] = [span[:3] for span in conv.version_spans]
            if mid_request := conv.mid_request_spans():
                info["mid_request_update_spans"] = mid_request
        elif conv.tools:
            fields = {"tools": conv.tools}
        # The token fields are the conversation's (`TokenSequence.record_fields`, typed where tokens live: below
        # the schemas): they are Trajectory's own keys.
        return cast(Trajectory, {
            "messages": conv.messages,
            "reward": float(reward),
            "status": STATUS_BY_FINISH.get(finish_reason, "completed"),
            "extra_info": info,
            **fields,
        })


def stamp(record: Trajectory | dict[str, Any], ctx: RolloutContext, index: int | None = None) -> dict[str, Any]:
    """A generator's trajectory with the fields the runner owns filled: uid, instance_id, epoch, repeat, task and
    timing (a generator's own values kept)."""
    info = dict(record.get("extra_info") or {})
    info.setdefault("epoch", ctx.epoch)
    info.setdefault("repeat", ctx.repeat)
    info.setdefault("task_type", ctx.run.task_type)
    info.setdefault("run_id", ctx.run.run_id)
    info.setdefault("timestamp", time.time())
    if index is not None:  # one of several records of a multi-agent episode
        info.setdefault("episode_id", ctx.uid)
    uid = ctx.uid if index is None else f"{ctx.uid}-{index}"
    # Every record of one trajectory (a session's branches, an episode's agents) names it: a trainer counts it once.
    return {**record, "uid": record.get("uid") or uid, "instance_id": ctx.instance_id, "extra_info": info,
            "rollout_id": record.get("rollout_id") or ctx.uid}
