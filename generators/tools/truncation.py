"""Cutting long tool responses to a character budget, with verl's sides and markers."""

from __future__ import annotations

from typing import Literal

TruncateSide = Literal["left", "right", "middle"]
TRUNCATE_SIDES: tuple[TruncateSide, ...] = ("left", "right", "middle")


def truncate_response(text: str, max_length: int, side: TruncateSide = "middle") -> str:
    """`text` cut to `max_length` characters (plus a marker) when longer; unchanged otherwise.

    The side names what is kept, as in verl's ToolAgentLoop: `left` keeps the start and appends
    `...(truncated)`, `right` keeps the end after `(truncated)...`, `middle` keeps both ends around
    `...(truncated)...` (half the budget each).
    """
    if max_length < 1:
        raise ValueError(f"max_length must be at least 1, got {max_length}")
    if side not in TRUNCATE_SIDES:
        raise ValueError(f"truncate side must be one of {', '.join(TRUNCATE_SIDES)}, got {side!r}")
    if len(text) <= max_length:
        return text
    if side == "left":
        return text[:max_length] + "...(truncated)"
    if side == "right":
        return "(truncated)..." + text[-max_length:]
    half = max_length // 2
    return text[:half] + "...(truncated)..." + (text[-half:] if half else "")
