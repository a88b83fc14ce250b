"""Automatic labels of reasoning steps for the process reward model (the steps themselves:
:mod:`alignment.data.step_data`): an arithmetic step is correct when its equations hold (every
``lhs = rhs`` in it, with numbers and ``+ - * /``), as Math-Shepherd labels steps without humans
(Wang et al. 2024) but by checking the step itself instead of rolling out completions."""

from __future__ import annotations

import ast
import operator
import re

__all__ = ["arithmetic_step_label", "evaluate_arithmetic"]

# lhs: numbers, + - * / and parentheses, starting at a number, a minus sign or a parenthesis; rhs: a number
_EQUATION = re.compile(r"((?:-\s*)?[\d(][-+*/().\d\s]*?)\s*=\s*(-?\d+(?:\.\d+)?)")
_STARTS = re.compile(r"[-(\d]")
_ADJACENT = re.compile(r"[\w.]$|\d,$")  # the lhs would continue a word or a number (1,000)
_OPERATOR = re.compile(r"[-+*/=]$")  # ... or a longer expression
_OPERAND = re.compile(r"[\w)]$")  # a leading minus after an operand is a binary minus (x - 3 = 4)
_NOT_AFTER = re.compile(r"\d|[.,]\d|\s*[-+*/=]\s*[\d(]")  # the rhs would be part of a number or an expression
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
           ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow}
MAX_EXPONENT, MAX_DIGITS = 100, 1000  # bounds that keep one evaluation cheap


def evaluate_arithmetic(expression: str) -> int | float:
    """The value of ``expression``: numbers, ``+ - * / // % **`` and parentheses only (no names,
    no calls), exponents up to :data:`MAX_EXPONENT`, integers up to :data:`MAX_DIGITS` digits.

    Raises:
        ValueError: anything else, with what was wrong.
        ZeroDivisionError: division by zero.
    """
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError as e:
        raise ValueError(f"not an arithmetic expression ({e.msg})") from e

    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.UAdd, ast.USub)):
            v = value(node.operand)
            return -v if isinstance(node.op, ast.USub) else v
        if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
            left, right = value(node.left), value(node.right)
            if isinstance(node.op, ast.Pow) and abs(right) > MAX_EXPONENT:
                raise ValueError(f"exponent {right} is larger than {MAX_EXPONENT}")
            out = _BINARY[type(node.op)](left, right)
            if isinstance(out, int) and abs(out).bit_length() > MAX_DIGITS * 3.33:
                raise ValueError(f"a result longer than {MAX_DIGITS} digits")
            return out
        raise ValueError(f"{ast.unparse(node)!r} is not a number or + - * / // % ** of numbers")

    return value(tree.body)



def _equations(text: str):
    """``(lhs, rhs)`` of each equation standing on its own in ``text``: not inside a word, a number
    (``1,000``) or a longer expression (``x - 3 = 4``, ``12 = 3 * 4``, chains ``a = b = c``)."""
    i = 0
    while True:
        start = _STARTS.search(text, i)
        if start is None:
            return
        m = _EQUATION.match(text, start.start())
        before = text[:m.start()].rstrip() if m else ""
        if (m is None or _ADJACENT.search(text[:m.start()]) or _OPERATOR.search(before)
                or _NOT_AFTER.match(text, m.end()) or (m.group(1).startswith("-") and _OPERAND.search(before))):
            i = start.start() + 1
            continue
        yield m.group(1), m.group(2)
        i = m.end()


def arithmetic_step_label(step: str) -> int | None:
    """1 when every equation ``lhs = rhs`` in ``step`` holds (``lhs`` numbers with ``+ - * /`` and
    parentheses, ``rhs`` a number; equal within 1e-9), 0 when one does not, None when the step has
    no equation it can check (it gets no label: no score is trained at its end).

    Example: ``"3 + 4 = 7"`` -> 1, ``"7 - 9 = 2"`` -> 0, ``"Let's add."`` -> None, ``"x - 3 = 4"`` -> None.
    """
    found = None
    for lhs, rhs in _equations(step.replace("\u2212", "-").replace("\u00d7", "*").replace("\u00f7", "/")):
        try:
            value = evaluate_arithmetic(lhs)
        except (ValueError, ZeroDivisionError, OverflowError, RecursionError):
            continue
        if abs(value - float(rhs)) > 1e-9:
            return 0
        found = 1
    return found
