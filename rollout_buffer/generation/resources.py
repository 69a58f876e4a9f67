"""What a run's trajectories share, built from its start request: tokenizer, engine client, `RunResources`.

Built the same way in the buffer process and in each Ray actor of the `ray` executor, so a generator sees the
same run wherever it runs.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from rollout_buffer.engine.client import EngineClient
from rollout_buffer.generation.context import RunResources
from rollout_buffer.generation.options import SignalOptions
from rollout_buffer.generation.sessions import SessionHost
from rollout_buffer.generation.trainer_signals import TrainerSignals
from rollout_buffer.media.image_store import ImageStore
from rollout_buffer.media.images import DEFAULT_MAX_IMAGE_BYTES
from rollout_buffer.media.run_images import RunImages
from rollout_buffer.media.vision import VisionProcessor
from rollout_buffer.schemas import StartRolloutRequest
from rollout_buffer.tokens.tokenizer import load_tokenizer

log = logging.getLogger(__name__)

_ENGINE_OPTIONS = ("timeout_s", "max_retries", "backoff_s", "max_abort_resumes", "context_length", "engine_hosts",
                   "engine_outage_s")


async def run_resources(run_id: str, req: StartRolloutRequest, sessions: SessionHost | None = None,
                        images_root: Path | None = None, max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES,
                        image_url_hosts: tuple[str, ...] = ()) -> RunResources:
    """The run's shared resources: its tokenizer (loaded in a worker thread), a new engine client, its settings,
    and its images, kept under `images_root` (None: the run takes none), each at most `max_image_bytes`, fetched
    by URL from `image_url_hosts` only."""
    tokenizer = await load_run_tokenizer(run_id, req)
    extra = req.model_extra or {}
    engine = EngineClient(req.engine_urls(), **engine_options(req))
    return RunResources(
        run_id=run_id,
        task_type=req.task_type,
        config=req.model_dump(mode="json"),
        engine=engine,
        tokenizer=tokenizer,
        sampling_params=sampling_params(req),
        max_tokens=req.max_tokens or req.sampling_params.get("max_tokens"),
        sanity_check=str(extra.get("tokenization_sanity_check_mode", "strict")),
        chat_template_kwargs=extra.get("chat_template_kwargs"),
        mask_offpolicy=req.mask_offpolicy_in_partial_rollout,
        sessions=sessions,
        signals=trainer_signals(req, engine) if tokenizer is not None else None,
        images=await run_images(req, tokenizer, images_root, max_image_bytes, image_url_hosts),
    )


async def run_images(req: StartRolloutRequest, tokenizer: Any | None, root: Path | None, max_bytes: int,
                     url_hosts: tuple[str, ...] = ()) -> RunImages | None:
    """The run's images, kept under `root`, read with its checkpoint's image processor when it has one
    (`media.vision`); None without a store or a tokenizer."""
    if root is None or tokenizer is None or not req.tokenizer_path:
        return None
    vision = await asyncio.to_thread(VisionProcessor.of, req.tokenizer_path, tokenizer)
    return RunImages(ImageStore(root), vision, max_bytes, url_hosts)


def trainer_signals(req: StartRolloutRequest, engine: EngineClient) -> TrainerSignals | None:
    """What the run's trainer replays beside the tokens, when it asks for any (`generation.trainer_signals`)."""
    options = SignalOptions.from_run(req.model_dump())
    if not options.asked(sampling_params(req)):
        return None
    urls = options.teacher_engine_url
    teacher = engine.sibling([urls] if isinstance(urls, str) else urls) if urls else None
    return TrainerSignals(options, sampling_params(req), teacher)


async def load_run_tokenizer(run_id: str, req: StartRolloutRequest) -> Any | None:
    """The run's tokenizer, or None for chat mode (no `tokenizer_path`, `engine_mode: chat`, or one that does not
    load, unless `engine_mode: token` demands it)."""
    path = req.tokenizer_path
    mode = (req.model_extra or {}).get("engine_mode")
    if mode == "chat":
        log.info("run %s: engine_mode chat (messages only)", run_id)
        return None
    if not path:
        log.info("run %s: no tokenizer_path, chat mode (messages only)", run_id)
        return None
    log.info("run %s: loading the tokenizer of %s", run_id, path)
    try:
        return await asyncio.to_thread(load_tokenizer, path)
    except Exception as e:
        if mode == "token":
            raise ValueError(f"engine_mode token needs a tokenizer: {e}") from e
        log.warning("run %s: tokenizer %s did not load (%s); chat mode", run_id, path, e)
        return None


async def close_resources(resources: RunResources) -> None:
    """Close the run's engine client and what generators keep in `RunResources.shared` (their own engine or
    search clients): objects with an `aclose()` coroutine method."""
    for key, value in resources.shared.items():
        aclose = getattr(value, "aclose", None)
        if callable(aclose):
            try:
                await aclose()
            except Exception as e:  # the run is over; a failed close must not mark it failed
                log.warning("closing the run's %s failed: %s", key, e)
    await resources.engine.aclose()
    if resources.signals is not None and resources.signals.teacher is not None:
        await resources.signals.teacher.aclose()


def sampling_params(req: StartRolloutRequest) -> dict[str, Any]:
    """The run's sampling params, `max_tokens` included."""
    params = dict(req.sampling_params)
    if req.max_tokens is not None:
        params.setdefault("max_tokens", req.max_tokens)
    return params


def engine_options(req: StartRolloutRequest) -> dict[str, Any]:
    """The engine client's options given in the run's payload (timeouts, retries, backoff, abort resumes, the
    context length overriding the engines')."""
    return engine_options_of(req.model_extra or {})


def engine_options_of(config: dict[str, Any]) -> dict[str, Any]:
    """The engine client's options among a payload's keys (a run's extra keys, or an eval's config)."""
    return {k: config[k] for k in _ENGINE_OPTIONS if k in config}
