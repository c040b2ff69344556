"""The form rules (concise, length_penalty, keyword, regex, charset) against hand-picked inputs."""

from __future__ import annotations

import time

import pytest
from pydantic import ValidationError

from rlfleet.reward.rules import Charset, Concise, Keyword, LengthPenalty, Regex


def words(n: int) -> str:
    return " ".join(["w"] * n)


@pytest.mark.parametrize(
    ("n", "expected"),
    [(1, 1.0), (4, 1.0), (5, 0.75), (6, 0.5), (7, 0.25), (8, 0.0), (20, 0.0)],
)
def test_concise_linear_decay_reaches_zero_at_twice_max(n: int, expected: float) -> None:
    assert Concise(max_words=4)("prompt", words(n)) == pytest.approx(expected)


@pytest.mark.parametrize(("n", "expected"), [(4, 1.0), (5, 0.8), (8, 0.5), (40, 0.1)])
def test_concise_inverse_decay(n: int, expected: float) -> None:
    assert Concise(max_words=4, decay="inverse")("prompt", words(n)) == pytest.approx(expected)


@pytest.mark.parametrize("response", ["", "   ", "\n\t"])
def test_concise_empty_response_scores_zero(response: str) -> None:
    assert Concise(max_words=4)("prompt", response) == 0.0


def test_concise_counts_whitespace_separated_words() -> None:
    assert Concise(max_words=3)("p", "  one\ttwo\nthree  ") == 1.0
    assert Concise(max_words=3)("p", "one two three four") == pytest.approx(2 / 3)


def test_concise_rejects_bad_options() -> None:
    with pytest.raises(ValidationError):
        Concise(max_words=0)
    with pytest.raises(ValidationError):
        Concise(decay="cubic")
    with pytest.raises(ValidationError):
        Concise(max_word=3)


@pytest.mark.parametrize(
    ("n", "expected"),
    [(0, -1.0), (1, -0.75), (4, 0.0), (10, 0.0), (15, -0.5), (20, -1.0), (50, -1.0)],
)
def test_length_penalty(n: int, expected: float) -> None:
    rule = LengthPenalty(max_words=10, min_words=4)
    assert rule("p", words(n)) == pytest.approx(expected)


def test_length_penalty_scale_and_order() -> None:
    assert LengthPenalty(max_words=10, scale=0.5)("p", words(15)) == pytest.approx(-0.25)
    with pytest.raises(ValidationError, match="min_words"):
        LengthPenalty(max_words=3, min_words=5)


def test_keyword_any_all_fraction() -> None:
    response = "Paris is the capital of France."
    assert Keyword(keywords=["paris", "berlin"])("p", response) == 1.0
    assert Keyword(keywords=["rome", "berlin"])("p", response) == 0.0
    assert Keyword(keywords=["paris", "france"], mode="all")("p", response) == 1.0
    assert Keyword(keywords=["paris", "berlin"], mode="all")("p", response) == 0.0
    assert Keyword(keywords=["paris", "berlin", "capital", "x1"], mode="fraction")("p", response) == 0.5


def test_keyword_case_and_whole_word() -> None:
    assert Keyword(keywords=["paris"], case_sensitive=True)("p", "Paris") == 0.0
    assert Keyword(keywords=["Paris"], case_sensitive=True)("p", "Paris") == 1.0
    assert Keyword(keywords=["cat"])("p", "concatenate") == 1.0
    assert Keyword(keywords=["cat"], whole_word=True)("p", "concatenate") == 0.0
    assert Keyword(keywords=["cat"], whole_word=True)("p", "a cat.") == 1.0
    assert Keyword(keywords=["c++"], whole_word=True)("p", "I like c++ a lot") == 1.0


def test_keyword_pipe_string_form_and_validation() -> None:
    rule = Keyword(keywords="new york | paris")
    assert rule.keywords == ("new york", "paris")
    assert rule("p", "I live in New York") == 1.0
    with pytest.raises(ValidationError):
        Keyword(keywords=[])
    with pytest.raises(ValidationError):
        Keyword(keywords="a||b")


def test_regex_partial_and_full_match() -> None:
    assert Regex(pattern=r"\d+")("p", "the answer is 42") == 1.0
    assert Regex(pattern=r"\d+", full=True)("p", "the answer is 42") == 0.0
    assert Regex(pattern=r"\d+", full=True)("p", "  42\n") == 1.0
    assert Regex(pattern=r"\d+", full=True, strip=False)("p", "  42\n") == 0.0
    assert Regex(pattern=r"^<think>.*</think>", dotall=True)("p", "<think>a\nb</think> 4") == 1.0
    assert Regex(pattern=r"^<think>.*</think>")("p", "<think>a\nb</think> 4") == 0.0
    assert Regex(pattern="yes", ignore_case=True, full=True)("p", "YES") == 1.0
    assert Regex(pattern="^b$", multiline=True)("p", "a\nb\nc") == 1.0


def test_regex_rejects_invalid_pattern() -> None:
    with pytest.raises(ValidationError, match="not a valid regular expression"):
        Regex(pattern="(unclosed")


@pytest.mark.timeout(20)
def test_regex_runs_in_linear_time_on_a_catastrophic_pattern() -> None:
    """``(a+)+$`` on ``a...ab`` takes exponential time with Python's re (2**40 steps here); RE2 is linear."""
    start = time.perf_counter()
    assert Regex(pattern=r"(a+)+$")("p", "a" * 40 + "b") == 0.0
    assert Regex(pattern=r"(x+x+)+y", full=True)("p", "x" * 100_000) == 0.0
    assert time.perf_counter() - start < 5.0


@pytest.mark.parametrize("pattern", [r"(a)\1", r"(?=a)a", r"(?<!x)y"])
def test_regex_refuses_what_re2_cannot_match_in_linear_time(pattern: str) -> None:
    with pytest.raises(ValidationError, match="for RE2 .*no backreferences or lookaround"):
        Regex(pattern=pattern)


@pytest.mark.parametrize(
    ("response", "expected"),
    [("12345", 1.0), ("12 34", 1.0), ("12a4", 0.75), ("abc", 0.0), ("", 0.0), ("  ", 0.0), ("4.5", 2 / 3)],
)
def test_charset_fraction_of_non_space_characters(response: str, expected: float) -> None:
    assert Charset(allowed="0123456789")("p", response) == pytest.approx(expected)


def test_charset_case_folding() -> None:
    assert Charset(allowed="ab")("p", "AB") == 0.0
    assert Charset(allowed="ab", case_sensitive=False)("p", "AB") == 1.0
    with pytest.raises(ValidationError):
        Charset(allowed="")
