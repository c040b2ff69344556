"""The trainer's account of each token's weight version (``response_versions``, partial rollouts):
staleness against the version it trains, and the share of samples sampled by several versions."""

from __future__ import annotations

import pytest
import torch

from rlfleet.trainer.service import token_version_metrics


def test_token_staleness_and_mixed_samples_from_the_recorded_versions() -> None:
    batch = {
        "response_versions": torch.tensor([[4, 4, 5, -1], [5, 5, 5, 5], [3, 5, -1, -1], [-1, -1, -1, -1]]),
        "response_mask": torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 0, 0]]),
    }
    metrics = token_version_metrics(batch, trained_at=5)
    # known tokens: 4,4,5 | 5,5,5,5 | 3,5 -> staleness 1,1,0,0,0,0,0,2,0; the last row is unknown
    assert metrics["rollout/token_staleness_max"] == 2.0
    assert metrics["rollout/token_staleness_mean"] == pytest.approx(4 / 9)
    assert metrics["rollout/mixed_version_frac"] == pytest.approx(2 / 3)  # rows 0 and 2 of 3 known


def test_no_versions_no_metrics() -> None:
    mask = torch.ones(2, 3, dtype=torch.int64)
    assert token_version_metrics({"response_mask": mask}, 1) == {}
    unknown = {"response_mask": mask, "response_versions": torch.full((2, 3), -1)}
    assert token_version_metrics(unknown, 1) == {}
