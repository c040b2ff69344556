"""build_reward: rule options, weighted scoring, component reports, versions and failures."""

from __future__ import annotations

import pytest

from rlfleet.reward.composite import CompositeReward, ScoreBatch
from rlfleet.reward.errors import (
    BadRewardArgument,
    RewardFunctionError,
    RewardInputError,
    RewardSpecError,
    UnknownReward,
    UnknownRewardArgument,
)
from rlfleet.reward.registry import RULES, build_reward, build_rule
from rlfleet.reward.rules import Concise


def test_every_registered_rule_builds_and_scores() -> None:
    required = {"length_penalty": {"max_words": 5}, "keyword": {"keywords": "x"}, "regex": {"pattern": "x"}}
    required["charset"] = {"allowed": "x"}
    for name, factory in RULES.items():
        rule = build_rule(name, required.get(name, {}))
        assert isinstance(rule, factory)
        assert isinstance(rule("What is x?", "x is 1", answer=1, episode_reward=0.5), float)


def test_the_episode_rule_scores_the_environment_s_reward_and_refuses_a_single_turn_sample() -> None:
    reward = build_reward("episode + 0.5*charset:allowed=0123456789")
    batch = reward.score(["p", "p"], ["12", "ab"], [{"episode_reward": 1.0}, {"episode_reward": 0.0}])
    assert batch.components["episode"] == [1.0, 0.0] and batch.total == pytest.approx([1.5, 0.0])
    with pytest.raises(RewardFunctionError, match="not an episode"):
        reward.score(["p"], ["12"], [{}])


def test_weighted_total_and_unweighted_components() -> None:
    reward = build_reward("0.7*concise:max_words=2 + 0.3*charset:allowed=0123456789")
    batch = reward.score(["p", "p", "p"], ["12", "1 2 3", "ab 12"])
    # concise: 1, (4-3)/2, (4-2)/2=1 ; charset: 1, 1, 0.5
    assert batch.components["concise"] == pytest.approx([1.0, 0.5, 1.0])
    assert batch.components["charset"] == pytest.approx([1.0, 1.0, 0.5])
    assert batch.total == pytest.approx([1.0, 0.7 * 0.5 + 0.3, 0.7 + 0.3 * 0.5])
    assert list(batch.components) == ["concise", "charset"]
    assert batch.version == reward.version


def test_metadata_reaches_the_rules() -> None:
    reward = build_reward("numeric + 0.5*exact_match:key=city")
    batch = reward.score(
        ["q1", "q2"],
        ["#### 1,000", "paris"],
        [{"answer": 1000, "city": "Rome"}, {"answer": "7", "city": "Paris"}],
    )
    assert batch.components == {"numeric": [1.0, 0.0], "exact_match": [0.0, 1.0]}
    assert batch.total == [1.0, 0.5]


def test_repeated_rules_get_numbered_labels_unless_labelled() -> None:
    reward = build_reward("keyword:keywords=a + keyword:keywords=b")
    assert list(reward.score(["p"], ["a"]).components) == ["keyword#1", "keyword#2"]
    labelled = build_reward(
        {
            "components": [
                {"name": "keyword", "args": {"keywords": "a"}, "label": "has_a"},
                {"name": "concise"},
            ]
        }
    )
    assert list(labelled.score(["p"], ["a"]).components) == ["has_a", "concise"]
    with pytest.raises(RewardSpecError, match="labels clash"):
        build_reward({"components": [{"name": "concise", "label": "x"}, {"name": "relevance", "label": "x"}]})


def test_version_hashes_the_normalized_spec() -> None:
    assert build_reward("concise").version == build_reward("1.0*concise:max_words=50,decay=linear").version
    assert build_reward("charset:allowed=123").version == build_reward("charset:allowed='123'").version
    assert build_reward("concise").version != build_reward("concise:max_words=49").version
    assert build_reward("concise", revision=4).version.endswith("-r4")
    reward = build_reward("0.5*concise:max_words=5")
    assert reward.spec.components[0].args == {"max_words": 5, "decay": "linear"}
    assert build_reward(str(reward.spec)).version == reward.version


def test_score_one_and_call_alias() -> None:
    reward = build_reward("0.5*concise:max_words=1 + charset:allowed=ab")
    assert reward.score_one("p", "ab") == pytest.approx(1.5)
    assert isinstance(reward(["p"], ["ab"]), ScoreBatch)
    assert isinstance(reward, CompositeReward)


def test_input_length_mismatches_are_refused() -> None:
    reward = build_reward("concise")
    with pytest.raises(RewardInputError, match="2 prompts for 1 responses"):
        reward.score(["a", "b"], ["x"])
    with pytest.raises(RewardInputError, match="1 metadata entries for 2 responses"):
        reward.score(["a", "b"], ["x", "y"], [{}])
    assert reward.score([], []).total == []


def test_a_rule_failing_on_one_sample_names_it() -> None:
    reward = build_reward("concise + numeric")
    with pytest.raises(RewardFunctionError, match=r"'numeric' failed on sample 1: RewardInputError") as info:
        reward.score(["p", "p"], ["#### 1", "#### 2"], [{"answer": 1}, {}])
    assert info.value.index == 1
    assert isinstance(info.value.__cause__, RewardInputError)


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        ("concise:max_wordz=5", UnknownRewardArgument, "takes no argument 'max_wordz'.*decay, max_words"),
        ("concise:max_words=0", BadRewardArgument, "max_words=0 is invalid"),
        ("concise:max_words=many", BadRewardArgument, "max_words='many'"),
        ("concise:decay=cubic", BadRewardArgument, "decay='cubic'"),
        ("regex:pattern='('", BadRewardArgument, "not a valid regular expression"),
        ("length_penalty:max_words=3,min_words=4", BadRewardArgument, "min_words"),
        ("keyword:mode=all", BadRewardArgument, "needs the argument 'keywords'"),
        ("regex", BadRewardArgument, "'pattern'"),
        ("nosuchrule", UnknownReward, "unknown reward 'nosuchrule'"),
    ],
)
def test_build_errors_name_the_rule_and_argument(spec: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        build_reward(spec)


def test_build_rule_is_the_registered_class() -> None:
    assert build_rule("concise", {"max_words": 3}) == Concise(max_words=3)
