"""The ``rm`` component: a tiny BERT sequence classifier built in the test, scored through specs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

# Reward models come with the models extra; the rules-only install (scripts/isolated_tests.py) skips these.
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers", reason="rlfleet-reward[models] is not installed")

from rlfleet.reward import build_reward  # noqa: E402
from rlfleet.reward.errors import RewardFunctionError, RewardModelError, UnknownRewardArgument  # noqa: E402
from rlfleet.reward.loading import loaded_count  # noqa: E402

AutoModelForSequenceClassification = transformers.AutoModelForSequenceClassification
AutoTokenizer = transformers.AutoTokenizer

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["What is 2+2?", "Name a color.", "Say hi", "Count to three, please"]
RESPONSES = ["4", "Blue is a color I like very much.", "hi!", "one two three"]


def reference_logits(folder: Path, prompts: list[str], responses: list[str]) -> torch.Tensor:
    """(N, num_labels) logits, one unpadded sample at a time: what batching must reproduce."""
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    rows = []
    with torch.inference_mode():
        for p, r in zip(prompts, responses, strict=True):
            rows.append(model(**tok(p, r, return_tensors="pt")).logits[0])
    return torch.stack(rows)


def test_single_output_model_scores_like_one_sample_at_a_time(make_tiny_rm: Callable[..., Path]) -> None:
    folder = make_tiny_rm(num_labels=1)
    reward = build_reward(f"rm:path={folder},batch_size=3,device=cpu")
    batch = reward.score(PROMPTS, RESPONSES)
    expected = reference_logits(folder, PROMPTS, RESPONSES)[:, 0].tolist()
    assert batch.total == pytest.approx(expected, abs=1e-5)
    assert batch.components["rm"] == batch.total
    assert len(set(batch.total)) == len(PROMPTS), "a random model gives every sample its own score"


def test_label_by_index_or_name_picks_that_logit(make_tiny_rm: Callable[..., Path]) -> None:
    folder = make_tiny_rm(num_labels=3)
    expected = reference_logits(folder, PROMPTS, RESPONSES)
    by_index = build_reward(f"rm:path={folder},label=2").score(PROMPTS, RESPONSES).total
    by_name = build_reward(f"rm:path={folder},label=label1").score(PROMPTS, RESPONSES).total
    assert by_index == pytest.approx(expected[:, 2].tolist(), abs=1e-5)
    assert by_name == pytest.approx(expected[:, 1].tolist(), abs=1e-5)


def test_input_format_changes_what_the_model_reads(make_tiny_rm: Callable[..., Path]) -> None:
    folder = make_tiny_rm(num_labels=1)
    pair = build_reward(f"rm:path={folder},input=pair").score(PROMPTS, RESPONSES).total
    alone = build_reward(f"rm:path={folder},input=response").score(PROMPTS, RESPONSES).total
    assert pair != pytest.approx(alone)
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForSequenceClassification.from_pretrained(folder).eval()
    with torch.inference_mode():
        first = model(**tok(RESPONSES[0], return_tensors="pt")).logits[0, 0].item()
    assert alone[0] == pytest.approx(first, abs=1e-5)


def test_max_length_cuts_long_inputs(make_tiny_rm: Callable[..., Path]) -> None:
    folder = make_tiny_rm(num_labels=1)
    long = ["x" * 500]
    cut = build_reward(f"rm:path={folder},max_length=16,input=response").score(["p"], long).total
    same = build_reward(f"rm:path={folder},max_length=16,input=response").score(["p"], ["x" * 14]).total
    assert cut == pytest.approx(same, abs=1e-5), "16 tokens = [CLS] + 14 characters + [SEP]"


def test_weighted_with_a_rule_each_component_reported(make_tiny_rm: Callable[..., Path]) -> None:
    folder = make_tiny_rm(num_labels=1)
    reward = build_reward(f"0.5*rm:path={folder} + 2*concise:max_words=3")
    batch = reward.score(PROMPTS, RESPONSES)
    assert set(batch.components) == {"rm", "concise"}
    for i in range(len(PROMPTS)):
        expected = 0.5 * batch.components["rm"][i] + 2 * batch.components["concise"][i]
        assert batch.total[i] == pytest.approx(expected)
    assert reward.spec.components[0].args["max_length"] == 512, "defaults are filled into the version"


def test_components_on_one_model_share_it(make_tiny_rm: Callable[..., Path]) -> None:
    folder = make_tiny_rm(num_labels=3, seed=1)
    before = loaded_count()
    reward = build_reward(
        {"components": [{"name": "rm", "args": {"path": str(folder), "label": 0}, "label": "a"},
                        {"name": "rm", "args": {"path": str(folder), "label": 1}, "label": "b"}]}
    )  # fmt: skip
    assert loaded_count() == before + 1
    fns = [c.fn for c in reward.components]
    assert fns[0].loaded is fns[1].loaded  # type: ignore[union-attr]
    assert set(reward.score(PROMPTS, RESPONSES).components) == {"a", "b"}


def test_model_mistakes_fail_at_build_time(make_tiny_rm: Callable[..., Path], tmp_path: Path) -> None:
    two = make_tiny_rm(num_labels=3)
    with pytest.raises(RewardModelError, match="3 outputs"):
        build_reward(f"rm:path={two}")
    with pytest.raises(RewardModelError, match="out of range"):
        build_reward(f"rm:path={two},label=7")
    with pytest.raises(RewardModelError, match="no label 'good'"):
        build_reward(f"rm:path={two},label=good")
    with pytest.raises(RewardModelError, match="no such directory"):
        build_reward(f"rm:path={tmp_path / 'nope'}")
    with pytest.raises(RewardModelError, match="no config.json"):
        build_reward(f"rm:path={tmp_path}")
    with pytest.raises(UnknownRewardArgument, match="takes no argument 'temperature'"):
        build_reward(f"rm:path={two},temperature=2")


def test_a_failing_model_names_the_component(make_tiny_rm: Callable[..., Path]) -> None:
    folder = make_tiny_rm(num_labels=1)
    reward = build_reward(f"rm:path={folder},max_length=512")  # the model only has 128 positions
    with pytest.raises(RewardFunctionError, match="reward 'rm' failed on the batch: "):
        reward.score(["p"], ["x" * 300])
