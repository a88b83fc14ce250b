"""Reasoning steps of a response and their automatic labels for the process reward model: a step
is the text up to and including a separator (``"\\n"`` by default; the last step may end without
one), and an arithmetic step is correct when its equation holds (every ``lhs = rhs`` in it, with
integers and ``+ - *``), as Math-Shepherd labels steps without humans (Wang et al. 2024) but by
checking the step itself instead of rolling out completions."""

from __future__ import annotations

import ast
import operator
import re

__all__ = ["step_end_positions", "arithmetic_step_label"]

# lhs: starts at a number, a sign or a parenthesis; rhs: an integer
_EQUATION = re.compile(r"((?:-\s*)?[\d(][-+*()\d\s]*)=\s*(-?\d+)")
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul}


def step_end_positions(token_texts: list[str], separator: str = "\n") -> list[int]:
    """Indices of the tokens that end a step: each token whose text contains ``separator``, and the
    last token when the text does not end with one. ``token_texts``: each response token decoded
    on its own (a separator split over two tokens is not seen; "\\n" is one token in SmolLM2's and
    Llama's vocabularies).

    Raises:
        ValueError: an empty ``separator``.
    """
    if not separator:
        raise ValueError("the step separator is empty: give a string, e.g. '\\n'")
    ends = [i for i, t in enumerate(token_texts) if separator in t]
    if token_texts and (not ends or ends[-1] != len(token_texts) - 1):
        ends.append(len(token_texts) - 1)
    return ends


def _evaluate(node) -> int:
    if isinstance(node, ast.Expression):
        return _evaluate(node.body)
    if isinstance(node, ast.Constant) and isinstance(node.value, int):
        return node.value
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        value = _evaluate(node.operand)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left), _evaluate(node.right))
    raise ValueError("not integer arithmetic")


def arithmetic_step_label(step: str) -> int | None:
    """1 when every equation ``lhs = rhs`` in ``step`` holds (``lhs`` integers with ``+ - *`` and
    parentheses, ``rhs`` an integer), 0 when one does not, None when the step has no equation (it
    gets no label: no score is trained at its end).

    Example: ``"3 + 4 = 7"`` -> 1, ``"7 - 9 = 2"`` -> 0, ``"Let's add."`` -> None.
    """
    found = None
    for lhs, rhs in _EQUATION.findall(step.replace("\u2212", "-").replace("\u00d7", "*")):
        try:
            value = _evaluate(ast.parse(lhs.strip(), mode="eval"))
        except (SyntaxError, ValueError):
            continue
        if value != int(rhs):
            return 0
        found = 1
    return found
