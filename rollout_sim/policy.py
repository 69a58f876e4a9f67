"""Scripted replies of the simulated engine, chosen from the conversation text.

The policy table is ordered: the first policy whose `applies` accepts the conversation writes the reply.
Randomness comes in through a `Draw` made by the engine from its seeded RNG, so a policy is a pure function
of (conversation text, draw). The phrasing variant is derived from the question itself, which makes the
reply for a given prompt and draw identical across requests and processes.
"""

from __future__ import annotations

import ast
import json
import random
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction

from rollout_sim.judge import is_judge_prompt, judge_reply
from rollout_sim.prefix_memo import PrefixMemo
from rollout_sim.shell_agent import TOOL_RESPONSE, shell_reply, shell_tool

_WRONG_OFFSETS = (-3, -2, -1, 1, 2, 3)
_MAX_EXPR_CHARS = 200


@dataclass(frozen=True)
class Draw:
    """The random choices of one request: is the answer right, how far off it is, is the action invalid."""

    correct: bool
    offset: int
    invalid: bool


def make_draw(rng: random.Random, correct_rate: float, invalid_rate: float) -> Draw:
    """Draw the choices of one request; always consumes the same number of RNG values."""
    correct = rng.random() < correct_rate
    offset = rng.choice(_WRONG_OFFSETS)
    invalid = rng.random() < invalid_rate
    return Draw(correct=correct, offset=offset, invalid=invalid)


@dataclass(frozen=True)
class Policy:
    """One scripted behaviour: when it applies and what it says."""

    name: str
    applies: Callable[[str], bool]
    reply: Callable[[str, Draw], str]


def _variant(text: str, n: int) -> int:
    return zlib.crc32(text.encode()) % n


def last_user_turn(text: str) -> str:
    """Content of the last ChatML user turn, or the whole text when it has no chat markup."""
    start = text.rfind("<|im_start|>user")
    if start < 0:
        return text
    end = text.find("<|im_end|>", start)
    return text[start + len("<|im_start|>user") : end if end >= 0 else len(text)].strip()


# ---------------------------------------------------------------- math


_EXPR = re.compile(r"(?<![\w.])[(\d][\d\s()+\-*/×÷]*[\d)]")


@dataclass(frozen=True)
class Arithmetic:
    """A parsed arithmetic question: its text, exact value and the evaluation steps in order."""

    expr: str
    value: Fraction
    steps: tuple[tuple[str, Fraction], ...]


def _evaluate(node: ast.expr, steps: list[tuple[str, Fraction]]) -> Fraction:
    if isinstance(node, ast.Constant) and isinstance(node.value, int) and not isinstance(node.value, bool):
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -_evaluate(node.operand, steps)
    if isinstance(node, ast.BinOp) and isinstance(node.op, (ast.Add, ast.Sub, ast.Mult, ast.Div)):
        left, right = _evaluate(node.left, steps), _evaluate(node.right, steps)
        symbol = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}[type(node.op)]
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise ZeroDivisionError
            value = left / right
        else:
            value = {"+": left + right, "-": left - right, "*": left * right}[symbol]
        steps.append((f"{format_number(left)} {symbol} {format_number(right)}", value))
        return value
    raise ValueError("not simple arithmetic")


def _parse(candidate: str) -> Arithmetic | None:
    expr = " ".join(candidate.replace("×", "*").replace("÷", "/").split())
    # The pattern may swallow an unmatched bracket of the surrounding prose: drop it.
    while expr.endswith(")") and expr.count(")") > expr.count("("):
        expr = expr[:-1].rstrip()
    while expr.startswith("(") and expr.count("(") > expr.count(")"):
        expr = expr[1:].lstrip()
    if not expr or len(expr) > _MAX_EXPR_CHARS or not re.search(r"\d\s*\)*\s*[-+*/]", expr):
        return None
    try:
        tree = ast.parse(expr, mode="eval")
        steps: list[tuple[str, Fraction]] = []
        value = _evaluate(tree.body, steps)
    except (SyntaxError, ValueError, ZeroDivisionError):
        return None
    return Arithmetic(expr=expr, value=value, steps=tuple(steps)) if steps else None


def find_arithmetic(text: str) -> Arithmetic | None:
    """The last arithmetic expression of the last user turn (else of the whole text), evaluated exactly."""
    for match in reversed(list(_EXPR.finditer(last_user_turn(text)))):
        parsed = _parse(match.group(0))
        if parsed is not None:
            return parsed
    return last_arithmetic(text)


