"""Starting the buffer's rollout run from slime's args, once: the buffer's run state decides, not the trainer.

slime's original adapter started the rollout on its first call in each process, so a restarted trainer
restarted generation. Here the adapter asks `GET /status` first and leaves a run alone when it is already
producing this task's data; a resumed trainer therefore picks up where the buffer is.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from slime_adapter.client import BufferClient, RolloutBufferError
from slime_adapter.flags import AdapterSettings

log = logging.getLogger(__name__)

# slime's original adapter asked for 3 epochs when --num-epoch was unset.
DEFAULT_NUM_EPOCH = 3
# States in which a run still has (or will have) data for this task.
_LIVE_STATES = frozenset({"running", "finished"})


def consumed_instance_ids(metadata: dict[str, Any]) -> list[str]:
    """Instance ids recorded in the data buffer's metadata (rollout id → ids), for `skip_instance_ids`.

    One id per consumed group, repeats kept, exactly as slime's own client flattens the metadata: the
    buffer (like slime's generator) skips one group of an instance per occurrence, so an instance whose
    groups of two epochs were trained on appears twice and both epochs are skipped.
    """
    return [str(i) for value in metadata.values() if isinstance(value, list | tuple) for i in value]


def start_payload(args: Any, settings: AdapterSettings, skip_instance_ids: list[str]) -> dict[str, Any]:
    """slime's `/start_rollout` payload, from slime's flag names."""
    max_tokens = getattr(args, "rollout_max_response_len", None)
    sampling = {
        "max_tokens": max_tokens,
        "temperature": getattr(args, "rollout_temperature", None),
        "top_p": getattr(args, "rollout_top_p", None),
    }
    payload: dict[str, Any] = {
        "task_type": settings.task_type,
        "input_file": args.prompt_data,
        "num_repeat_per_sample": int(args.n_samples_per_prompt),
        "num_epoch": int(getattr(args, "num_epoch", None) or DEFAULT_NUM_EPOCH),
        "num_process": settings.num_process,
        "remote_engine_url": f"http://{args.sglang_router_ip}:{args.sglang_router_port}",
        "remote_buffer_url": settings.buffer_url,
        "max_tokens": max_tokens,
        "sampling_params": {k: v for k, v in sampling.items() if v is not None},
        "tokenizer_path": getattr(args, "hf_checkpoint", None),
        "skip_instance_ids": skip_instance_ids,
    }
    return {k: v for k, v in payload.items() if v is not None}


def _same_file(a: Any, b: Any) -> bool:
    if a == b:
        return True
    return isinstance(a, str) and isinstance(b, str) and os.path.realpath(a) == os.path.realpath(b)


def reason_to_start(run: dict[str, Any] | None, payload: dict[str, Any]) -> str | None:
    """Why a new run must be started, or None when the buffer's current run already serves this task."""
    if run is None:
        return "the buffer has no run"
    if run.get("state") not in _LIVE_STATES:
        return f"the buffer's run {run.get('run_id')} is {run.get('state')}"
    if run.get("task_type") is None:
        return None  # records arrive through /buffer/write from generators slime does not drive
    task_type, input_file = run.get("task_type"), run.get("input_file")
    if task_type != payload["task_type"] or not _same_file(input_file, payload["input_file"]):
        return f"the buffer's run {run.get('run_id')} serves {task_type} on {input_file}"
    return None


def ensure_rollout_started(
    client: BufferClient, args: Any, settings: AdapterSettings, metadata: dict[str, Any]
) -> str | None:
    """Start the rollout unless the buffer's run already produces it; returns the serving run's id."""
    run = client.status().get("run")
    payload = start_payload(args, settings, consumed_instance_ids(metadata))
    why = reason_to_start(run, payload)
    if why is None:
        assert run is not None
        log.info("rollout buffer run %s is %s; not restarting it", run.get("run_id"), run.get("state"))
        return run.get("run_id")
    log.info("starting a rollout run (%s), skipping %d instance ids", why, len(payload["skip_instance_ids"]))
    answer = client.start_rollout(payload)
    if not answer.get("success", True):
        raise RolloutBufferError(f"/start_rollout refused: {answer.get('message')}")
    log.info("rollout buffer started run %s: %s", answer.get("run_id"), answer.get("message"))
    return answer.get("run_id")
