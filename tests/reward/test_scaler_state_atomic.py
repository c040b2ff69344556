"""A RewardScaler's statistics change all or nothing (issue 29, point 4): a state that is not whole
and consistent, or a batch that would overflow the running statistics, leaves them as they were."""

from __future__ import annotations

import pytest

from rlfleet.reward.errors import RewardInputError
from rlfleet.reward.scaler import RewardScaler


def _scaler() -> RewardScaler:
    scaler = RewardScaler(normalize=True)
    scaler([1.0, 2.0, 4.0])
    return scaler


@pytest.mark.parametrize(
    "state",
    [
        {"count": 0, "mean": 5.0, "m2": 3.0},  # statistics of no scores at all
        {"count": 1, "mean": 2.0, "m2": 9.0},  # one score has no spread
        {"count": 4, "mean": 1.0},  # a part of a state
        {"count": 4, "mean": float("nan"), "m2": 1.0},
        {"count": -1, "mean": 0.0, "m2": 0.0},
    ],
)
def test_a_bad_state_leaves_the_statistics_as_they_were(state: dict[str, float]) -> None:
    scaler = _scaler()
    before = scaler.state_dict()
    with pytest.raises(ValueError):  # noqa: PT011 (pydantic's ValidationError names the field)
        scaler.load_state_dict(state)
    assert scaler.state_dict() == before


def test_a_batch_that_would_overflow_the_statistics_leaves_them_as_they_were() -> None:
    scaler = _scaler()
    before = scaler.state_dict()
    with pytest.raises(RewardInputError, match="non-finite"):
        scaler([1e308, -1e308, 1e308])  # each finite, their deviations are not
    assert scaler.state_dict() == before


def test_the_scaler_keeps_working_after_a_refused_batch() -> None:
    scaler, twin = _scaler(), _scaler()
    with pytest.raises(RewardInputError):
        scaler([1e308, -1e308])
    assert scaler([3.0, 5.0]) == twin([3.0, 5.0])
    assert scaler.state_dict() == twin.state_dict()
