"""Checking the replay data of a record (`rollout_routed_experts`, top-p kept ids, teacher log-probs) against the
simulated engine's deterministic answers (`rollout_sim.replay`), value by value."""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
import pytest

from rollout_sim.replay import kept_ids, routed_row
from rollout_sim.replies import token_logprob

LAYERS, TOP_K, EXPERTS = 3, 2, 64
# The simulated engine's flags: an MoE model's routing and the top-p kept ids returned when asked.
MOE = ("--enable-return-routed-experts", "--moe-layers", str(LAYERS), "--moe-top-k", str(TOP_K), "--top-p-replay")


def int32s(value: str) -> np.ndarray:
    return np.frombuffer(base64.b64decode(value), dtype="<i4")


def assert_replayed(rec: dict[str, Any], vocab: int, teacher: bool = True, top_p: bool = True) -> None:
    """Every routed-expert row and kept id of `rec` is the engine's for its own token and position, and its
    teacher log-probs the teacher's, as slime aligns them: rows for all tokens but the last, kept ids per response
    token (none for those the engine did not sample), teacher log-probs per response token."""
    tokens, response = rec["tokens"], rec["response_length"]
    rows = int32s(rec["rollout_routed_experts"]).reshape(-1, LAYERS * TOP_K)
    assert rows.shape[0] == len(tokens) - 1
    assert rows.tolist() == [routed_row(i, tokens[i], LAYERS, TOP_K, EXPERTS) for i in range(len(tokens) - 1)]
    prompt = len(tokens) - response
    if not top_p:
        assert "rollout_top_p_token_ids" not in rec
        return
    offsets, ids = int32s(rec["rollout_top_p_token_offsets"]), int32s(rec["rollout_top_p_token_ids"]).tolist()
    assert len(offsets) == response + 1 and offsets[-1] == len(ids)
    for k in range(response):
        position = prompt + k
        sampled = kept_ids(position, tokens[position], vocab) if rec["loss_mask"][position] else []
        assert ids[offsets[k]:offsets[k + 1]] == sampled, f"{rec['uid']}: position {position}"
    if teacher:
        want = [token_logprob(tokens[prompt + k], prompt + k) for k in range(response)]
        assert rec["teacher_log_probs"] == pytest.approx(want, abs=1e-6)
