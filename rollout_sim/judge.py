"""The simulated engine as a grader: a prompt that shows a reference answer and a response and asks for one of two
verdict labels (verifiers' reference judge, and LLM-judge prompts written like it) is answered with the first label
when the response's answer (its last `\\boxed{}`, else its last number) equals the reference's, else the second.
Deterministic: a judge, unlike the policy, is not what a run trains.
"""

from __future__ import annotations

import re

_LABELS = re.compile(r'Respond (?:either|only with|with) "([^"]+)" or "([^"]+)"')
_BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _block(text: str, heading: str) -> str | None:
    found = re.search(rf"{heading}:\s*```\n(.*?)\n```", text, re.DOTALL)
    return found.group(1) if found else None


def is_judge_prompt(text: str) -> bool:
    """Whether the conversation asks for a verdict on a response against a reference answer."""
    return bool(_LABELS.search(text)) and _block(text, "Reference answer") is not None \
        and _block(text, "Response") is not None


def _answer(text: str) -> str | None:
    boxed = _BOXED.findall(text)
    if boxed:
        return str(boxed[-1]).strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else (text.strip() or None)


def judge_reply(text: str) -> str:
    """The verdict label: the first when the response's answer matches the reference's."""
    labels: tuple[str, str] = _LABELS.findall(text)[-1]
    reference, response = _block(text, "Reference answer") or "", _block(text, "Response") or ""
    expected, given = _answer(reference), _answer(response)
    return labels[0] if expected is not None and given == expected else labels[1]
