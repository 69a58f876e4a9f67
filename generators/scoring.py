"""Scoring a final answer against an input row: math-verify against `label`, or exact match against
`golden_answers` / `answer` (Search-R1's normalisation). Shared by the plan/act and agent generators."""

from __future__ import annotations

from typing import Any, Literal

from generators.math import score
from generators.search import exact_match, golden_answers

Scorer = Literal["auto", "math", "em"]


async def answer_reward(answer: str | None, item: dict[str, Any], scorer: Scorer, timeout_s: float
                        ) -> tuple[float, str, dict[str, Any]]:
    """(reward, scorer used, the reference for extra_info); `auto` is math-verify when the row has a `label`,
    else exact match. 0 without an answer; ValueError when the row has nothing to compare with."""
    if scorer == "auto":
        scorer = "math" if item.get("label") is not None else "em"
    if scorer == "math":
        if item.get("label") is None:
            raise ValueError("scorer math needs a `label` in the row")
        label = str(item["label"])
        reward = 0.0 if answer is None else await score(answer, label, timeout_s)
        return reward, scorer, {"label": label}
    has_golden = item.get("golden_answers") is not None or item.get("answer") is not None
    if not has_golden and item.get("label") is None:
        raise ValueError("scorer em needs `golden_answers`, `answer` or `label` in the row")
    golden = golden_answers(item) if has_golden else [str(item["label"])]
    reward = float(answer is not None and exact_match(answer, golden))
    return reward, scorer, {"golden_answers": golden}