# The whole texts of recent conversations scanned, to a point no expression spans, with the last expression
# found before it: a conversation's next request is scanned from there (`PrefixMemo`).
_SCANNED: PrefixMemo[str, Arithmetic | None] = PrefixMemo()
_IN_EXPR = re.compile(r"[\d\s()+\-*/×÷]")  # the characters `_EXPR` matches


def last_arithmetic(text: str) -> Arithmetic | None:
    """The last arithmetic expression of `text`, evaluated exactly; the part of it an earlier text scanned is
    not scanned again (a match never spans a character outside `_IN_EXPR`, so the matches before such a point
    are the same in any text that starts the same)."""
    hit = _SCANNED.find(text)
    start, last = (hit.length, hit.value) if hit is not None else (0, None)
    cut = len(text)
    while cut > start and _IN_EXPR.match(text, cut - 1):
        cut -= 1
    before_cut = last
    for match in _EXPR.finditer(text, start):
        parsed = _parse(match.group(0))
        if parsed is not None:
            last = parsed
            if match.end() <= cut:
                before_cut = parsed
    if cut > start:
        _SCANNED.put(text[:cut], before_cut, replacing=hit)
    return last


def all_arithmetic(text: str) -> list[Arithmetic]:
    """Every distinct arithmetic expression of `text`, in order."""
    found: dict[str, Arithmetic] = {}
    for match in _EXPR.finditer(text):
        parsed = _parse(match.group(0))
        if parsed is not None:
            found.setdefault(parsed.expr, parsed)
    return list(found.values())


def format_number(value: Fraction) -> str:
    """An integer as digits, anything else as a LaTeX fraction."""
    if value.denominator == 1:
        return str(value.numerator)
    sign = "-" if value < 0 else ""
    return f"{sign}\\frac{{{abs(value.numerator)}}}{{{value.denominator}}}"


def _math_reply(text: str, draw: Draw) -> str:
    problem = find_arithmetic(text)
    if problem is None:
        return _guess_reply(text, draw)
    shown = problem.value if draw.correct else problem.value + draw.offset
    lines = [f"{step} = {format_number(v)}" for step, v in problem.steps[:-1]]
    lines.append(f"{problem.steps[-1][0]} = {format_number(shown)}")
    opener = (
        f"I need to compute {problem.expr}.",
        f"Let me work out {problem.expr} step by step.",
        f"The question asks for {problem.expr}; I will evaluate it carefully.",
    )[_variant(problem.expr, 3)]
    reasoning = "\n".join([opener, *lines])
    return f"<think>\n{reasoning}\n</think>\n\nThe answer is \\boxed{{{format_number(shown)}}}."


def _is_math(text: str) -> bool:
    return find_arithmetic(text) is not None


# ---------------------------------------------------------------- search (Search-R1 tags)


_INFORMATION = re.compile(r"<information>(.*?)</information>", re.DOTALL)
_QUESTION = re.compile(r"question:\s*", re.IGNORECASE)
_EXPLICIT_ANSWER = re.compile(r"\banswer\s*(?:is|:)\s*([^\n.;]+)", re.IGNORECASE)
_TITLE = re.compile(r"\(Title:\s*\"?(.+?)\"?\)(?=\s|$)")


def _question(text: str) -> str:
    """The question: the line after the last 'Question:', else the last line of the first user turn."""
    matches = list(_QUESTION.finditer(text))
    if matches:
        rest = text[matches[-1].end() :]
    else:
        start = text.find("<|im_start|>user")
        rest = text[start + len("<|im_start|>user") :] if start >= 0 else text
        rest = rest.split("<|im_end|>", 1)[0].strip()
        rest = rest.splitlines()[-1] if rest else ""
    first_line = rest.split("<|im_end|>", 1)[0].strip().split("\n", 1)[0]
    return first_line.strip().rstrip("?").strip()[:200] or "the question"


def _rollout_part(text: str) -> str:
    """The text produced after the prompt: from the first assistant turn, else after 'Question:'.

    Search-R1 instructions themselves mention `<information>` tags; only blocks in this part count.
    """
    start = text.find("<|im_start|>assistant")
    if start >= 0:
        return text[start:]
    matches = list(_QUESTION.finditer(text))
    return text[matches[-1].end() :] if matches else text


def answer_candidates(information: str) -> list[str]:
    """Possible answers found in retrieved text: an explicit 'answer is X', then document titles, then
    the first words of the text. The first candidate is the one a correct reply gives."""
    found = [m.group(1).strip() for m in _EXPLICIT_ANSWER.finditer(information)]
    found += [m.group(1).strip() for m in _TITLE.finditer(information)]
    words = information.split()
    if words:
        found.append(" ".join(words[:3]))
    unique: list[str] = []
    for candidate in found:
        if candidate and candidate not in unique:
            unique.append(candidate)
    return unique


