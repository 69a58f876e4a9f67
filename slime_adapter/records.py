"""Trajectory record (the buffer's wire format) → slime `Sample`.

Records that carry exact tokens are used as they are: generated text is never re-tokenized, so the
trainer sees the very ids the engine produced, with their log-probs. Messages-only records (slime-style
generators) get tokens and loss mask from the multi-turn loss mask generator, as slime's original adapter
did.
"""

from __future__ import annotations

import binascii
import functools
import io
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pybase64

from slime_adapter.loss_mask import MultiTurnLossMaskGenerator, get_response_lengths, unrenderable_reason
from slime_adapter.sample import Sample, sample_fields, status_member

log = logging.getLogger(__name__)

Record = dict[str, Any]


class RecordError(ValueError):
    """A record cannot become a sample; the message names its uid."""


@functools.cache
def load_tokenizer(path: str) -> Any:
    """The tokenizer of `path` (a local directory), loaded once per process."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=True)


@functools.cache
def load_image_processor(path: str | None) -> Any | None:
    """The image processor of the checkpoint at `path` (its `preprocessor_config.json`), loaded once per process;
    None when it has none."""
    if not path or not (Path(path) / "preprocessor_config.json").is_file():
        return None
    from transformers import AutoImageProcessor

    return AutoImageProcessor.from_pretrained(path, trust_remote_code=True)


def open_image(data: bytes) -> Any:
    """An image's bytes as the PIL image slime's `multimodal_inputs` holds (RGB, as slime sends images)."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return image.convert("RGB")


def sample_index(instance_id: Any) -> int | str:
    """slime sorts samples by `index`: numeric instance ids become ints, others stay strings."""
    if isinstance(instance_id, int) and not isinstance(instance_id, bool):
        return instance_id
    text = str(instance_id)
    try:
        return int(text)
    except ValueError:
        return text


def sample_status(record: Record) -> Any:
    """`Sample.Status` of a record: truncated by status or by a `length` finish reason."""
    status = record.get("status") or "completed"
    if status == "truncated" or (record.get("extra_info") or {}).get("finish_reason") == "length":
        return status_member("TRUNCATED")
    if status in ("aborted", "failed"):
        return status_member(status.upper())
    return status_member("COMPLETED")


def _last_assistant_text(messages: list[dict[str, Any]]) -> str:
    for message in reversed(messages):
        if message.get("role") == "assistant":
            content = message.get("content")
            return content if isinstance(content, str) else ""
    return ""


def _exact_tokens(record: Record) -> tuple[list[int], int, list[int]]:
    # The record was just decoded for this sample: its lists are used as they are, not copied.
    tokens = record["tokens"] if isinstance(record["tokens"], list) else list(record["tokens"])
    mask = record.get("loss_mask")
    length = record.get("response_length")
    if mask is not None and len(mask) == len(tokens):
        if length is None:
            length = get_response_lengths([mask])[0]
        response_mask = list(mask[len(mask) - length :])
    elif mask is not None and length is not None and len(mask) == length:
        response_mask = list(mask)
    elif mask is None and length is not None:
        response_mask = [1] * length
    else:
        raise RecordError(
            f"record {record.get('uid')}: tokens need a loss_mask of len(tokens) or response_length entries"
        )
    if not 0 <= length <= len(tokens):
        raise RecordError(f"record {record.get('uid')}: response_length {length} outside 0..{len(tokens)}")
    return tokens, length, response_mask


def _int32(record: Record, name: str) -> np.ndarray | None:
    value = record.get(name)
    if value is None:
        return None
    try:
        # Writable: slime's trainer turns them into tensors it may write to.
        return np.frombuffer(bytearray(pybase64.b64decode(value, validate=True)), dtype="<i4")
    except (binascii.Error, ValueError, TypeError) as e:
        raise RecordError(f"record {record.get('uid')}: {name} is not base64 of int32 ({e})") from None


def trainer_signals(record: Record, tokens: list[int], response_length: int,
                    moe_shape: tuple[int, int] | None) -> dict[str, Any]:
    """The sample fields of what the trainer replays (routed experts, top-p kept ids, teacher log-probs), as slime
    holds them: routed experts `[len(tokens) - 1, layers, top_k]` (`[rows, values]` without `moe_shape`), top-p
    offsets `response_length + 1` into the kept ids; RecordError when they do not fit the sample's tokens."""
    uid = record.get("uid")
    fields: dict[str, Any] = {}
    experts = _int32(record, "rollout_routed_experts")
    if experts is not None:
        rows = max(0, len(tokens) - 1)
        width = experts.size // rows if rows and experts.size % rows == 0 else None
        if width is None or (moe_shape is not None and width != moe_shape[0] * moe_shape[1]):
            raise RecordError(f"record {uid}: rollout_routed_experts: {experts.size} values for {rows} rows of "
                              f"{'x'.join(map(str, moe_shape)) if moe_shape else 'any'} values")
        fields["rollout_routed_experts"] = experts.reshape(rows, *(moe_shape or (width,)))
    ids, offsets = _int32(record, "rollout_top_p_token_ids"), _int32(record, "rollout_top_p_token_offsets")
    if (ids is None) != (offsets is None) or (offsets is not None and (
            len(offsets) != response_length + 1 or offsets[-1] != (0 if ids is None else len(ids)))):
        raise RecordError(f"record {uid}: rollout_top_p_token_offsets do not fit {response_length} response tokens "
                          "and the kept ids")
    if ids is not None:
        fields["rollout_top_p_token_ids"], fields["rollout_top_p_token_offsets"] = ids, offsets
    teacher = record.get("teacher_log_probs")
    if teacher is not None:
        if len(teacher) != response_length:
            raise RecordError(f"record {uid}: {len(teacher)} teacher_log_probs for {response_length} tokens")
        fields["teacher_log_probs"] = list(teacher)
    return fields


