"""Safe arithmetic: the ``calculator`` tool, evaluating an expression by walking its syntax tree.

Only numbers (int and float literals), ``+ - * / // % **``, parentheses and unary ``-``/``+`` are
allowed; nothing is ever passed to ``eval``. Every value is bounded as it is made: an integer past
:data:`MAX_INT_BITS` bits, a power whose result would be (checked before computing it), a float
that overflows and a nesting deeper than :data:`MAX_DEPTH` are refused, so one expression costs
microseconds whatever the model writes.
"""

from __future__ import annotations

import ast
import logging
import math
import operator
from collections.abc import Callable

from rlfleet.reward.errors import ToolFailed

logger = logging.getLogger(__name__)

MAX_EXPRESSION_CHARS = 2000
MAX_INT_BITS = 4096
"""Largest integer a step may produce (about 1,233 decimal digits)."""
MAX_DEPTH = 100
Number = int | float

_BINARY: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_ALLOWED = "numbers, + - * / // % **, parentheses and unary minus"


def evaluate(expression: str) -> Number:
    """The value of ``expression``; :class:`ToolFailed` (its reason for the model) if it is not
    arithmetic or its value is out of bounds."""
    text = expression.strip()
    if len(text) > MAX_EXPRESSION_CHARS:
        raise _fail(f"the expression is {len(text)} characters long; at most {MAX_EXPRESSION_CHARS} are read")
    try:
        tree = ast.parse(text, mode="eval")
    except SyntaxError as exc:
        raise _fail(f"{text!r} is not an arithmetic expression ({exc.msg})") from None
    except (RecursionError, MemoryError, ValueError):
        raise _fail("the expression is nested too deeply") from None
    return _value(tree.body, 0)


def format_number(value: Number) -> str:
    """``value`` as the tool shows it: integers whole, floats to 15 significant digits."""
    return str(value) if isinstance(value, int) else format(value, ".15g")


class CalculatorTool:
    """The ``calculator`` tool: one argument, ``expression``."""

    name = "calculator"
    argument = "expression"
    description = f"Evaluate an arithmetic expression ({_ALLOWED}) and return its value."
    argument_description = "the expression, e.g. '(12.5 - 3) * 4 ** 2'"

    def run(self, argument: str, deadline: float | None = None) -> str:
        return format_number(evaluate(argument))


def _value(node: ast.expr, depth: int) -> Number:
    if depth > MAX_DEPTH:
        raise _fail(f"the expression is nested deeper than {MAX_DEPTH} levels")
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return _bounded(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _value(node.operand, depth + 1)
        return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _value(node.left, depth + 1), _value(node.right, depth + 1)
        if isinstance(node.op, ast.Pow):
            _check_power(left, right)
        try:
            return _bounded(_BINARY[type(node.op)](left, right))
        except ZeroDivisionError:
            raise _fail("division by zero") from None
        except OverflowError:
            raise _fail("the result is too large") from None
    raise _fail(f"{_describe(node)} is not allowed; only {_ALLOWED}")


def _check_power(base: Number, exponent: Number) -> None:
    """Refuse an integer power whose result would pass :data:`MAX_INT_BITS` before computing it."""
    if isinstance(base, int) and isinstance(exponent, int) and abs(base) > 1 and exponent > 0:
        if exponent * math.log2(abs(base)) > MAX_INT_BITS:
            raise _fail(f"{base} ** {exponent} is too large (over {MAX_INT_BITS} bits)")


def _bounded(value: object) -> Number:
    if isinstance(value, int) and not isinstance(value, bool):
        if value.bit_length() > MAX_INT_BITS:
            raise _fail(f"the result is too large (over {MAX_INT_BITS} bits)")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise _fail("the result is not a finite number")
        return value
    raise _fail("the result is not a real number")  # a complex root of a negative number


def _describe(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return f"the name {node.id!r}"
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitXor):
        return "'^' (write ** for a power)"
    if isinstance(node, ast.Call):
        return "a function call"
    if isinstance(node, ast.Constant):
        return f"the constant {node.value!r}"
    return f"{type(node).__name__}"


def _fail(reason: str) -> ToolFailed:
    return ToolFailed("calculator", reason)