def _search_reply(text: str, draw: Draw) -> str:
    if draw.invalid:
        return "I should look this up before I answer."
    blocks = _INFORMATION.findall(_rollout_part(text))
    if not blocks:
        query = _question(text)
        return f"<think>\nI need to find out: {query}.\n</think>\n<search> {query} </search>"
    candidates = answer_candidates(blocks[-1])
    if draw.correct and candidates:
        answer = candidates[0]
    else:
        answer = candidates[1] if len(candidates) > 1 else "unknown"
    return f"<think>\nThe search results point to {answer}.\n</think>\n<answer> {answer} </answer>"


def _is_search(text: str) -> bool:
    return "<search>" in text and "<answer>" in text


# ---------------------------------------------------------------- tool call (hermes, calculator)


CALCULATOR_TOOL = "calculator"
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def first_user_turn(text: str) -> str:
    """Content of the first ChatML user turn (the task, not a tool response), or the whole text."""
    start = text.find("<|im_start|>user")
    if start < 0:
        return text
    end = text.find("<|im_end|>", start)
    return text[start + len("<|im_start|>user") : end if end >= 0 else len(text)].strip()


def _offers_calculator(text: str) -> bool:
    return "<tools>" in text and f'"name": "{CALCULATOR_TOOL}"' in text


def _tool_call_reply(text: str, draw: Draw) -> str:
    """Call the calculator on the question's arithmetic, in parallel when it has several expressions; once it
    answered, box the last value (off when wrong).

    An invalid draw writes malformed calls; a tool error is answered with new calls.
    """
    start = text.find("<|im_start|>assistant")
    responses = TOOL_RESPONSE.findall(text[start:]) if start >= 0 else []
    value = _NUMBER.search(responses[-1]) if responses and not responses[-1].startswith("Error") else None
    if value is not None:
        shown = value.group(0) if draw.correct else format_number(Fraction(value.group(0)) + draw.offset)
        return (f"<think>\nThe calculator returned {value.group(0)}.\n</think>\n\n"
                f"The answer is \\boxed{{{shown}}}.")
    problems = all_arithmetic(first_user_turn(text))
    if not problems:
        return _guess_reply(text, draw)
    calls = []
    for problem in problems:
        arguments = '{"expression": }' if draw.invalid else json.dumps({"expression": problem.expr})
        calls.append(f'<tool_call>\n{{"name": "{CALCULATOR_TOOL}", "arguments": {arguments}}}\n</tool_call>')
    exprs = " and ".join(p.expr for p in problems)
    return f"<think>\nI will use the calculator for {exprs}.\n</think>\n\n" + "\n".join(calls)


def _expressions(text: str) -> list[Arithmetic]:
    """Every arithmetic expression of `text`, in order, each once."""
    found: list[Arithmetic] = []
    for match in _EXPR.finditer(text):
        parsed = _parse(match.group(0))
        if parsed is not None and all(p.expr != parsed.expr for p in found):
            found.append(parsed)
    return found


def _wants_parallel_calls(text: str) -> bool:
    task = first_user_turn(text)
    return _offers_calculator(text) and "in parallel" in task.lower() and len(_expressions(task)) >= 2


def _parallel_tool_call_reply(text: str, draw: Draw) -> str:
    """A task asking for several calculations "in parallel": one turn calling the calculator on each, then,
    once every call has a response, the results in order."""
    problems = _expressions(first_user_turn(text))
    start = text.find("<|im_start|>assistant")
    responses = TOOL_RESPONSE.findall(text[start:]) if start >= 0 else []
    if len(responses) >= len(problems):
        results = ", ".join(f"{p.expr} = {r.strip()}" for p, r in zip(problems, responses[-len(problems):],
                                                                         strict=True))
        return f"<think>\nThe calculator answered every call.\n</think>\n\nThe results are: {results}."
    calls = "\n".join(f'<tool_call>\n{{"name": "{CALCULATOR_TOOL}", "arguments": {json.dumps({"expression": p.expr})}}}'
                      "\n</tool_call>" for p in problems)
    return f"<think>\nI will compute the {len(problems)} expressions at once.\n</think>\n\n{calls}"


# ---------------------------------------------------------------- plan / act (generators/plan_act.py)


