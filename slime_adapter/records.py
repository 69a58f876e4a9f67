"""Trajectory record (the buffer's wire format) → slime `Sample`.

Records that carry exact tokens are used as they are: generated text is never re-tokenized, so the
trainer sees the very ids the engine produced, with their log-probs. Messages-only records (slime-style
generators) get tokens and loss mask from the multi-turn loss mask generator, as slime's original adapter
did.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

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


class SampleBuilder:
    """Builds samples; creates the loss mask generator only when a messages-only record needs it."""

    def __init__(self, tokenizer_loader: Callable[[], Any], loss_mask_type: str):
        self._tokenizer_loader = tokenizer_loader
        self.loss_mask_type = loss_mask_type
        self._generator: Any = None

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
            "metadata": {**extra_info, "raw_reward": record["reward"] if raw_reward is None else raw_reward},
        }
        if record.get("weight_versions"):
            fields["weight_versions"] = list(record["weight_versions"])
        known = sample_fields()
        return Sample(**{k: v for k, v in fields.items() if k in known})
