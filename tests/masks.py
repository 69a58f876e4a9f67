"""Helpers for checking loss masks in tests."""

from __future__ import annotations


def spans(mask: list[int], value: int = 1) -> list[tuple[int, int]]:
    """[start, end) runs of `value` in `mask`."""
    out, start = [], None
    for i, m in enumerate([*mask, None]):
        if m == value and start is None:
            start = i
        elif m != value and start is not None:
            out.append((start, i))
            start = None
    return out
