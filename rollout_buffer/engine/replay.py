"""What a trainer replays beside the tokens, as SGLang returns it: the experts each token was routed to (MoE
routing replay, R3) and the ids top-p sampling kept (top-p replay). Asked per `/generate` request (`ReplayAsk`),
read from each answer and joined over abort resumes as slime joins them (`slime/utils/types.py`,
`Sample._apply_meta_info`) into `ReplayParts`.

Routed experts (SGLang 0.5.23 started with `--enable-return-routed-experts`): a request with
`return_routed_experts` and `routed_experts_start_len` S is answered `meta_info.routed_experts`, base64 of int32
`[rows, layers, top_k]` for the token positions `[S, prompt + output - 1)`
(`managers/scheduler_components/batch_result_processor.py: _maybe_collect_routed_experts`); an S past the prompt
is refused (`managers/scheduler.py`). Each request asks from the rows its caller holds, so a turn over cached
tokens asks only for the new rows, and a resume continues where the answer before it stopped. An abort's rows are
kept when they fit and dropped otherwise: the resume asks for them again.

Top-p replay (slime sends `sampling_params.custom_params: {"return_top_p_token_ids": true}`): the answer's
`top_p_token_ids` (or `top_p_kept_token_ids`) and `top_p_token_offsets` (`top_p_kept_token_offsets`), int32 as
base64 or lists; the ids kept for output token i are `ids[offsets[i]:offsets[i + 1]]`.
"""

from __future__ import annotations

import binascii
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pybase64

TOP_P_IDS_KEYS = ("top_p_token_ids", "top_p_kept_token_ids")
TOP_P_OFFSETS_KEYS = ("top_p_token_offsets", "top_p_kept_token_offsets")
# The fields of an answer's meta_info these read (`sglang_wire.parse_generate` keeps them).
META_KEYS = ("routed_experts", *TOP_P_IDS_KEYS, *TOP_P_OFFSETS_KEYS)


class ReplayError(ValueError):
    """An answer whose replay data is missing or malformed; the message names the option and why."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing  # the engine did not return what was asked (rather than returning it wrong)


@dataclass(frozen=True)
class ReplayAsk:
    """What a generation asks of the engine beside tokens and log-probs: routed experts from position
    `routed_from` on (the rows the caller holds; None: not asked), `routed_width` int32 values a row when the
    caller knows it, and the ids top-p sampling kept (`top_p`)."""

    routed_from: int | None = None
    routed_width: int | None = None
    top_p: bool = False

    def __bool__(self) -> bool:
        return self.routed_from is not None or self.top_p


NO_REPLAY = ReplayAsk()


INT32 = np.dtype("<i4")


def int32s(value: Any, name: str) -> np.ndarray:
    """A flat little-endian int32 array from an answer's field: base64 of one, or a (nested) list of ints."""
    if isinstance(value, str):
        try:
            raw = pybase64.b64decode(value, validate=True)
        except (binascii.Error, ValueError) as e:
            raise ReplayError(f"{name}: not base64 ({e})") from None
        if len(raw) % 4:
            raise ReplayError(f"{name}: {len(raw)} bytes, not whole int32 values")
        return np.frombuffer(raw, dtype=INT32)
    if isinstance(value, list):
        try:
            wide = np.asarray(value)
        except ValueError:  # ragged
            raise ReplayError(f"{name}: a ragged list") from None
        if wide.size and wide.dtype.kind not in "iu":
            raise ReplayError(f"{name}: a list that is not of integers")
        if wide.size and (wide.min() < np.iinfo(INT32).min or wide.max() > np.iinfo(INT32).max):
            raise ReplayError(f"{name}: a value beyond int32")
        return wide.astype(INT32).reshape(-1)
    raise ReplayError(f"{name}: expected base64 or a list of integers, got {type(value).__name__}")


