"""The relevance rule: content words, stemming, recall and F1 overlap."""

from __future__ import annotations

import pytest

from rlfleet.reward.relevance import Relevance, content_words, stem


@pytest.mark.parametrize(
    ("word", "expected"),
    [
        ("cats", "cat"),
        ("boxes", "box"),
        ("cases", "case"),
        ("studies", "study"),
        ("running", "run"),
        ("jumped", "jump"),
        ("quickly", "quick"),
        ("class", "class"),
        ("bus", "bus"),
        ("analysis", "analysis"),
        ("falling", "fall"),
        ("sky", "sky"),
    ],
)
def test_stem(word: str, expected: str) -> None:
    assert stem(word) == expected


def test_content_words_drop_stopwords_instructions_and_possessives() -> None:
    got = content_words("Explain briefly why the sky's color is blue during the day, in 2 sentences.")
    assert got == {"sky", "color", "blue", "day", "2", "sentence"}
    assert content_words("What is it?") == set()
    assert content_words("Cats", use_stem=False) == {"cats"}


def test_relevance_recall() -> None:
    rule = Relevance()
    prompt = "Why is the sky blue during the day?"  # content: sky, blue, day
    assert rule(prompt, "Rayleigh scattering makes the sky blue.") == pytest.approx(2 / 3)
    assert rule(prompt, "The daytime sky is blue: short wavelengths scatter. Every day.") == pytest.approx(
        1.0
    )
    assert rule(prompt, "Bananas.") == 0.0
    assert rule(prompt, "") == 0.0


def test_relevance_stemming_matters() -> None:
    prompt = "How do cats chase boxes?"  # cat, chase, box
    response = "A cat chases a box."
    assert Relevance()(prompt, response) == pytest.approx(1.0)
    assert Relevance(stem=False)(prompt, response) == pytest.approx(0.0)


def test_relevance_f1_penalizes_padding() -> None:
    prompt = "Name the capital of France."  # name, capital, france
    short = "The capital of France is Paris."  # capital, france, paris
    padded = "The capital of France is Paris, a large old city with many museums."
    f1 = Relevance(mode="f1")
    # recall 2/3, precision 2/3 -> F1 2/3
    assert f1(prompt, short) == pytest.approx(2 / 3)
    assert f1(prompt, padded) < f1(prompt, short)
    assert Relevance()(prompt, padded) == Relevance()(prompt, short)


def test_relevance_prompt_without_content_words() -> None:
    assert Relevance()("What is it?", "Something.") == 1.0
    assert Relevance()("What is it?", "it is") == 0.0