# The first words of the plan/act generator's default system prompts (generators/plan_act_format.py); the
# report and sub-task layouts below are that module's too.
PLANNER_MARKER = "You are the planner."
ACTOR_MARKER = "You are the actor."
SEARCH_TOOL = "search"
_REPORT = re.compile(
    r'<report\b[^>]*\bstatus="(\w+)"[^>]*>\s*Sub-task:\s*(.*?)\nResult:\s*(.*?)\s*</report>', re.DOTALL
)
_SUBTASK = re.compile(r"Your sub-task:\s*(.+)")
_BOXED = re.compile(r"\\boxed\{((?:[^{}]|\{[^{}]*\})*)\}")
_LATEX_FRACTION = re.compile(r"(-?)\\frac\{(\d+)\}\{(\d+)\}")
_OPERATORS = {ast.Add: "+", ast.Sub: "-", ast.Mult: "*", ast.Div: "/"}


def system_turn(text: str) -> str:
    """Content of the ChatML system turn (tool descriptions included), or '' without one."""
    start = text.find("<|im_start|>system")
    if start < 0:
        return ""
    end = text.find("<|im_end|>", start)
    return text[start + len("<|im_start|>system") : end if end >= 0 else len(text)]


def _offers_tool(text: str, name: str) -> bool:
    return "<tools>" in text and f'"name": "{name}"' in text


def reported_value(result: str) -> str | None:
    """The value an actor's report gives: its last `\\boxed{}`, else what follows 'answer is'."""
    boxed: list[str] = _BOXED.findall(result)  # one group: its text per match
    if boxed:
        return boxed[-1].strip()
    explicit = _EXPLICIT_ANSWER.search(result)
    return explicit.group(1).strip() if explicit else None


def _as_fraction(value: str) -> Fraction | None:
    latex = _LATEX_FRACTION.fullmatch(value.replace(" ", ""))
    if latex:
        return Fraction(int(latex.group(2)), int(latex.group(3))) * (-1 if latex.group(1) else 1)
    try:
        return Fraction(value.replace(",", ""))
    except (ValueError, ZeroDivisionError):
        return None


def _operand(value: Fraction) -> str:
    """A number as a sub-task writes it: bracketed when negative or fractional, so the step parses back."""
    if value.denominator != 1:
        return f"({value.numerator} / {value.denominator})"
    return str(value.numerator) if value >= 0 else f"({value.numerator})"


def _reduce(node: ast.expr, known: dict[str, Fraction], steps: list[str]) -> Fraction | None:
    """The value of `node` from reported results, or None; operations ready to compute go to `steps`."""
    if isinstance(node, ast.Constant):
        return Fraction(node.value) if isinstance(node.value, int | float | str) else None
    if isinstance(node, ast.UnaryOp):
        inner = _reduce(node.operand, known, steps)
        return None if inner is None else -inner
    assert isinstance(node, ast.BinOp)
    left, right = _reduce(node.left, known, steps), _reduce(node.right, known, steps)
    if left is None or right is None:
        return None
    step = f"{_operand(left)} {_OPERATORS[type(node.op)]} {_operand(right)}"
    if step in known:
        return known[step]
    if step not in steps:
        steps.append(step)
    return None


def _plan_reply(steps: list[str], failed: list[str]) -> str:
    retried = [s for s in steps if s in failed]
    reasoning = "I split the task into sub-tasks the actor can carry out."
    if retried:
        reasoning += f" The actor could not finish {retried[0]!r}, so I plan it again."
    body = "\n".join(f"<step>{s}</step>" for s in steps)
    return f"<think>\n{reasoning}\n</think>\n\n<plan>\n{body}\n</plan>"


def _planner_reply(text: str, draw: Draw) -> str:
    """Plan the operations of the task's arithmetic whose operands are known, one planner turn per level of
    the expression, then answer with the value the reports add up to (a question: one look-up, then its
    answer). A failed step is planned again. An invalid draw writes neither plan nor answer."""
    if draw.invalid:
        return "<think>\nI am not sure how to split this task.\n</think>\n\nLet me think about it again."
    task = first_user_turn(text)
    start = text.find("<|im_start|>assistant")
    reports = _REPORT.findall(text[start:]) if start >= 0 else []
    failed = [subtask.strip() for status, subtask, _ in reports if status != "done"]
    values = [(subtask.strip(), reported_value(result)) for status, subtask, result in reports if status == "done"]
    problem = find_arithmetic(task)
    if problem is None:
        answers = [v for _, v in values if v]
        if answers:
            return f"<think>\nThe actor found {answers[-1]}.\n</think>\n\n<answer>{answers[-1]}</answer>"
        return _plan_reply([f"Find out: {task.splitlines()[-1].strip()}"], failed)
    known: dict[str, Fraction] = {}
    for subtask, value in values:
        parsed, number = find_arithmetic(subtask), _as_fraction(value or "")
        if parsed is not None and number is not None:
            known[parsed.expr] = number
    steps: list[str] = []
    total = _reduce(ast.parse(problem.expr, mode="eval").body, known, steps)
    if total is not None:
        shown = format_number(total)
        return f"<think>\nThe reports add up to {shown}.\n</think>\n\n<answer>{shown}</answer>"
    return _plan_reply([f"Compute {s}." for s in steps], failed)


