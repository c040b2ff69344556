"""RewardScaler math against hand-computed values, state round trips and scorers."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from rlfleet.reward.errors import NoScorer, NotPortable, RewardInputError, RewardModelError
from rlfleet.reward.registry import build_reward
from rlfleet.reward.scaler import RewardScaler, ScalerConfig


def test_identity_by_default() -> None:
    assert RewardScaler()([1, -3, 4.5]) == [1.0, -3.0, 4.5]
    assert RewardScaler()([]) == []


def test_temperature_divides() -> None:
    assert RewardScaler(temperature=2.0)([1, -3, 4]) == [0.5, -1.5, 2.0]


def test_clip_then_floor() -> None:
    assert RewardScaler(clip=1.0)([0.5, -3, 4]) == [0.5, -1.0, 1.0]
    assert RewardScaler(min_reward=-0.5)([1, -3, 4]) == [1.0, -0.5, 4.0]
    assert RewardScaler(clip=2.0, min_reward=-1.0)([3, -3, 0.5]) == [2.0, -1.0, 0.5]
    # temperature first: 4 / 2 = 2 is clipped to 1.5, -6 / 2 = -3 is clipped to -1.5 then floored to -1
    assert RewardScaler(temperature=2.0, clip=1.5, min_reward=-1.0)([4, -6, 1]) == [1.5, -1.0, 0.5]


def test_running_normalization_over_several_batches() -> None:
    scaler = RewardScaler(normalize=True, eps=1e-6)
    # batch 1: mean 2, population std sqrt(2/3)
    std1 = math.sqrt(2 / 3)
    assert scaler([1, 2, 3]) == pytest.approx([-1 / (std1 + 1e-6), 0.0, 1 / (std1 + 1e-6)])
    assert (scaler.count, scaler.mean, scaler.std) == (3, pytest.approx(2.0), pytest.approx(std1))
    # batch 2: the stats now cover 1..5: mean 3, std sqrt(2)
    assert scaler([4, 5]) == pytest.approx([1 / (math.sqrt(2) + 1e-6), 2 / (math.sqrt(2) + 1e-6)])
    # batch 3: 1..5 and 10: mean 25/6, variance 155/6 - (25/6)^2
    mean3 = 25 / 6
    std3 = math.sqrt(155 / 6 - mean3**2)
    assert scaler([10]) == pytest.approx([(10 - mean3) / (std3 + 1e-6)])
    assert (scaler.count, scaler.mean, scaler.std) == (6, pytest.approx(mean3), pytest.approx(std3))


def test_update_false_uses_the_stats_as_they_stand() -> None:
    scaler = RewardScaler(normalize=True)
    scaler([1, 2, 3])
    before = scaler.state_dict()
    assert scaler([2, 5], update=False) == pytest.approx([0.0, 3 / (math.sqrt(2 / 3) + 1e-6)])
    assert scaler.state_dict() == before
    with pytest.raises(RewardInputError, match="no running statistics"):
        RewardScaler(normalize=True)([1.0], update=False)


def test_normalization_sees_tempered_scores_and_is_clipped() -> None:
    scaler = RewardScaler(normalize=True, temperature=2.0, clip=1.0)
    assert scaler([2, 4, 6]) == pytest.approx([-1.0, 0.0, 1.0])  # +-1.22 before the clip
    assert scaler.mean == pytest.approx(2.0)


def test_first_score_normalizes_to_zero() -> None:
    assert RewardScaler(normalize=True)([7.0]) == [0.0]


def test_state_round_trip_continues_identically() -> None:
    a = RewardScaler(normalize=True)
    a([1, 2, 3, 10])
    state = json.loads(json.dumps(a.state_dict()))
    assert set(state) == {"count", "mean", "m2"}
    b = RewardScaler(normalize=True)
    b.load_state_dict(state)
    assert b([4, -2]) == a([4, -2])
    assert b.state_dict() == a.state_dict()
    b.reset()
    assert b.count == 0


@pytest.mark.parametrize(
    ("state", "field"),
    [
        ({"count": -1, "mean": 0.0, "m2": 0.0}, "count"),
        ({"count": 1, "mean": 0.0, "m2": -1.0}, "m2"),
        ({"count": 1, "mean": math.nan, "m2": 0.0}, "mean"),
        ({"count": 1, "mean": 0.0}, "m2"),
        ({"count": 1, "mean": 0.0, "m2": 0.0, "var": 1.0}, "var"),
    ],
)
def test_bad_state_is_refused(state: dict[str, float], field: str) -> None:
    scaler = RewardScaler(normalize=True)
    with pytest.raises(ValueError, match=field):
        scaler.load_state_dict(state)
    assert scaler.count == 0


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.0},
        {"temperature": math.inf},
        {"clip": -1.0},
        {"eps": 0.0},
        {"clip": 1.0, "min_reward": 2.0},
    ],
)
def test_bad_options_are_refused(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValidationError):
        RewardScaler(**kwargs)


def test_non_finite_scores_are_refused() -> None:
    with pytest.raises(RewardInputError, match="raw score 1 is nan"):
        RewardScaler(normalize=True)([1.0, math.nan])


def test_compute_reward_with_a_composite_reward() -> None:
    scaler = RewardScaler(fn=build_reward("2*numeric"), temperature=2.0)
    got = scaler.compute_reward(
        ["q", "q"], ["#### 3", "#### 4"], metadata_list=[{"answer": 3}, {"answer": 3}]
    )
    assert got == [1.0, 0.0]


def test_compute_reward_with_any_callable_and_wrap() -> None:
    def lengths(prompts: Sequence[str], responses: Sequence[str]) -> list[float]:
        return [float(len(r)) for r in responses]

    base = RewardScaler("rm/tiny", normalize=True)
    base([0.0, 2.0])
    wrapped = base.wrap(lengths)
    assert wrapped.model_name == "rm/tiny"
    assert wrapped.state_dict() == base.state_dict()
    # stats over 0, 2 (copied) and 0, 4: mean 1.5, variance (2.25 + 0.25 + 2.25 + 6.25) / 4 = 2.75
    std = math.sqrt(2.75)
    got = wrapped.compute_reward(["p"] * 2, ["", "abcd"])
    assert got == pytest.approx([-1.5 / (std + 1e-6), 2.5 / (std + 1e-6)])
    assert base.count == 2  # the original's stats are its own


def test_compute_reward_without_a_scorer_says_so() -> None:
    # without the models extra (scripts/isolated_tests.py's venv) a model is refused before its path is read
    missing = "no such directory" if importlib.util.find_spec("transformers") else r"rlfleet-reward\[models\]"
    with pytest.raises(RewardModelError, match=f"'rm/tiny': .*{missing}"):
        RewardScaler("rm/tiny").compute_reward(["p"], ["r"])
    with pytest.raises(NoScorer, match="pass model_name=<reward model directory>, or fn="):
        RewardScaler().compute_reward(["p"], ["r"])


def test_compute_reward_checks_the_scorer_length() -> None:
    scaler = RewardScaler(fn=lambda prompts, responses: [1.0])
    with pytest.raises(RewardInputError, match="returned 1 scores for 2 responses"):
        scaler.compute_reward(["p", "p"], ["a", "b"])


def test_from_config() -> None:
    cfg = ScalerConfig(temperature=4.0, clip=0.5)
    assert RewardScaler.from_config(cfg)([1.0, 8.0]) == [0.25, 0.5]


@settings(max_examples=50, deadline=None)
@given(
    values=st.lists(st.floats(min_value=-1e3, max_value=1e3), min_size=2, max_size=40),
    cuts=st.lists(st.integers(min_value=0, max_value=40), max_size=5),
)
def test_running_stats_match_pooled_stats_for_any_batching(values: list[float], cuts: list[int]) -> None:
    scaler = RewardScaler(normalize=True)
    bounds = [0, *sorted(c % (len(values) + 1) for c in cuts), len(values)]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        scaler(values[lo:hi])
    assert scaler.count == len(values)
    assert scaler.mean == pytest.approx(statistics.fmean(values), abs=1e-9)
    assert scaler.std == pytest.approx(statistics.pstdev(values), abs=1e-6)


def test_the_issue_example_temperature_then_floor() -> None:
    scaler = RewardScaler(temperature=0.7, min_reward=0.1)
    got = scaler([1.4, 0.07, -2.1, 0.0])
    assert got == pytest.approx([2.0, 0.1, 0.1, 0.1])  # 0.07 / 0.7 = 0.1 sits on the floor


def test_normalize_clip_and_floor_in_that_order() -> None:
    scaler = RewardScaler(temperature=2.0, normalize=True, clip=1.0, min_reward=-0.5, eps=1e-6)
    got = scaler([0.0, 4.0, 8.0])  # tempered 0, 2, 4: mean 2, std sqrt(8/3) = 1.63: z = -1.22, 0, 1.22
    std = math.sqrt(8 / 3) + 1e-6
    assert -2 / std < -1.0 and got == pytest.approx([-0.5, 0.0, 1.0])


def test_state_round_trips_through_json_and_continues_the_same_way() -> None:
    a = RewardScaler(normalize=True)
    a([1.0, 2.0, 3.0])
    b = RewardScaler(normalize=True)
    b.load_state_dict(json.loads(json.dumps(a.state_dict())))
    assert a([10.0, -4.0]) == b([10.0, -4.0])
    assert a.state_dict() == b.state_dict()


def test_model_name_loads_that_reward_model(make_tiny_rm) -> None:
    folder = make_tiny_rm(num_labels=1)
    raw = build_reward(f"rm:path={folder}").score(["p", "q"], ["a", "bb"]).total
    scaler = RewardScaler(model_name=str(folder), temperature=0.7, min_reward=0.1)
    assert scaler.compute_reward(["p", "q"], ["a", "bb"]) == pytest.approx([max(x / 0.7, 0.1) for x in raw])


def test_wire_form_describes_scorer_options_and_statistics(make_tiny_rm) -> None:
    scaler = RewardScaler(fn=build_reward("concise:max_words=5"), temperature=0.5, normalize=True)
    scaler([1.0, 3.0])
    wire = scaler.__rlfleet_reward__()
    assert build_reward(wire["spec"]).version == build_reward("concise:max_words=5").version
    assert ScalerConfig(**wire["scaler"]) == scaler.config
    assert wire["scaler_state"] == scaler.state_dict()
    folder = str(make_tiny_rm(num_labels=1))
    by_model = RewardScaler(model_name=folder).__rlfleet_reward__()
    assert by_model["spec"] == {"components": [{"name": "rm", "args": {"path": folder}}]}


def test_a_plain_callable_scorer_cannot_travel() -> None:
    with pytest.raises(NotPortable, match="plain callable"):
        RewardScaler(fn=lambda prompts, responses: [0.0] * len(responses)).__rlfleet_reward__()