def multimodal(record: Record, image: Callable[[str], Any], processor: Any | None) -> dict[str, Any]:
    """The sample fields of a record's images, as slime holds them: `multimodal_inputs` (`{"images": [PIL
    images]}`, in the order of their placeholders) and, with the checkpoint's image processor, its outputs for
    them (`multimodal_train_inputs`: `pixel_values`, `image_grid_thw`), which slime's trainer feeds the model."""
    refs = record.get("images") or []
    if not refs:
        return {}
    images = [image(str(ref["sha256"])) for ref in refs]
    fields: dict[str, Any] = {"multimodal_inputs": {"images": images}}
    if processor is not None:
        fields["multimodal_train_inputs"] = dict(processor(images=images, return_tensors="pt"))
    return fields


class SampleBuilder:
    """Builds samples; creates the loss mask generator only when a messages-only record needs it. `moe_shape`:
    slime's (`--num-layers`, `--moe-router-topk`), which routed experts are shaped by; `image`: a record's image
    by its hash (a PIL image), and `image_processor` the checkpoint's, for records that hold images."""

    def __init__(self, tokenizer_loader: Callable[[], Any], loss_mask_type: str,
                 moe_shape: tuple[int, int] | None = None, image: Callable[[str], Any] | None = None,
                 image_processor: Callable[[], Any] | None = None):
        self._tokenizer_loader = tokenizer_loader
        self.loss_mask_type = loss_mask_type
        self.moe_shape = moe_shape
        self._image = image
        self._image_processor = image_processor
        self._generator: Any = None

    def _multimodal(self, record: Record) -> dict[str, Any]:
        if not record.get("images"):
            return {}
        if self._image is None:
            raise RecordError(f"record {record.get('uid')}: it holds images, and the adapter has no buffer to "
                              "fetch them from")
        return multimodal(record, self._image, self._image_processor() if self._image_processor else None)

    def _masked_tokens(self, record: Record) -> tuple[list[int], int, list[int]]:
        uid = record.get("uid")
        reason = unrenderable_reason(record.get("messages"))
        if reason is not None:
            raise RecordError(f"record {uid}: {reason}")
        if self._generator is None:
            self._generator = MultiTurnLossMaskGenerator(self._tokenizer_loader(), self.loss_mask_type)
        try:
            tokens, mask = self._generator.get_loss_mask(record["messages"], tools=record.get("tools"))
        except Exception as e:  # the chat template refused the conversation
            raise RecordError(f"record {uid}: the loss mask generator cannot render it: {type(e).__name__}: {e}"
                              ) from e
        length = get_response_lengths([mask])[0]
        return tokens, length, mask[len(mask) - length :]

    def build(self, record: Record) -> Any:
        """One `Sample` from one record."""
        uid, log_probs = record.get("uid"), record.get("rollout_log_probs")
        if record.get("tokens") is not None:
            tokens, length, loss_mask = _exact_tokens(record)
            if log_probs is not None and len(log_probs) != length:
                raise RecordError(f"record {uid}: {len(log_probs)} rollout_log_probs for {length} tokens")
        else:
            tokens, length, loss_mask = self._masked_tokens(record)
            if log_probs is not None and len(log_probs) != length:
                # Engine log-probs belong to the engine's tokens, not to this re-tokenization.
                log.warning("record %s: dropping rollout_log_probs that do not match its tokens", uid)
                log_probs = None
        extra_info = dict(record.get("extra_info") or {})
        raw_reward = record.get("raw_reward")
        fields: dict[str, Any] = {
            "index": sample_index(record["instance_id"]),
            "prompt": uid,
            "tokens": tokens,
            "response": _last_assistant_text(record.get("messages") or []),
            "response_length": length,
            "reward": record["reward"],
            "loss_mask": loss_mask,
            "rollout_log_probs": log_probs if log_probs is None or isinstance(log_probs, list) else list(log_probs),
            "status": sample_status(record),
            # `rollout_id`: which trajectory it is of; `take_batch` numbers them for slime's `Sample.rollout_id`.
            "metadata": {**extra_info, "raw_reward": record["reward"] if raw_reward is None else raw_reward,
                         "rollout_id": record.get("rollout_id") or uid},
            **trainer_signals(record, tokens, length, self.moe_shape),
            **self._multimodal(record),
        }
        if record.get("weight_versions"):
            fields["weight_versions"] = list(record["weight_versions"])
        known = sample_fields()
        return Sample(**{k: v for k, v in fields.items() if k in known})
