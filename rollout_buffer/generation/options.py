"""The base of run options read from a run's `/start_rollout` payload (generators' options, agent sessions'):
typed fields, bad values reported as one ValueError naming them; the service's own (the engines', the trainer
signals' asked of them); and the checks of these against what the engines report, made before the run starts."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, ClassVar, Self

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    PositiveFloat,
    PositiveInt,
    ValidationError,
    field_validator,
)

from rollout_buffer.engine.limits import probe_engine, router_workers
from rollout_buffer.engine.outage import DEFAULT_OUTAGE_S
from rollout_buffer.engine.sglang_wire import (
    ROUTER_DROPPED_CHAT_KEYS,
    ROUTER_DROPPED_SAMPLING_KEYS,
    ROUTER_MAX_CHAT_STOPS,
)
from rollout_buffer.policy import Governed
from rollout_buffer.schemas import check_http_urls

# /start_rollout waits this long for the engines' answers; one that is slower is not judged there.
_START_PROBE_TIMEOUT_S = 3.0
# Where a run asks for a number of output tokens (the trajectory's budget, or one turn's).
_BUDGETS = ("max_tokens", "sampling_params.max_tokens", "sampling_params.max_new_tokens",
            "sampling_params.max_completion_tokens")


class RunOptions(BaseModel):
    """A generator's run options (the extra keys of `/start_rollout`); keys it does not know are ignored."""

    model_config = ConfigDict(extra="ignore")

    # Starts the ValueError message of bad options, so the run's error says whose options they were.
    error_prefix: ClassVar[str] = "run options"

    @classmethod
    def from_run(cls, config: dict[str, Any]) -> Self:
        """The options of a run's payload; ValueError names the bad ones."""
        try:
            return cls.model_validate(config)
        except ValidationError as e:
            # Not pydantic's error: the runner would read that as a bad trajectory record. Without the values given
            # (a child's environment may hold secrets): the field and what is wrong with it.
            problems = "; ".join(_problem(err["loc"], err["msg"]) for err in e.errors())
            raise ValueError(f"{cls.error_prefix}: {problems}") from None


def _problem(loc: tuple[int | str, ...], message: str) -> str:
    message = message.removeprefix("Value error, ")  # a validator's own message names its field already
    return f"{'.'.join(str(p) for p in loc)}: {message}" if loc else message


def run_option_classes() -> list[type[RunOptions]]:
    """Every `RunOptions` class loaded in this process: the service's and its generators'."""
    found: list[type[RunOptions]] = []
    classes: list[type[RunOptions]] = RunOptions.__subclasses__()
    while classes:
        cls = classes.pop()
        classes += cls.__subclasses__()
        found.append(cls)
    return found


def run_option_defaults() -> dict[str, Any]:
    """Every run option read from `/start_rollout` payloads by the service and by the generators loaded in this
    process (the fields of each `RunOptions` subclass), with its default (None for a required one)."""
    found: dict[str, Any] = {}
    for cls in run_option_classes():
        for name, field in cls.model_fields.items():
            found.setdefault(name, None if field.is_required() else field.get_default(call_default_factory=True))
    return found


class EngineOptions(RunOptions):
    """The run's engine options checked here: `context_length` overrides what the engines report; how long a run
    waits for engines that stopped answering; how it watches for weight swaps they do not report."""

    error_prefix: ClassVar[str] = "engine options"

    context_length: PositiveInt | None = None
    # How long a run waits for engines that stopped answering before it fails (0: trajectories fail instead).
    engine_outage_s: NonNegativeFloat = DEFAULT_OUTAGE_S
    # Every this many seconds the engines are probed for weights swapped under an unchanged version, the first
    # probe one interval after the start (0: not watched; `engine.weight_watch`).
    weight_probe_s: NonNegativeFloat = 60.0
    # How far the probe's log-probs may move under one version before that counts as a swap.
    weight_probe_tolerance: PositiveFloat = 0.05


class SignalOptions(RunOptions):
    """The run options asking for trainer signals."""

    error_prefix: ClassVar[str] = "trainer signal options"

    return_routed_experts: bool = Field(default=False, description="MoE routing replay: each token's experts")
    top_p_replay: bool | None = Field(
        default=None, description="the ids top-p kept (default: when top_p < 1 and the run has exact tokens)")
    teacher_engine_url: Annotated[str | list[str] | None, Governed("urls")] = Field(
        default=None, description="an SGLang engine (or several) serving the teacher, for its log-probs")

    @field_validator("teacher_engine_url")
    @classmethod
    def _urls(cls, value: str | list[str] | None) -> str | list[str] | None:
        check_http_urls(value, "teacher engine URL")
        return value

    def top_p(self, sampling_params: dict[str, Any], exact_tokens: bool = True) -> bool:
        """Whether a run with these sampling params asks for top-p kept ids: by default only one with exact tokens
        (a chat-mode run has none to replay them on, and is not refused for a default)."""
        if self.top_p_replay is not None:
            return self.top_p_replay
        top_p = sampling_params.get("top_p")
        return exact_tokens and isinstance(top_p, int | float) and not isinstance(top_p, bool) and top_p < 1.0

    def asked(self, sampling_params: dict[str, Any], exact_tokens: bool = True) -> list[str]:
        """The options of these that ask for something."""
        return [name for name, on in (("return_routed_experts", self.return_routed_experts),
                                      ("top_p_replay", self.top_p(sampling_params, exact_tokens)),
                                      ("teacher_engine_url", self.teacher_engine_url is not None)) if on]


