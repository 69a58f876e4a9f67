"""What the simulated engine says about itself: SGLang's `/model_info` and `/server_info` of the imitated release,
and the simulator's own counters (`/sim/stats`)."""

from __future__ import annotations

import time
from typing import Any

from rollout_sim.contract import SGLANG_RELEASES, SIM_MODEL_NAME
from rollout_sim.engine import SimEngine


def model_info(engine: SimEngine) -> dict[str, Any]:
    """SGLang's `/model_info` of the imitated release."""
    info: dict[str, Any] = {
        "model_path": engine.tokenizer_path,
        "tokenizer_path": engine.tokenizer_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": engine.weight_version,
    }
    if engine.v23:
        info = {"model_path": engine.tokenizer_path, "served_model_name": SIM_MODEL_NAME, **info,
                "load_format": "auto", "reasoning_parser": None, "tool_call_parser": engine.config.tool_call_parser,
                "disaggregation_mode": "null"}
    return {**info, "has_image_understanding": False, "has_audio_understanding": False,
            "model_type": "simulated", "architectures": ["SimulatedForCausalLM"]}


def server_info(engine: SimEngine) -> dict[str, Any]:
    """SGLang's `/server_info` (server args + scheduler info), reduced to what callers read."""
    return {
        "model_path": engine.tokenizer_path,
        "tokenizer_path": engine.tokenizer_path,
        "served_model_name": SIM_MODEL_NAME,
        "host": engine.config.host,
        "port": engine.config.port,
        "tp_size": 1,
        "dp_size": 1,
        "context_length": engine.config.context_length,
        "stream_interval": engine.config.stream_interval,
        "incremental_streaming_output": engine.config.incremental_streaming_output,
        "allow_auto_truncate": False,
        "max_running_requests": None,
        "max_queued_requests": None,
        "tool_call_parser": engine.config.tool_call_parser,
        "weight_version": engine.weight_version,
        "status": "ready",
        "max_total_num_tokens": engine.config.context_length * 8,
        "max_req_input_len": engine.max_req_input_len,
        "internal_states": [{"avg_spec_accept_length": None, "last_gen_throughput": 0.0}],
        "version": SGLANG_RELEASES[engine.config.sglang_version],
        "simulated": True,
    }


def stats_json(engine: SimEngine) -> dict[str, Any]:
    """Counters for `/sim/stats`."""
    s = engine.stats
    return {
        "model": SIM_MODEL_NAME,
        "port": engine.config.port,
        "sglang_version": engine.config.sglang_version,
        "requests": s.requests,
        "by_endpoint": dict(s.by_endpoint),
        "faults": dict(s.faults),
        "finish": dict(s.finish),
        "prompt_tokens": s.prompt_tokens,
        "completion_tokens": s.completion_tokens,
        "in_flight": s.in_flight,
        "max_in_flight": s.max_in_flight,
        "queued_faults": engine.faults.queued(),
        "weight_version": engine.weight_version,
        "paused": engine.paused,
        "uptime_s": time.time() - engine.started,
    }
