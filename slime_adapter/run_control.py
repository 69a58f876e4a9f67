"""Starting the buffer's rollout run from slime's args, once: the buffer's run state decides, not the trainer.

slime's original adapter started the rollout on its first call in each process, so a restarted trainer
restarted generation. Here the adapter asks `GET /status` first and leaves a run alone when it is already
producing this task's data; a resumed trainer therefore picks up where the buffer is. With role streams (one
trainer per role, `--rollout-buffer-role`) only the lead role's trainer starts the run; the others wait for it
the same way, and each reports its version for its own role.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from slime_adapter.client import BufferClient, RolloutBufferError
from slime_adapter.flags import AdapterSettings

log = logging.getLogger(__name__)

# slime's original adapter asked for 3 epochs when --num-epoch was unset.
DEFAULT_NUM_EPOCH = 3
# States in which a run still has (or will have) data for this task.
_LIVE_STATES = frozenset({"running", "finished"})
# How often a role trainer that does not start the run asks whether the lead role's trainer has started it.
LEAD_POLL_S = 1.0


def consumed_instance_ids(metadata: dict[str, Any]) -> list[str]:
    """Instance ids recorded in the data buffer's metadata (rollout id → ids), for `skip_instance_ids`.

    One id per consumed group, repeats kept, exactly as slime's own client flattens the metadata: the
    buffer (like slime's generator) skips one group of an instance per occurrence, so an instance whose
    groups of two epochs were trained on appears twice and both epochs are skipped.
    """
    return [str(i) for value in metadata.values() if isinstance(value, list | tuple) for i in value]


def trainer_version(args: Any, rollout_id: int) -> int:
    """The weight version slime has pushed to the engines when it asks for rollout `rollout_id`.

    slime numbers weight updates from 1 (the first push of the initial weights) and stamps the engines with
    that count as `weight_version`; train_async.py asks for rollout R while version 1 + (R-1) // k is
    on the engines (k = --update-weights-interval), which is R itself with the default interval of 1.
    """
    interval = max(1, int(getattr(args, "update_weights_interval", None) or 1))
    return 0 if rollout_id <= 0 else 1 + (rollout_id - 1) // interval


def groups_per_version(args: Any) -> int:
    """Groups slime trains on per weight version: its batch times the steps between weight updates (the
    `rollout_batch_size` of the buffer's staleness bound, which counts versions)."""
    return int(args.rollout_batch_size) * max(1, int(getattr(args, "update_weights_interval", None) or 1))


def start_payload(args: Any, settings: AdapterSettings, skip_instance_ids: list[str],
                  current_version: int | None = None) -> dict[str, Any]:
    """slime's `/start_rollout` payload, from slime's flag names (and the trainer's version, when given)."""
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
        # Fully asynchronous control: omitted unless asked for, so the run behaves as slime's original.
        "max_staleness": settings.max_staleness,
        "rollout_batch_size": groups_per_version(args) if settings.max_staleness is not None else None,
        "max_ready_groups": settings.max_ready_groups,
        "regenerate_stale": settings.regenerate_stale or None,
        "mask_offpolicy_in_partial_rollout": settings.mask_offpolicy or None,
        "current_version": current_version,
        # What slime's trainer replays (top-p kept ids follow --rollout-top-p < 1, as slime asks them).
        "return_routed_experts": bool(getattr(args, "use_rollout_routing_replay", False)) or None,
        "teacher_engine_url": teacher_engine_url(args),
    }
    if settings.role is not None:
        # Two models: each role's turns go to its own engines (this trainer's router for its own role).
        payload[f"{settings.role}_engine_url"] = payload["remote_engine_url"]
        payload.update({f"{role}_engine_url": url for role, url in settings.role_engine_urls})
    return {k: v for k, v in payload.items() if v is not None}


def teacher_engine_url(args: Any) -> str | None:
    """The teacher engine of slime's on-policy distillation on SGLang (`--use-opd --opd-type sglang`): its
    `--rm-url` (slime posts the teacher's prefill to it), without the `/generate` slime's URL names."""
    if not getattr(args, "use_opd", False) or getattr(args, "opd_type", None) != "sglang":
        return None
    url = getattr(args, "rm_url", None)
    return str(url).rstrip("/").removesuffix("/generate") if url else None


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


# (buffer, role) this process already told its version: a trainer process that finds a run serving on its first
# call may be a restart from an older checkpoint, so it rewinds the run's trainer version (its role's) once.
_versioned_buffers: set[tuple[str, str | None]] = set()


def wait_for_lead(client: BufferClient, settings: AdapterSettings, payload: dict[str, Any]) -> dict[str, Any]:
    """The run the lead role's trainer started for this task: a role trainer that does not start runs waits
    for it (as a restarted trainer finds its run), logging what it waits for now and then."""
    last_log = 0.0
    while True:
        run = client.status().get("run")
        why = reason_to_start(run, payload)
        if why is None:
            assert run is not None
            return run
        if time.monotonic() - last_log > 30:
            log.info("%s trainer: waiting for the %s trainer to start the run (%s)", settings.role,
                     settings.lead_role, why)
            last_log = time.monotonic()
        time.sleep(LEAD_POLL_S)


def ensure_rollout_started(
    client: BufferClient, args: Any, settings: AdapterSettings, metadata: dict[str, Any],
    current_version: int | None = None,
) -> str | None:
    """Start the rollout unless the buffer's run already produces it; returns the serving run's id."""
    payload = start_payload(args, settings, consumed_instance_ids(metadata), current_version)
    run = client.status().get("run") if settings.starts_run else wait_for_lead(client, settings, payload)
    why = reason_to_start(run, payload)
    first_call = (settings.buffer_url, settings.role) not in _versioned_buffers
    _versioned_buffers.add((settings.buffer_url, settings.role))
    if why is None:
        assert run is not None
        log.info("rollout buffer run %s is %s; not restarting it", run.get("run_id"), run.get("state"))
        if first_call and current_version is not None and run.get("task_type") is not None:
            client.trainer_version(current_version, rewind=True, agent_id=settings.role)
        return run.get("run_id")
    log.info("starting a rollout run (%s), skipping %d instance ids", why, len(payload["skip_instance_ids"]))
    answer = client.start_rollout(payload)
    if not answer.get("success", True):
        raise RolloutBufferError(f"/start_rollout refused: {answer.get('message')}")
    log.info("rollout buffer started run %s: %s", answer.get("run_id"), answer.get("message"))
    return answer.get("run_id")
