"""The waste a step reports (issue 31): groups whose rewards are all equal carry no group-relative
signal, and the share of the generated tokens they took."""

from __future__ import annotations

import torch


def test_groups_whose_rewards_are_all_equal_are_counted_with_their_tokens() -> None:
    from rlfleet.trainer.service import group_signal_metrics

    mask = torch.tensor([[1, 1, 0], [1, 0, 0], [1, 1, 1], [1, 1, 1], [1, 0, 0], [1, 1, 0]])
    batch = {"group_index": torch.tensor([0, 0, 1, 1, 2, 2]), "response_mask": mask}
    metrics = group_signal_metrics(batch, torch.tensor([1.0, 1.0, 0.0, 0.5, 0.0, 0.0]))  # groups 0, 2 flat
    assert metrics == {"groups/total": 3.0, "groups/flat": 2.0, "groups/wasted_token_frac": 6 / 12}
