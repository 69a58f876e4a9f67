"""Where a conversation stood (`TurnMark`, taken right after an assistant turn) and what it gained after a point
(`ConversationTail`): what branches go back to and what a persisted agent session is rebuilt from."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class TurnMark:
    """Where a conversation stood right after one of its assistant turns (`Conversation.mark`)."""

    messages: int
    tokens: int
    weight_versions: int
    assistant_turns: int
    finish_reason: str | None
    truncated: bool
    log_probs_complete: bool
    abort_resumes: int = 0  # of the conversation's turns so far


@dataclass(frozen=True)
class ConversationTail:
    """What a conversation gained after a point (`Conversation.tail`): the new messages, tokens with their loss
    mask and log-probs, new weight versions, the version spans ending past the point, and the state it ended in
    (prompt length, the mark of its last assistant turn). `messages`, `tokens`, `versions`: the point, as
    counts."""

    messages: int
    tokens: int
    versions: int
    new_messages: list[dict[str, Any]]
    token_ids: list[int]
    loss_mask: list[int]
    log_probs: list[float]
    weight_versions: list[str]
    version_spans: list[list[Any]]
    prompt_length: int
    mark: TurnMark
    # The top-p kept ids of the new tokens, when the conversation keeps them: per new token where its ids end
    # (counted from the point's), and the ids (int32 bytes).
    top_p: tuple[list[int], bytes] | None = None
    # The images of the new tokens: (position of the first placeholder token, SHA-256).
    images: list[tuple[int, str]] = field(default_factory=list)
