"""One trajectory's generation: a native generator's records, or the failure that replaced them.

`attempt` is what every executor runs (the buffer's own asyncio tasks, a Ray actor); the failure comes back as
data (`Failure`) so the process that owns the run counts it and writes its record, wherever it happened.
"""

from __future__ import annotations

import asyncio
import logging
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from rollout_buffer.engine.results import EngineError
from rollout_buffer.generation.context import RolloutContext, stamp
from rollout_buffer.generation.plugins import Generator
from rollout_buffer.observability import metrics
from rollout_buffer.schemas import TrajectoryRecord

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failure:
    """Why a trajectory produced no records: `kind` becomes `extra_info.error_kind`, `text` the error, `info` more
    of `extra_info` (an agent's exit code and the tail of its stderr)."""

    kind: str
    text: str
    info: dict[str, Any] = field(default_factory=dict)


async def attempt(generator: Generator, item: dict[str, Any], ctx: RolloutContext) -> list[TrajectoryRecord] | Failure:
    """Run a native generator on one item: its records, stamped and validated, or the Failure of the engine, the
    generator or its output."""
    try:
        out = await generator.module.run_rollout(item, ctx)
        outs = out if isinstance(out, list) else [out]
        single = len(outs) == 1
        return [TrajectoryRecord.model_validate(stamp(o, ctx, None if single else k)) for k, o in enumerate(outs)]
    except asyncio.CancelledError:
        raise
    except EngineError as e:
        return Failure(f"engine_{e.kind}", str(e))
    except ValidationError as e:
        return Failure("bad_record", f"generator returned an invalid record: {e}")
    except Exception as e:
        log.debug("generator %s raised on %s: %s", generator.task_type, ctx.uid, traceback.format_exc())
        # An exception may name its own kind (`error_kind`), e.g. an agent's time limit, and carry what the record
        # keeps of it (`error_info`).
        kind, info = getattr(e, "error_kind", None), getattr(e, "error_info", None)
        if isinstance(kind, str) and kind:
            return Failure(kind, str(e), info if isinstance(info, dict) else {})
        return Failure("generator_error", f"{type(e).__name__}: {e}")


async def produce(generator: Generator, item: dict[str, Any], ctx: RolloutContext,
                  failed: Callable[[Failure], TrajectoryRecord]) -> list[TrajectoryRecord]:
    """`attempt`, with a failure turned into its record by `failed` (training runs and evals alike)."""
    out = await attempt(generator, item, ctx)
    return [failed(out)] if isinstance(out, Failure) else out


def failed_record(item: dict[str, Any], ctx: RolloutContext, kind: str, text: str,
                  info: dict[str, Any] | None = None) -> TrajectoryRecord:
    """The record of a failed trajectory (`status: failed`, `extra_info.error` and `error_kind`, and `info`),
    counted in the metrics and logged."""
    metrics.TRAJECTORIES_FAILED.labels(kind).inc()
    log.warning("trajectory %s failed (%s): %s", ctx.uid, kind, text)
    prompt = item.get("prompt")
    messages = prompt if isinstance(prompt, list) else ([{"role": "user", "content": prompt}] if prompt else [])
    rec = stamp({"messages": messages, "reward": 0.0, "status": "failed",
                 "extra_info": {**(info or {}), "error": text, "error_kind": kind}}, ctx)
    return TrajectoryRecord.model_validate(rec)
