"""The math reward: math-verify equality of the final answer, scored off the event loop, repeats answered at once."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

import generators.math as math_gen
from generators.math import math_reward, score


def test_equal_answers_in_other_forms_score_one() -> None:
    assert math_reward("<think>\n1/2 of it\n</think>\n\nThe answer is \\boxed{\\frac{1}{2}}.", "0.5") == 1.0
    assert math_reward("So it is \\boxed{12}.", "12") == 1.0
    assert math_reward("So it is \\boxed{13}.", "12") == 0.0
    # Only the part after the reasoning counts: a right number inside <think> is not the answer.
    assert math_reward("<think>\n\\boxed{12}\n</think>\n\nI give up.", "12") == 0.0


def test_a_repeated_answer_is_scored_once(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []

    def counting(response: str, label: str) -> float:
        calls.append(threading.current_thread().name)
        return math_reward(response, label)

    monkeypatch.setattr(math_gen, "math_reward", counting)
    monkeypatch.setattr(math_gen, "_RECENT", type(math_gen._RECENT)())

    async def scores() -> list[float]:
        # Different reasoning, same final answer text: one math-verify call.
        return [await score(f"<think>\nattempt {i}\n</think>\n\nIt is \\boxed{{7}}.", "7") for i in range(5)]

    assert asyncio.run(scores()) == [1.0] * 5
    assert len(calls) == 1 and calls[0] != threading.main_thread().name


def test_a_reward_past_its_timeout_is_zero_and_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(response: str, label: str) -> float:
        time.sleep(0.3)
        return 1.0

    monkeypatch.setattr(math_gen, "math_reward", slow)
    monkeypatch.setattr(math_gen, "_RECENT", type(math_gen._RECENT)())
    assert asyncio.run(score("\\boxed{3}", "3", timeout_s=0.05)) == 0.0
    assert asyncio.run(score("\\boxed{3}", "3", timeout_s=5)) == 1.0
