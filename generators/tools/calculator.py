"""The bundled calculator tool: exact arithmetic on a parsed expression, never `eval`.

Numbers are exact fractions while computing, so `0.1 + 0.2` is `0.3` and `7 / 2` is `3.5`. Results and
intermediate values are bounded so a model cannot make the tool compute `9 ** 9 ** 9`.
"""

from __future__ import annotations

import ast
import math
import re
from fractions import Fraction

from generators.tools.function import function_tool

MAX_EXPRESSION_CHARS = 500
MAX_MAGNITUDE = Fraction(10) ** 60
_SIGNIFICANT_DIGITS = 12
_MAX_POWER_DIGITS = 200
# Thousands separators as people write them ("1,284"): dropped before parsing.
_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_SYMBOLS = {"×": "*", "÷": "/", "−": "-", "^": "**"}


def evaluate(expression: str) -> Fraction:
    """The exact value of an arithmetic expression: numbers, + - * / // % **, unary signs, brackets.

    Raises ValueError for anything else (names, calls, a division by zero, a value over 10**60).
    """
    text = expression.strip()
    if not text:
        raise ValueError("empty expression")
    if len(text) > MAX_EXPRESSION_CHARS:
        raise ValueError(f"expression longer than {MAX_EXPRESSION_CHARS} characters")
    for symbol, python in _SYMBOLS.items():
        text = text.replace(symbol, python)
    text = _THOUSANDS.sub("", text)
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError:
        raise ValueError(f"cannot parse {expression!r} as arithmetic") from None
    return _eval(tree.body)


def _eval(node: ast.expr) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(Fraction(str(node.value)))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _eval(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp):
        left, right = _eval(node.left), _eval(node.right)
        op = node.op
        if isinstance(op, ast.Add):
            return _bounded(left + right)
        if isinstance(op, ast.Sub):
            return _bounded(left - right)
        if isinstance(op, ast.Mult):
            return _bounded(left * right)
        if isinstance(op, ast.Div | ast.FloorDiv | ast.Mod):
            if right == 0:
                raise ValueError("division by zero")
            if isinstance(op, ast.Div):
                return _bounded(left / right)
            return _bounded(Fraction(left // right) if isinstance(op, ast.FloorDiv) else left % right)
        if isinstance(op, ast.Pow):
            return _power(left, right)
    raise ValueError(f"unsupported in arithmetic: {ast.unparse(node)!r}")


def _power(base: Fraction, exponent: Fraction) -> Fraction:
    if exponent.denominator != 1:
        raise ValueError("only whole-number exponents are supported")
    if base == 0 and exponent < 0:
        raise ValueError("division by zero")
    # Check the size before computing: a huge power would take the worker thread with it.
    size = max(math.log10(abs(base.numerator) or 1), math.log10(base.denominator))
    if abs(exponent) * size > _MAX_POWER_DIGITS:
        raise ValueError("result too large")
    return _bounded(base ** int(exponent))


def _bounded(value: Fraction) -> Fraction:
    if abs(value) > MAX_MAGNITUDE:
        raise ValueError("result too large")
    return value


def format_value(value: Fraction) -> str:
    """An integer as digits, anything else as a decimal of up to 12 significant digits."""
    if value.denominator == 1:
        return str(value.numerator)
    return f"{float(value):.{_SIGNIFICANT_DIGITS}g}"


@function_tool
def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression exactly and return its value.

    Args:
        expression: The arithmetic to evaluate, with numbers, + - * / // % ** and parentheses, e.g. "(3 + 4) * 5".
    """
    return format_value(evaluate(expression))