@dataclass
class ReplayParts:
    """Replay data of one generation, joined over its engine answers, as little-endian int32 bytes: routed-expert
    rows from the position asked (`routed_width` values a row), and per output token the ids top-p kept
    (`top_p_offsets`: one more than the tokens, from 0)."""

    routed: bytearray = field(default_factory=bytearray)
    routed_rows: int = 0
    routed_width: int | None = None
    top_p: bool = False  # asked for top-p kept ids
    top_p_ids: bytearray = field(default_factory=bytearray)
    top_p_offsets: bytearray = field(default_factory=lambda: bytearray(np.zeros(1, INT32).tobytes()))

    def add(self, ask: ReplayAsk, meta: dict[str, Any] | None, prompt_tokens: int, tokens: int, finish: str,
            engine: str) -> None:
        """Take one answer's replay data (`meta`: the answer's replay fields; None for a stream broken after some
        tokens, an abort): `prompt_tokens` its request sent, `tokens` it generated, `finish` its finish reason.
        ReplayError when a finished answer lacks what was asked or holds it wrong."""
        aborted = finish == "abort"
        if meta is None:
            if ask.top_p and tokens:
                raise ReplayError(f"top_p_replay: the stream broke after {tokens} tokens, whose kept ids it had "
                                  "not sent")
            return
        if ask.routed_from is not None:
            self._add_routed(ask, meta.get("routed_experts"), prompt_tokens, tokens, aborted, engine)
        if ask.top_p:
            self._add_top_p(meta, tokens, aborted, engine)

    def request_fields(self, ask: ReplayAsk) -> dict[str, Any]:
        """The `/generate` fields of the next request of this generation (the sampling params' are
        `top_p_params`)."""
        if ask.routed_from is None:
            return {}
        return {"return_routed_experts": True, "routed_experts_start_len": ask.routed_from + self.routed_rows}

    def _add_routed(self, ask: ReplayAsk, value: Any, prompt_tokens: int, tokens: int, aborted: bool,
                    engine: str) -> None:
        start = ask.routed_from or 0
        start += self.routed_rows
        expected = max(0, prompt_tokens + tokens - 1 - start)
        if value is None:
            if aborted:  # answered outside the scheduler (an abort in the waiting queue): the resume asks again
                return
            raise ReplayError(f"return_routed_experts: engine {engine} answered no routed_experts: SGLang returns "
                              "them only when started with --enable-return-routed-experts, for an MoE model",
                              missing=True)
        values = int32s(value, "routed_experts")
        width = self.routed_width or ask.routed_width
        if width is None and expected and len(values) % expected == 0 and not aborted:
            width = len(values) // expected
        if width is None or width <= 0 or len(values) % width:
            if aborted:
                return
            raise ReplayError(f"routed_experts: {len(values)} values do not make the {expected} rows expected "
                              f"(positions {start} to {prompt_tokens + tokens - 1})")
        rows = len(values) // width
        if rows != expected and not (aborted and rows < expected):
            if aborted:
                return
            raise ReplayError(f"routed_experts: {rows} rows of {width} values for positions {start} to "
                              f"{prompt_tokens + tokens - 1}, which need {expected}")
        self.routed_width = width
        self.routed += values.data  # appended from the decoded bytes, not copied first
        self.routed_rows += rows

    def _add_top_p(self, meta: dict[str, Any], tokens: int, aborted: bool, engine: str) -> None:
        ids_value = next((meta[k] for k in TOP_P_IDS_KEYS if meta.get(k) is not None), None)
        offsets_value = next((meta[k] for k in TOP_P_OFFSETS_KEYS if meta.get(k) is not None), None)
        if ids_value is None and offsets_value is None:
            if aborted and tokens == 0:
                return
            raise ReplayError(f"top_p_replay: engine {engine} answered no top_p_token_ids for {tokens} sampled "
                              "tokens: top-p replay needs an SGLang that returns the kept ids for "
                              "custom_params.return_top_p_token_ids (or set top_p_replay false)", missing=True)
        if ids_value is None or offsets_value is None:
            raise ReplayError("top_p_replay: the answer has top-p token ids or offsets, not both")
        ids, offsets = int32s(ids_value, "top_p_token_ids"), int32s(offsets_value, "top_p_token_offsets")
        if len(offsets) != tokens + 1 or offsets[0] != 0 or offsets[-1] != len(ids):
            raise ReplayError(f"top_p_token_offsets: {len(offsets)} offsets ending at "
                              f"{offsets[-1] if offsets else None} for {tokens} tokens and {len(ids)} ids; they "
                              "need tokens + 1, from 0 to the ids' count")
        if np.any(np.diff(offsets) < 0):
            raise ReplayError("top_p_token_offsets: they go back")
        base = int(np.frombuffer(self.top_p_offsets[-4:], dtype=INT32)[0])
        self.top_p_ids += ids.tobytes()
        self.top_p_offsets += (offsets[1:].astype(np.int64) + base).astype(INT32).tobytes()

def top_p_params(params: dict[str, Any]) -> dict[str, Any]:
    """Sampling params asking for the ids top-p keeps, as slime asks (`custom_params.return_top_p_token_ids`)."""
    custom = params.get("custom_params")
    return {**params, "custom_params": {**(custom if isinstance(custom, dict) else {}), "return_top_p_token_ids": True}}
