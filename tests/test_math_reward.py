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
    verified = math_gen.verified_reward

    def counting(response: str, label: str) -> float:
        calls.append(threading.current_thread().name)
        return verified(response, label)

    monkeypatch.setattr(math_gen, "verified_reward", counting)
    monkeypatch.setattr(math_gen, "_RECENT", type(math_gen._RECENT)())

    async def scores() -> list[float]:
        # Different reasoning, same final answer text: one math-verify call.
        return [await score(f"<think>\nattempt {i}\n</think>\n\nIt is \\boxed{{7/2}}.", "3.5") for i in range(5)]

    assert asyncio.run(scores()) == [1.0] * 5
    assert len(calls) == 1 and calls[0] != threading.main_thread().name


def test_a_reward_past_its_timeout_is_zero_and_not_remembered(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow(response: str, label: str) -> float:
        time.sleep(0.3)
        return 1.0

    monkeypatch.setattr(math_gen, "verified_reward", slow)
    monkeypatch.setattr(math_gen, "_RECENT", type(math_gen._RECENT)())
    assert asyncio.run(score("\\boxed{3/2}", "1.5", timeout_s=0.05)) == 0.0
    assert asyncio.run(score("\\boxed{3/2}", "1.5", timeout_s=5)) == 1.0


INTEGER_CASES = [
    ("The answer is \\boxed{12}.", "12", 1.0),
    ("The answer is \\boxed{13}.", "12", 0.0),
    ("So \\boxed{ -4 } it is", "-4", 1.0),
    ("\\boxed{012}", " 12 ", 1.0),
    ("\\boxed{-0}", "0", 1.0),
    ("It is \\boxed{123456789012345678901234567890}", "123456789012345678901234567890", 1.0),
    ("It is \\boxed{123456789012345678901234567891}", "123456789012345678901234567890", 0.0),
    ("After 3 steps and 4 tries: \\boxed{7}. Check: 7 + 1 = 8", "7", 1.0),
]
# Written otherwise: math-verify decides.
OTHER_CASES = [
    ("\\boxed{12.0}", "12"), ("\\boxed{\\frac{24}{2}}", "12"), ("\\boxed{12} or \\boxed{13}", "13"),
    ("\\fbox{13} and \\boxed{12}", "12"), ("The answer is 12.", "12"), ("\\boxed{1,000}", "1000"),
    ("\\boxed{12}", "12.0"), ("\\boxed{12}", "$12$"), ("\\boxed{١٢}", "12"), ("\\boxed{+12}", "12"),
]


def test_plain_integers_get_math_verifys_verdict_without_it() -> None:
    for final, label, reward in INTEGER_CASES:
        assert math_gen.integer_reward(final, label) == reward, (final, label)
        assert math_gen.verified_reward(final, label) == reward, (final, label)
    for final, label in OTHER_CASES:
        assert math_gen.integer_reward(final, label) is None, (final, label)


def test_integer_answers_are_scored_on_the_loop(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(math_gen, "verified_reward", lambda *a: pytest.fail("math-verify was called"))
    monkeypatch.setattr(asyncio, "to_thread", lambda *a: pytest.fail("a worker thread was used"))
    assert asyncio.run(score("<think>\n\\boxed{3}\n</think>\n\nIt is \\boxed{4}.", "4")) == 1.0
    assert math_reward("<think>\n\\boxed{4}\n</think>\n\nIt is \\boxed{3}.", "4") == 0.0