def _actor_reply(text: str, draw: Draw) -> str:
    """Work the sub-task with the offered tool (calculator for arithmetic, else search) and report the
    result, off by the draw's offset (or the wrong document) when the draw is wrong; a tool error is
    reported as a failure to finish."""
    first = first_user_turn(text)
    found = _SUBTASK.findall(first)
    subtask = found[-1].strip() if found else first
    start = text.find("<|im_start|>assistant")
    responses = TOOL_RESPONSE.findall(text[start:]) if start >= 0 else []
    if responses:
        last = responses[-1].strip()
        if last.startswith("Error"):
            return f"<think>\nThe tool failed.\n</think>\n\nI could not complete the sub-task: {last}"
        if _NUMBER.fullmatch(last):
            shown = Fraction(last) + (0 if draw.correct else draw.offset)
            return (f"<think>\nThe calculator returned {last}.\n</think>\n\n"
                    f"The result is \\boxed{{{format_number(shown)}}}.")
        candidates = answer_candidates(last)
        answer = candidates[0] if draw.correct and candidates else (candidates[1:] or ["unknown"])[0]
        return f"<think>\nThe documents point to {answer}.\n</think>\n\nThe answer is {answer}."
    problem = find_arithmetic(subtask)
    if problem is not None and _offers_tool(text, CALCULATOR_TOOL):
        arguments = '{"expression": }' if draw.invalid else json.dumps({"expression": problem.expr})
        return (f"<think>\nI will use the calculator for {problem.expr}.\n</think>\n\n"
                f'<tool_call>\n{{"name": "{CALCULATOR_TOOL}", "arguments": {arguments}}}\n</tool_call>')
    if _offers_tool(text, SEARCH_TOOL):
        query = json.dumps({"query": subtask.removeprefix("Find out:").strip()})
        return (f"<think>\nI will search for this.\n</think>\n\n"
                f'<tool_call>\n{{"name": "{SEARCH_TOOL}", "arguments": {query}}}\n</tool_call>')
    if problem is not None:
        shown = problem.value + (0 if draw.correct else draw.offset)
        return (f"<think>\nI compute {problem.expr} myself.\n</think>\n\n"
                f"The result is \\boxed{{{format_number(shown)}}}.")
    return "<think>\nI have no tool for this.\n</think>\n\nI cannot find this out without a tool."


# ---------------------------------------------------------------- fallback


def _guess_reply(text: str, draw: Draw) -> str:
    guess = 10 + _variant(last_user_turn(text), 90) + (0 if draw.correct else draw.offset)
    return (
        "<think>\nThis is not a calculation I can check, so I will make my best guess.\n</think>\n\n"
        f"The answer is \\boxed{{{guess}}}."
    )


POLICIES: tuple[Policy, ...] = (
    Policy("judge", is_judge_prompt, lambda text, _draw: judge_reply(text)),
    Policy("shell", lambda text: shell_tool(text) is not None, lambda text, _draw: shell_reply(text)),
    Policy("planner", lambda text: PLANNER_MARKER in system_turn(text), _planner_reply),
    Policy("actor", lambda text: ACTOR_MARKER in system_turn(text), _actor_reply),
    Policy("parallel_tool_call", _wants_parallel_calls, _parallel_tool_call_reply),
    Policy("tool_call", _offers_calculator, _tool_call_reply),
    Policy("search", _is_search, _search_reply),
    Policy("math", _is_math, _math_reply),
    Policy("guess", lambda _text: True, _guess_reply),
)


def choose_policy(text: str) -> Policy:
    """The first policy of the table that applies to the conversation."""
    return next(p for p in POLICIES if p.applies(text))


def scripted_reply(text: str, draw: Draw) -> tuple[str, str]:
    """(policy name, reply text) for the conversation rendered as `text`."""
    policy = choose_policy(text)
    return policy.name, policy.reply(text, draw)
