"""Python rewards: how a callable's signature says how it is called, and what it must give back."""

from __future__ import annotations

import functools
from typing import Any

import pytest

from rlfleet.controller.errors import RewardFnFailed
from rlfleet.controller.python_reward import PythonReward, is_python_reward

PROMPTS = ["2+2?", "3+4?"]
RESPONSES = ["4", "seven"]
ROWS: list[dict[str, Any]] = [{"answer": "4", "level": 1}, {"answer": "7"}]


def by_prompt_and_response(prompt: str, response: str, answer: str) -> float:
    return float(response == answer) + len(prompt) / 100


class Judge:
    def __call__(self, text: str) -> float:
        return len(text) / 10


def test_per_sample_signatures() -> None:
    lam = PythonReward(lambda text: len(text))
    assert lam.style == "text" and lam(PROMPTS, RESPONSES, ROWS) == [1.0, 5.0]
    named = PythonReward(by_prompt_and_response)  # gets the one field it names, not 'level'
    assert named.style == "sample" and named(PROMPTS, RESPONSES, ROWS) == [1.04, 0.04]
    assert PythonReward(Judge())(PROMPTS, RESPONSES, ROWS) == [0.1, 0.5]
    weighted = PythonReward(functools.partial(lambda text, scale: scale * len(text), scale=2.0))
    assert weighted.style == "text" and weighted(PROMPTS, RESPONSES, ROWS) == [2.0, 10.0]
    seen: list[dict[str, Any]] = []
    PythonReward(lambda prompt, response, **meta: seen.append(meta) or 0.0)(PROMPTS, RESPONSES, ROWS)
    assert seen == ROWS, "with **metadata every field of the row"
    assert PythonReward(lambda text: text.startswith("4"))(PROMPTS, RESPONSES, ROWS) == [1.0, 0.0]


def test_batched_signatures_trl_and_positional() -> None:
    calls: list[dict[str, Any]] = []

    def trl(prompts: list[str], completions: list[str], **kwargs: Any) -> list[float]:
        calls.append({"prompts": prompts, **kwargs})
        return [float(len(c)) for c in completions]

    def trl_named(completions: list[str], answer: list[str]) -> list[float]:
        return [float(c == a) for c, a in zip(completions, answer, strict=True)]

    assert PythonReward(trl)(PROMPTS, RESPONSES, ROWS) == [1.0, 5.0]
    assert calls == [{"prompts": PROMPTS, "answer": ["4", "7"], "level": [1, None]}], "columns as TRL gives"
    assert PythonReward(trl_named).style == "trl"
    assert PythonReward(trl_named)(PROMPTS, RESPONSES, ROWS) == [1.0, 0.0]

    def batch(prompts: list[str], responses: list[str], **kw: Any) -> list[int]:
        assert kw == {}, "the positional form gets only the fields it names"
        return [len(r) for r in responses]

    positional = PythonReward(batch)
    assert positional.style == "batch" and positional(PROMPTS, RESPONSES, ROWS) == [1.0, 5.0]


def test_callables_are_python_rewards_and_specs_are_not() -> None:
    assert is_python_reward(lambda t: 0.0) and not is_python_reward("concise") and not is_python_reward({})


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (lambda text: 1 / 0, r"\.<lambda> raised ZeroDivisionError: division by zero \(sample 0\)"),
        (lambda text: None, "returned None for sample 0; a reward is a number"),
        (lambda text: "1.0", "returned '1.0' for sample 0"),
        (lambda text: float("nan"), "returned nan for sample 0; rewards must be finite"),
        (lambda text: [1.0], "returned a list for sample 0"),
        (lambda prompts, completions: [1.0], "returned 1 scores for 2 responses"),
        (lambda prompts, completions: 3.0, "returned a float; a batched reward function returns a list of 2"),
    ],
)
def test_a_bad_function_is_a_clear_error_naming_it(fn: Any, message: str) -> None:
    with pytest.raises(RewardFnFailed, match=message) as caught:
        PythonReward(fn)(PROMPTS, RESPONSES, ROWS)
    assert caught.value.name.endswith("test_python_reward.<lambda>")
    assert str(caught.value).startswith(f"reward function {caught.value.name} ")