async def check_engine_options(payload: dict[str, Any]) -> list[str]:
    """ValueError naming what a run asks that its engines cannot serve, before the run starts; the warnings to
    give with the start (engines that do not answer: slime starts them first, so the run starts all the same).

    A token budget over the context length (the run's `context_length`, else the smallest its engines report) can
    never be generated; sampling params sglang-router would drop without a word are refused when
    `remote_engine_url` answers as a router (the buffer cannot tell otherwise: an unreachable URL is not judged).
    """
    options = EngineOptions.from_run(payload)
    url = payload.get("remote_engine_url")
    urls = [] if url is None else [url] if isinstance(url, str) else list(url)
    hosts = payload.get("engine_hosts") or ()
    probed = await asyncio.gather(*(probe_engine(u, _START_PROBE_TIMEOUT_S, hosts) for u in urls))
    found = [f for f in probed if f is not None]
    silent = [u for u, f in zip(urls, probed, strict=True) if f is None]
    warnings = [f"remote_engine_url: {', '.join(silent[:3])}{' and more' if len(silent) > 3 else ''} did not answer "
                f"/get_server_info within {_START_PROBE_TIMEOUT_S:g} s; the run starts and its trajectories wait for "
                "the engine"] if silent else []
    context = options.context_length or min((f.context_length for f in found if f.context_length), default=None)
    params = payload.get("sampling_params") or {}
    if context is not None:
        for name in _BUDGETS:
            value = params.get(name.removeprefix("sampling_params.")) if "." in name else payload.get(name)
            if isinstance(value, int) and value > context:
                whose = "the run's context_length" if options.context_length else "the engine's context length"
                raise ValueError(f"{name}: {value} tokens cannot fit {whose} ({context} tokens, prompt included)")
    chat = not exact_tokens(payload)
    check_signals(payload, params, chat, any(f.router for f in found))
    if not any(f.router for f in found):
        return warnings
    dropped = sorted((ROUTER_DROPPED_CHAT_KEYS if chat else ROUTER_DROPPED_SAMPLING_KEYS) & params.keys())
    if dropped:
        endpoint = "/v1/chat/completions" if chat else "/generate"
        raise ValueError(f"sampling_params.{dropped[0]}: remote_engine_url is an sglang-router, whose {endpoint} "
                         f"drops {', '.join(dropped)} without a word; leave it out or give the engines' URLs")
    stop = params.get("stop")
    if chat and isinstance(stop, list) and len(stop) > ROUTER_MAX_CHAT_STOPS:
        raise ValueError(f"sampling_params.stop: remote_engine_url is an sglang-router, whose chat requests take "
                         f"at most {ROUTER_MAX_CHAT_STOPS} stop strings ({len(stop)} given)")
    return warnings


async def engines_for_signals(payload: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """`payload` with an sglang-router's URL replaced by its workers' when the run asks for routed experts or
    top-p kept ids (the router's `/generate` drops what asks for them), and the warning saying so."""
    url = payload.get("remote_engine_url")
    asked = [n for n in SignalOptions.from_run(payload).asked(payload.get("sampling_params") or {},
                                                                exact_tokens(payload)) if n != "teacher_engine_url"]
    if not asked or not isinstance(url, str):
        return payload, []
    workers = await router_workers(url, _START_PROBE_TIMEOUT_S, payload.get("engine_hosts") or ())
    if not workers:
        return payload, []
    return {**payload, "remote_engine_url": workers}, [
        f"{asked[0]}: remote_engine_url is an sglang-router, whose /generate drops what asks for it; the run "
        f"generates on its workers directly ({', '.join(workers)})"]


def exact_tokens(payload: dict[str, Any]) -> bool:
    """Whether a run's start payload gives it exact tokens (a tokenizer, not `engine_mode: chat`)."""
    return bool(payload.get("tokenizer_path")) and payload.get("engine_mode") != "chat"


def check_signals(payload: dict[str, Any], params: dict[str, Any], chat: bool, router: bool) -> None:
    """ValueError naming the trainer signal a run asks (`generation.trainer_signals`) that it cannot get: each needs
    exact tokens, and sglang-router drops what asks for routed experts and top-p kept ids."""
    asked = SignalOptions.from_run(payload).asked(params, not chat)
    if asked and chat:
        raise ValueError(f"{asked[0]}: needs the run's exact tokens: give tokenizer_path (not engine_mode chat)")
    dropped = [name for name in asked if name != "teacher_engine_url"]
    if dropped and router:
        field = {"return_routed_experts": "return_routed_experts and routed_experts_start_len",
                 "top_p_replay": "sampling_params.custom_params"}[dropped[0]]
        raise ValueError(f"{dropped[0]}: remote_engine_url is an sglang-router, whose /generate drops {field} "
                         "without a word; give the engines' own URLs")
