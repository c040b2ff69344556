"""Advantage estimators against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.trainer.algorithms import TRAINER_ALGORITHMS
from rlfleet.trainer.algorithms.dr_grpo import dr_grpo_advantages
from rlfleet.trainer.algorithms.grpo import broadcast_to_tokens, grpo_advantages
from rlfleet.trainer.algorithms.reinforce_pp import reinforce_pp_advantages, reinforce_pp_baseline_advantages
from rlfleet.trainer.algorithms.rloo import rloo_advantages

OUTCOME = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
}
"""The algorithms with one outcome advantage per sample, and their estimators."""


def test_grpo_normalizes_per_group_and_zeroes_identical_groups() -> None:
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 2.0])
    groups = torch.tensor([0, 0, 1, 1, 2, 2, 2])
    adv = grpo_advantages(rewards, groups, eps=1e-12)
    half = 0.5 / math.sqrt(0.5)  # group 0: mean 0.5, unbiased std sqrt(0.5)
    expected = torch.tensor([half, -half, 0.0, 0.0, -1.0, 0.0, 1.0])  # group 2: mean 1, std 1
    torch.testing.assert_close(adv, expected)


def test_grpo_groups_need_not_be_adjacent_nor_contiguous() -> None:
    rewards = torch.tensor([0.0, 5.0, 2.0, 5.0, 1.0])
    groups = torch.tensor([7, 3, 7, 3, 7])
    adv = grpo_advantages(rewards, groups, eps=1e-12)
    torch.testing.assert_close(adv, torch.tensor([-1.0, 0.0, 1.0, 0.0, 0.0]))


def test_grpo_without_std_is_dr_grpo_and_singleton_is_zero() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 9.0])
    groups = torch.tensor([0, 0, 0, 1])
    expected = torch.tensor([-1.0, 0.0, 1.0, 0.0])
    torch.testing.assert_close(grpo_advantages(rewards, groups, norm_by_std=False), expected)
    torch.testing.assert_close(dr_grpo_advantages(rewards, groups), expected)
    assert grpo_advantages(rewards, groups)[3].item() == 0.0


def test_grpo_eps_and_biased_std() -> None:
    rewards = torch.tensor([0.0, 2.0])
    groups = torch.tensor([0, 0])
    # biased std of [0, 2] is 1; unbiased is sqrt(2)
    torch.testing.assert_close(
        grpo_advantages(rewards, groups, unbiased=False, eps=1.0), torch.tensor([-0.5, 0.5])
    )
    s2 = math.sqrt(2.0)
    torch.testing.assert_close(grpo_advantages(rewards, groups, eps=0.0), torch.tensor([-1 / s2, 1 / s2]))


def test_grpo_accepts_integer_rewards() -> None:
    adv = grpo_advantages(torch.tensor([0, 2]), torch.tensor([0, 0]), eps=0.0)
    assert adv.dtype == torch.float32


def test_rloo_subtracts_mean_of_the_others() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 4.0])
    groups = torch.tensor([0, 0, 0, 1])
    # 0 - (1+2)/2, 1 - (0+2)/2, 2 - (0+1)/2; singleton -> 0
    torch.testing.assert_close(rloo_advantages(rewards, groups), torch.tensor([-1.5, 0.0, 1.5, 0.0]))


def test_reinforce_pp_whitens_over_the_batch() -> None:
    rewards = torch.tensor([0.0, 1.0, 2.0, 3.0])
    std = math.sqrt(5.0 / 3.0)
    expected = torch.tensor([-1.5, -0.5, 0.5, 1.5]) / std
    adv = reinforce_pp_advantages(rewards, torch.tensor([0, 0, 1, 1]), eps=0.0)
    torch.testing.assert_close(adv, expected)


def test_reinforce_pp_baseline_subtracts_group_mean_then_whitens() -> None:
    rewards = torch.tensor([0.0, 2.0, 1.0, 5.0])
    groups = torch.tensor([0, 0, 1, 1])
    std = math.sqrt(10.0 / 3.0)  # centered [-1, 1, -2, 2]
    expected = torch.tensor([-1.0, 1.0, -2.0, 2.0]) / std
    torch.testing.assert_close(reinforce_pp_baseline_advantages(rewards, groups, eps=0.0), expected)


def test_shape_mismatch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"\(N,\)"):
        grpo_advantages(torch.zeros(3), torch.zeros(4, dtype=torch.int64))


def test_broadcast_to_tokens_masks_padding() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    out = broadcast_to_tokens(torch.tensor([2.0, -1.0]), mask)
    torch.testing.assert_close(out, torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]]))
    per_token = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    torch.testing.assert_close(
        broadcast_to_tokens(per_token, mask), torch.tensor([[1.0, 2.0, 0.0], [4.0, 0.0, 0.0]])
    )
    with pytest.raises(ValueError):
        broadcast_to_tokens(torch.zeros(3), mask)


def test_every_estimator_has_one_signature_and_each_algorithm_uses_its_own() -> None:
    rewards = torch.tensor([0.0, 1.0, 3.0, 3.0])
    groups = torch.tensor([0, 0, 1, 1])
    assert {
        name for name, algorithm in TRAINER_ALGORITHMS.items() if hasattr(algorithm, "advantages")
    } == set(OUTCOME)
    for name, fn in [*OUTCOME.items(), ("reinforce_pp_baseline", reinforce_pp_baseline_advantages)]:
        adv = fn(rewards, groups)
        assert adv.shape == (4,), name
        assert torch.isfinite(adv).all(), name
    for name, fn in OUTCOME.items():
        torch.testing.assert_close(TRAINER_ALGORITHMS[name].advantages(rewards, groups), fn(rewards, groups))
