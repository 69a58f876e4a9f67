"""The inspector's token view of a stored record: each token's text, loss mask, log-prob and weight version,
where the model's turns start, and where the tokenization check found the sequence and the template differ."""

from __future__ import annotations

from itertools import accumulate
from typing import Any

from rollout_buffer.tokens.tokenizer import load_tokenizer


def token_view(record: dict[str, Any], tokenizer_path: str | None) -> dict[str, Any]:
    """JSON-ready per-token arrays of an exact-token record (`tokens` null for a chat-mode record).

    Blocking (it may load the tokenizer and decodes every token): run it in a thread. Without a tokenizer
    (records written with tokens by an outside generator, whose run names none) the texts are the ids.
    """
    tokens: list[int] | None = record.get("tokens")
    if not tokens:
        return {"tokens": None, "reason": "no exact tokens: a chat-mode record (messages only)"}
    n = len(tokens)
    response_length = record.get("response_length")
    prompt_length = n - response_length if isinstance(response_length, int) and 0 <= response_length <= n else 0
    loss = _aligned(record.get("loss_mask"), n)
    logprob = _aligned(record.get("rollout_log_probs"), n)
    info = record.get("extra_info") or {}
    version: list[str | None] = [None] * n
    spans = info.get("weight_version_spans")
    for span in spans if isinstance(spans, list) else []:
        # Written by the buffer's generators as [start, end, version]; anything else (a record posted by an
        # outside writer) is not shown rather than failing the view.
        if isinstance(span, list) and len(span) == 3 and all(isinstance(x, int) for x in span[:2]):
            for i in range(max(0, span[0]), min(span[1], n)):
                version[i] = None if span[2] is None else str(span[2])
    texts = _texts(tokens, tokenizer_path)
    # A model turn starts where the loss mask turns on after prompt or environment tokens (loss 0).
    turn_starts = [i for i in range(prompt_length, n)
                   if loss[i] == 1 and (i == prompt_length or loss[i - 1] != 1)] if loss[0] is not None else []
    return {
        "tokens": tokens, "text": texts, "loss": loss, "logprob": logprob, "version": version,
        "prompt_length": prompt_length, "turn_starts": turn_starts,
        "mismatch": _mismatch(info.get("tokenization_mismatch"), texts),
    }


def _aligned(values: list[Any] | None, n: int) -> list[Any]:
    """Per-token values of a field covering all n tokens or only the last ones (the response); None where
    the record has none."""
    if not values:
        return [None] * n
    values = list(values)[-n:]
    return [None] * (n - len(values)) + values


def _texts(tokens: list[int], tokenizer_path: str | None) -> list[str]:
    if not tokenizer_path:
        return [f"#{t}" for t in tokens]
    try:
        tokenizer = load_tokenizer(tokenizer_path)
    except ValueError:  # the run's tokenizer folder is gone: show ids rather than fail the view
        return [f"#{t}" for t in tokens]
    pieces = tokenizer.convert_ids_to_tokens(tokens)
    # An id outside the vocabulary (another model's tokens) has no piece: show the id.
    pairs = zip(tokens, pieces, strict=True)
    return [f"#{t}" if piece is None else tokenizer.convert_tokens_to_string([piece]) for t, piece in pairs]


def _mismatch(found: Any, texts: list[str]) -> dict[str, Any] | None:
    """The check's report and the index of the first differing token (a character offset of the decoded
    sequence is mapped to the token that holds it)."""
    if not isinstance(found, dict) or not found:
        return None
    position = found.get("position")
    index = None
    if isinstance(position, int):
        if found.get("unit") == "char":
            ends = list(accumulate(len(t) for t in texts))
            index = next((i for i, end in enumerate(ends) if end > position), len(texts) - 1)
        else:
            index = min(position, len(texts) - 1)
    return {**found, "token_index": index}
