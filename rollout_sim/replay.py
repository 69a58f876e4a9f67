"""What a trainer replays, as the engine answers it: the experts an MoE model routed each token to, and the ids
top-p sampling kept. Both are drawn from a hash of the token and its position (and of the checkpoint loaded), so
a test computes what any record must hold with `routed_row` and `kept_ids`.

Routed experts, as SGLang 0.5.23 started with `--enable-return-routed-experts` answers them
(`managers/scheduler_components/batch_result_processor.py: _maybe_collect_routed_experts`,
`managers/detokenizer_manager.py: _b64_encode_per_request`, `managers/scheduler.py`): a request with
`return_routed_experts` and `routed_experts_start_len` S gets, in its finished answer (an aborted running request
is one), `meta_info.routed_experts`: base64 of int32 `[rows, layers, top_k]` for the positions `[S, prompt +
output - 1)` of its sequence; an S below 0 or past the prompt is refused, an abort with status 400 and SGLang's
message. An engine started without the flag (or `--moe-layers 0`, a dense model) answers none.

Top-p replay, as slime reads it (`slime/utils/types.py: _extract_rollout_top_p_token_data`), from an engine that
returns the kept ids (`--top-p-replay`; SGLang 0.5.23 itself does not): a request whose
`sampling_params.custom_params.return_top_p_token_ids` is true gets, in its finished answer, `top_p_token_ids`
and `top_p_token_offsets`, base64 of int32: output token i kept `ids[offsets[i]:offsets[i + 1]]`, itself first.
"""

from __future__ import annotations

import base64
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

_INT32 = np.dtype("<i4")
_MAX_KEPT = 3  # ids kept per token besides itself, at most


@dataclass(frozen=True)
class ReplayConfig:
    """What the simulated engine returns for replay: an MoE model's routing (`layers` 0: a dense model; `enabled`:
    `--enable-return-routed-experts`), and the kept top-p ids (`top_p`)."""

    enabled: bool = False
    layers: int = 0
    top_k: int = 2
    experts: int = 64
    top_p: bool = False


def routed_rows(positions: np.ndarray, tokens: np.ndarray, layers: int, top_k: int, experts: int,
                weights: str = "") -> np.ndarray:
    """The experts (`[rows, layers, top_k]`, distinct within a layer) each token at its position is routed to."""
    salt = zlib.crc32(weights.encode())
    first = (positions.astype(np.int64)[:, None] * 2_654_435_761 + tokens.astype(np.int64)[:, None] * 40_503
             + np.arange(layers)[None, :] * 97 + salt) % experts
    return (first[:, :, None] + np.arange(top_k)[None, None, :]) % experts


def routed_row(position: int, token: int, layers: int, top_k: int, experts: int, weights: str = "") -> list[int]:
    """The experts (`layers` × `top_k`) the token at `position` is routed to, flat."""
    return routed_rows(np.array([position]), np.array([token]), layers, top_k, experts, weights).reshape(-1).tolist()


def kept_ids(position: int, token: int, vocab: int, weights: str = "") -> list[int]:
    """The ids top-p kept when the token at `position` was sampled: the token, then up to `_MAX_KEPT` others."""
    h = zlib.crc32(f"{weights}top_p:{position}:{token}".encode())
    others = [(h // 7 + 7919 * (j + 1)) % vocab for j in range(h % (_MAX_KEPT + 1))]
    return [token, *dict.fromkeys(o for o in others if o != token)]


def start_refusal(start: int, prompt_tokens: int) -> str | None:
    """SGLang's refusal of a `routed_experts_start_len` outside the prompt, None when it is inside."""
    if start < 0:
        return (f"recv_req.routed_experts_start_len={start} is lower than 0. "
                "Please use a non-negative routed_experts_start_len.")
    if start > prompt_tokens:
        return (f"recv_req.routed_experts_start_len={start} is higher than the number of input tokens "
                f"len(req.origin_input_ids)={prompt_tokens}. Please use a smaller routed_experts_start_len.")
    return None


def _b64(values: list[int]) -> str:
    return base64.b64encode(np.asarray(values, dtype=_INT32).tobytes()).decode()


def replay_fields(config: ReplayConfig, body: Any, prompt: list[int], output: list[int], vocab: int,
                  weights: str) -> dict[str, Any]:
    """The replay fields of a finished answer to `body` (a `GenerateRequest`) over `prompt` and `output`."""
    meta: dict[str, Any] = {}
    if body.return_routed_experts and config.enabled and config.layers:
        sequence = np.asarray([*prompt, *output])
        positions = np.arange(body.routed_experts_start_len, len(sequence) - 1)
        rows = routed_rows(positions, sequence[positions], config.layers, config.top_k, config.experts, weights)
        meta["routed_experts"] = base64.b64encode(rows.astype(_INT32).tobytes()).decode()
    custom = body.sampling_params.get("custom_params")
    if config.top_p and isinstance(custom, dict) and custom.get("return_top_p_token_ids"):
        kept = [kept_ids(len(prompt) + k, t, vocab, weights) for k, t in enumerate(output)]
        meta["top_p_token_ids"] = _b64([i for ids in kept for i in ids])
        meta["top_p_token_offsets"] = _b64(np.cumsum([0, *map(len, kept)]).tolist())
    return meta
