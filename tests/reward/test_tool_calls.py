"""Tool calls in a model's turn (both forms, malformed ones), the calculator tool, and one turn's counts.

No process is started here: the python tool's sandbox is tests/reward/test_sandbox.py's.
"""

from __future__ import annotations

import pytest

from rlfleet.reward.environments.arithmetic import MAX_INT_BITS, CalculatorTool, evaluate, format_number
from rlfleet.reward.environments.tools import run_turn
from rlfleet.reward.errors import ToolFailed
from rlfleet.reward.tool_calls import MalformedCall, ToolCall, parse_tool_calls

pytestmark = pytest.mark.timeout(30)

CALC = {"calculator": CalculatorTool()}


def tagged(body: str) -> str:
    return f"<tool_call>{body}</tool_call>"


def test_hermes_calls_are_read_in_order_with_object_or_string_arguments() -> None:
    text = (
        "Let me compute.\n"
        + tagged('{"name": "calculator", "arguments": {"expression": "2+3"}}')
        + "\nand\n"
        + tagged('{"name": "python", "arguments": "{\\"code\\": \\"print(1)\\"}"}')
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "2+3"}),
        ToolCall("python", {"code": "print(1)"}),
    ]


def test_an_unclosed_last_tag_is_read_to_the_end() -> None:
    """A generation stopped at the closing tag (a stop string) leaves it out."""
    text = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "7*6"}}\n'
    assert parse_tool_calls(text) == [ToolCall("calculator", {"expression": "7*6"})]


def test_plain_lines_call_the_calculator_unless_a_tag_is_there() -> None:
    text = "First:\ncalculator: 12 * 3\n  calculator:(1+1)**3  \nUsing the calculator: not at a line start"
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "12 * 3"}),
        ToolCall("calculator", {"expression": "(1+1)**3"}),
    ]
    mixed = "calculator: 1+1\n" + tagged('{"name": "calculator", "arguments": {"expression": "2"}}')
    assert parse_tool_calls(mixed) == [ToolCall("calculator", {"expression": "2"})]


def test_a_turn_without_calls_is_an_answer() -> None:
    assert parse_tool_calls("The answer is 42.") == []
    assert run_turn("The answer is 42.", CALC, max_calls=4).called is False


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        ('{"name": "calculator", "arguments": {"expression": "1"}', "not valid JSON"),
        ("[1, 2]", "JSON list, not an object"),
        ('{"arguments": {"expression": "1"}}', 'no "name"'),
        ('{"name": "calculator"}', 'no "arguments"'),
        ('{"name": "calculator", "arguments": "not json"}', "not a JSON object"),
        ('{"name": "calculator", "arguments": [1]}', "must be a JSON object"),
        ("", "an empty <tool_call>"),
    ],
)
def test_malformed_calls_say_why(body: str, reason: str) -> None:
    (call,) = parse_tool_calls(tagged(body))
    assert isinstance(call, MalformedCall) and reason in call.reason, call


def test_a_turn_counts_good_calls_tool_errors_and_malformed_calls() -> None:
    action = (
        tagged('{"name": "calculator", "arguments": {"expression": "6*7"}}')
        + tagged('{"name": "calculator", "arguments": {"expression": "1/0"}}')
        + tagged('{"name": "search", "arguments": {"q": "x"}}')
        + tagged('{"name": "calculator", "arguments": {"expr": "1"}}')
        + tagged("{oops")
    )
    turn = run_turn(action, CALC, max_calls=8)
    assert turn.called and (turn.tool_calls, turn.tool_errors, turn.malformed_calls) == (2, 1, 3)
    assert turn.info() == {"tool_calls": 2, "tool_errors": 1, "malformed_calls": 3}
    parts = turn.text.split("\n\n")
    assert parts[0] == "[1] 42"
    assert parts[1] == "[2] tool error: calculator: division by zero"
    assert parts[2].startswith(
        "[3] tool call error: unknown tool 'search'; the tools here are ['calculator']"
    )
    assert "lacks its argument 'expression'" in parts[3]
    assert "not valid JSON" in parts[4]


def test_calls_past_max_calls_are_not_run_and_count_as_malformed() -> None:
    action = "\n".join(f"calculator: {i}+1" for i in range(5))
    turn = run_turn(action, CALC, max_calls=2)
    assert (turn.tool_calls, turn.malformed_calls) == (2, 3)
    assert turn.text.endswith("at most 2 tool calls run per turn; 3 more were not run")


def test_one_call_is_its_result_alone() -> None:
    assert run_turn("calculator: 2 ** 10", CALC, max_calls=4).text == "1024"


@pytest.mark.parametrize(
    ("expression", "value"),
    [("2+3*4", 14), ("(2+3)*4", 20), ("-3 ** 2", -9), ("7 / 2", 3.5), ("7 // 2", 3), ("-7 % 3", 2),
     ("2 ** -1", 0.5), ("1_000 * 3", 3000), ("+-+4", -4), ("0.1 + 0.2", 0.1 + 0.2)],
)  # fmt: skip
def test_calculator_evaluates_arithmetic(expression: str, value: float) -> None:
    assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "reason"),
    [
        ("__import__('os').system('id')", "a function call is not allowed"),
        ("x + 1", "the name 'x' is not allowed"),
        ("2 ^ 3", "write ** for a power"),
        ("'a' * 3", "the constant 'a' is not allowed"),
        ("True + 1", "the constant True is not allowed"),
        ("1 / 0", "division by zero"),
        ("9 ** 9 ** 9", "too large"),
        (f"2 ** {MAX_INT_BITS + 1}", "too large"),
        ("10.0 ** 400", "too large"),
        ("1e308 * 10", "not a finite number"),
        ("(-8) ** 0.5", "not a real number"),
        ("1 +", "not an arithmetic expression"),
        ("-" * 200 + "1", "nested deeper"),
        ("1+" * 1500 + "1", "characters long"),
        ("[1][0]", "is not allowed"),
    ],
)
def test_calculator_refuses_what_is_not_bounded_arithmetic(expression: str, reason: str) -> None:
    with pytest.raises(ToolFailed) as info:
        evaluate(expression)
    assert info.value.tool == "calculator" and reason in str(info.value), info.value


def test_calculator_multiplication_growth_is_bounded() -> None:
    big = "*".join(["(2**1000)"] * 5)
    with pytest.raises(ToolFailed, match="too large"):
        evaluate(big)


def test_numbers_are_shown_whole_or_to_15_digits() -> None:
    assert format_number(evaluate("10 / 2")) == "5"
    assert format_number(evaluate("0.1 + 0.2")) == "0.3"
    assert format_number(evaluate("2 ** 70")) == str(2**70)
    assert CalculatorTool().run("1/3") == "0.333333333333333"
