"""The plan/act text format: what the planner writes, what the actor is asked, what the planner reads back.

A planner turn is parsed as follows (reasoning is the `<think>…</think>` block; without one, the whole turn
counts as written after it):

1. `<answer>…</answer>` after the reasoning is the final answer and ends the episode (it wins over steps);
2. otherwise the plan is the `<step>…</step>` tags after the reasoning, or, when there are none, those
   inside it (a `<plan>` wrapper is optional);
3. without tags, numbered lines (`1. …`, `2) …`, `Step 3: …`) are the steps, again after the reasoning
   first, then inside it;
4. a turn with neither answer nor steps gets `INVALID_PLAN_HINT` as the next user turn.

The actor gets one sub-task per conversation: the task, the results of the episode's earlier sub-tasks and
its sub-task (`actor_prompt`). Its last reply is its report. The planner then reads one `<report>` per step
of its plan, in plan order (`render_reports`), as one user turn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

PLANNER_SYSTEM_PROMPT = (
    "You are the planner. You solve the task by splitting it into sub-tasks that an actor carries out, and "
    "you write the final answer. The actor's tools: {tools}.\n"
    "Reason inside <think> and </think> first. Then write either a plan, one self-contained sub-task per "
    "step:\n<plan>\n<step>first sub-task</step>\n<step>second sub-task</step>\n</plan>\n"
    "or, once the reports tell you enough, the final answer: <answer>final answer</answer>.\n"
    "The actor sees the task, the results of earlier sub-tasks and its own sub-task, nothing else. After a "
    "plan you get one <report> per sub-task; then revise the plan or answer."
)
ACTOR_SYSTEM_PROMPT = (
    "You are the actor. A planner split a task into sub-tasks; you carry out one of them, with the tools "
    "when they help. When you are done, reply without a tool call: that reply is the report the planner "
    "reads, so state the result plainly and put a final value in \\boxed{}."
)
INVALID_PLAN_HINT = (
    "Your reply had neither a plan nor an answer. Write sub-tasks as <step>...</step> inside <plan>...</plan>, "
    "or the final answer as <answer>...</answer>."
)
REVISE_NOTE = "Revise the plan or give the final answer."
LAST_TURN_NOTE = "Your next reply is your last: give the final answer."

_THINK_END = "</think>"
_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_STEP = re.compile(r"<step>(.*?)</step>", re.DOTALL)
_NUMBERED = re.compile(r"^\s*(?:step\s*)?\d+\s*[.):]\s*(.+?)\s*$", re.IGNORECASE | re.MULTILINE)


@dataclass(frozen=True)
class PlannerTurn:
    """What one planner turn says: the final answer, or the steps of a (revised) plan."""

    answer: str | None
    steps: tuple[str, ...]


def split_reasoning(text: str) -> tuple[str, str]:
    """(reasoning, the rest): the text before and after the last `</think>`; no reasoning without one."""
    head, sep, tail = text.rpartition(_THINK_END)
    return (head, tail) if sep else ("", text)


def parse_planner_turn(text: str) -> PlannerTurn:
    """The final answer or the plan of one planner turn (see the module doc for the rules)."""
    reasoning, rest = split_reasoning(text)
    answer = _ANSWER.search(rest)
    if answer is not None:
        return PlannerTurn(answer.group(1).strip(), ())
    for part in (rest, reasoning):
        tagged = [s.strip() for s in _STEP.findall(part) if s.strip()]
        if tagged:
            return PlannerTurn(None, tuple(tagged))
    for part in (rest, reasoning):
        numbered = [s.strip() for s in _NUMBERED.findall(part) if s.strip()]
        if numbered:
            return PlannerTurn(None, tuple(numbered))
    return PlannerTurn(None, ())


def tool_list(schemas: list[dict]) -> str:
    """The actor's tools for the planner's system prompt: `name (description)`, or `none`."""
    entries = []
    for schema in schemas:
        function = schema.get("function") or {}
        description = str(function.get("description") or "").strip().split("\n", 1)[0]
        entries.append(f"{function.get('name')} ({description})" if description else str(function.get("name")))
    return "; ".join(entries) or "none"


def actor_prompt(task: str, step: str, earlier: list[tuple[str, str]]) -> str:
    """The actor's user turn: the task first (a prefix every sub-task of the episode shares), the results of
    earlier sub-tasks, then its own sub-task."""
    parts = [f"Task: {task}"]
    if earlier:
        parts.append("Results of earlier sub-tasks:\n" + "\n".join(f"- {s}: {r}" for s, r in earlier))
    parts.append(f"Your sub-task: {step}")
    return "\n\n".join(parts)


@dataclass(frozen=True)
class Report:
    """What the planner reads about one step of its plan; `status` is `done`, `failed` or `skipped`."""

    position: int  # 1-based place of the step in its plan
    step: str
    status: str
    result: str


def render_reports(reports: list[Report], last_turn_next: bool) -> str:
    """The user turn after a plan: one `<report>` per step, then what the planner should do next."""
    blocks = [
        f'<report step="{r.position}" status="{r.status}">\nSub-task: {r.step}\nResult: {r.result}\n</report>'
        for r in reports
    ]
    return "\n".join([*blocks, LAST_TURN_NOTE if last_turn_next else REVISE_NOTE])
