"""Answer-checking rules: number extraction, numeric and exact_match."""

from __future__ import annotations

import pytest

from rlfleet.reward.answers import ExactMatch, Numeric, extract_number
from rlfleet.reward.errors import RewardInputError


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("The answer is 1,234.", 1234.0),
        ("#### -3", -3.0),
        ("no number", None),
        ("", None),
        ("It is 42.0", 42.0),
        ("first 3 then 7", 7.0),
        ("We get 5 apples.\n#### 1,000\n", 1000.0),
        ("#### 72 and then 9 more words", 72.0),
        ("#### nothing here, but 12 earlier?", 12.0),
        ("costs $1,000,000.50 in total", 1_000_000.5),
        ("a list 1,2,3", 3.0),
        ("a range 10-3", 3.0),
        ("\u22125 degrees", -5.0),
        ("about 50% of them", 50.0),
        ("pour .5 liters", 0.5),
        ("version 3.", 3.0),
        ("x = +8", 8.0),
    ],
)
def test_extract_number(text: str, expected: float | None) -> None:
    assert extract_number(text) == expected


def test_extract_number_strict_needs_the_marker() -> None:
    assert extract_number("The answer is 42.", strict=True) is None
    assert extract_number("work 1 2 #### 42", strict=True) == 42.0
    assert extract_number("#### none", strict=True) is None
    assert extract_number("answer: 7", marker="answer:", strict=True) == 7.0


@pytest.mark.parametrize(
    ("response", "answer", "expected"),
    [
        ("The answer is 1,234.", 1234, 1.0),
        ("The answer is 1,234.", "1234", 1.0),
        ("The answer is 1,234.", "1,234", 1.0),
        ("#### -3", -3, 1.0),
        ("#### -3", 3, 0.0),
        ("It is 42.0", 42, 1.0),
        ("It is 42", "42.0", 1.0),
        ("no number", 1, 0.0),
        ("so 5 + 6 = 11 #### 11", "Natalia sold 48/2 = 24 clips.\n#### 11", 1.0),
        ("0.30000000000000004", 0.3, 1.0),
    ],
)
def test_numeric(response: str, answer: object, expected: float) -> None:
    assert Numeric()("prompt", response, answer=answer) == expected


def test_numeric_key_tolerance_and_strict() -> None:
    assert Numeric(key="target")("p", "#### 5", target=5, answer=9) == 1.0
    assert Numeric(tolerance=0.01)("p", "3.14", answer=3.1) == 0.0
    assert Numeric(tolerance=0.05)("p", "3.14", answer=3.1) == 1.0
    assert Numeric()("p", "3.14", answer=3.1) == 0.0
    assert Numeric(strict=True)("p", "The answer is 5", answer=5) == 0.0
    assert Numeric(strict=True)("p", "#### 5", answer=5) == 1.0


def test_numeric_reference_errors_name_the_key() -> None:
    with pytest.raises(RewardInputError, match=r"metadata\['answer'\]"):
        Numeric()("p", "#### 5")
    with pytest.raises(RewardInputError, match="holds no number"):
        Numeric()("p", "#### 5", answer="five")
    with pytest.raises(RewardInputError, match="bool"):
        Numeric()("p", "#### 1", answer=True)


def test_exact_match() -> None:
    rule = ExactMatch()
    assert rule("p", "  Paris. ", answer="paris") == 1.0
    assert rule("p", "Paris, France", answer="paris") == 0.0
    assert rule("p", "new   york", answer="New York") == 1.0
    assert ExactMatch(case_sensitive=True)("p", "paris", answer="Paris") == 0.0
    assert ExactMatch(key="label")("p", "7", label=7) == 1.0
    with pytest.raises(RewardInputError, match="label"):
        ExactMatch(key="label")("p", "7", answer=7)
