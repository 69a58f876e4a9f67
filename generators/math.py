"""Math: one assistant turn, reward 1 when math-verify finds the final answer equal to the label.

Input rows: `prompt` (a string or OpenAI messages) and `label` (the reference answer, LaTeX allowed).
Run options in the `/start_rollout` payload: `system_prompt`, `reward_timeout_s` (default 10).
Groups use the buffer's defaults: slime's validity rule (non-empty responses) and GRPO normalization.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import re
from collections import OrderedDict
from typing import Any

import math_verify.parser
from math_verify import parse, verify

from rollout_buffer.generator_api import RolloutContext, Trajectory

TASK_TYPE = "math"
REQUIRED_FIELDS = ("prompt", "label")

log = logging.getLogger(__name__)
# math-verify warns on every call that its signal-based timeout is off; we bound it with asyncio instead.
logging.getLogger("math_verify").setLevel(logging.ERROR)
# math-verify memoizes LaTeX → sympy for only the last 20 answers; the repeats of a group and the groups in
# flight beside it give the same few answers over and over, and that parse is ~90% of a reward's cost.
# math-verify looks the function up by name at call time, so a larger cache of the same function applies.
math_verify.parser.parse_latex_cached = functools.lru_cache(maxsize=8192)(
    math_verify.parser.parse_latex_cached.__wrapped__
)


def prompt_messages(item: dict[str, Any], system_prompt: str | None = None) -> list[dict[str, Any]]:
    """The task's prompt as OpenAI messages (a plain string becomes one user message)."""
    prompt = item["prompt"]
    messages = [dict(m) for m in prompt] if isinstance(prompt, list) else [{"role": "user", "content": str(prompt)}]
    if system_prompt and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


def final_answer_text(response: str) -> str:
    """The part of a response after its reasoning (`</think>`), where the final answer lives."""
    return response.rsplit("</think>", 1)[-1]


@functools.lru_cache(maxsize=4096)
def _gold(label: str) -> list:
    # Parsing the label is most of a reward's cost and is the same for every repeat of a group.
    gold_text = label if label.strip().startswith(("$", "\\(", "\\[")) else f"${label}$"
    return parse(gold_text, parsing_timeout=None)


_INTEGER = re.compile(r"\s*(-?\d+)\s*", re.ASCII)
_BOXED_INTEGER = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}", re.ASCII)


def integer_reward(final_answer: str, label: str) -> float | None:
    """math-verify's verdict, without sympy, when the label is a plain integer and the final answer boxes
    exactly one plain integer (GSM8K- and DAPO-Math-style data): the two compare as integers. None when
    anything else is written, for math-verify to decide (a parse costs ~2 ms of CPU on first sight)."""
    gold = _INTEGER.fullmatch(label)
    if gold is None or final_answer.count("\\boxed") != 1 or "\\fbox" in final_answer:
        return None
    pred = _BOXED_INTEGER.search(final_answer)
    if pred is None:
        return None
    return 1.0 if int(pred.group(1)) == int(gold.group(1)) else 0.0


def verified_reward(final_answer: str, label: str) -> float:
    """math-verify's verdict on a final answer (the text after the reasoning) against the label."""
    gold = _gold(label)
    pred = parse(final_answer, parsing_timeout=None)
    if not gold or not pred:
        return 0.0
    return 1.0 if verify(gold, pred, timeout_seconds=None) else 0.0


def math_reward(response: str, label: str) -> float:
    """1.0 when the response's final answer is mathematically equal to the label, else 0.0."""
    final = final_answer_text(response)
    quick = integer_reward(final, label)
    return quick if quick is not None else verified_reward(final, label)


# Rewards of recent (final answer, label) pairs: the repeats of a group often end with the very same answer
# text, and a hit answers on the event loop, without a hop to a worker thread and back.
_RECENT: OrderedDict[tuple[str, str], float] = OrderedDict()
_RECENT_MAX = 4096


async def score(response: str, label: str, timeout_s: float = 10.0) -> float:
    """`math_reward`, with math-verify in a worker thread (sympy is CPU-heavy); 0.0 when that takes longer
    than timeout_s."""
    key = (final_answer_text(response), label)
    quick = integer_reward(*key)
    if quick is not None:
        return quick
    known = _RECENT.get(key)
    if known is not None:
        _RECENT.move_to_end(key)
        return known
    try:
        reward = await asyncio.wait_for(asyncio.to_thread(verified_reward, *key), timeout_s)
    except TimeoutError:
        log.warning("math-verify took over %.0fs; reward 0", timeout_s)
        return 0.0
    _RECENT[key] = reward
    if len(_RECENT) > _RECENT_MAX:
        _RECENT.popitem(last=False)
    return reward


async def run_rollout(item: dict[str, Any], ctx: RolloutContext) -> Trajectory:
    """Generate one answer and score it against `label`."""
    conv = await ctx.conversation(prompt_messages(item, ctx.config.get("system_prompt")))
    finish = await ctx.generate(conv)
    response = conv.messages[-1]["content"] if conv.messages[-1]["role"] == "assistant" else ""
    label = str(item["label"])
    reward = await score(response, label, float(ctx.config.get("reward_timeout_s", 10.0)))
    return await ctx.trajectory(conv, reward, finish, label=label)
