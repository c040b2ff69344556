"""RLOO: REINFORCE with a leave-one-out baseline, on GRPO's clipped loss and step.

RLOO (Kool et al., 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!"; Ahmadian et al.,
2024, "Back to Basics") samples every prompt n times and compares each sample with the mean of the
*other* n - 1, which keeps the baseline independent of the sample it judges::

    A_i = r_i - (sum_g r - r_i) / (n_g - 1) = n_g / (n_g - 1) * (r_i - mean_g r)      (a group of one: 0)

on every response token. The KL goes into the reward by default (OpenRLHF, verl): each token then
adds its discounted future KL penalty, as :class:`~rlfleet.trainer.algorithms.grpo.GRPO` does. The
loss and the step are GRPO's (:mod:`rlfleet.trainer.algorithms.grpo`): the clipped surrogate, which
on the first, on-policy pass is REINFORCE's gradient.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from rlfleet.trainer.algorithms.grpo import GRPO, check_rewards, group_stats

logger = logging.getLogger(__name__)


def rloo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """RLOO: each sample's reward minus the mean reward of the *other* samples of its group.

    ``A_i = r_i - (sum_g - r_i) / (n_g - 1) = n_g / (n_g - 1) * (r_i - mean_g)``; 0 for a singleton group.

    Args:
        rewards: (N,) rewards.
        group_index: (N,) group of each sample.

    Returns:
        (N,) advantages.
    """
    mean, _, count = group_stats(rewards, group_index)
    centered = check_rewards(rewards, group_index) - mean
    scale = torch.where(count > 1, count / (count - 1.0).clamp(min=1.0), torch.zeros_like(count))
    return centered * scale


class RLOO(GRPO):
    """RLOO's step: GRPO's with leave-one-out advantages."""

    def advantages(self, scores: Tensor, group_index: Tensor) -> Tensor:
        """Leave-one-out advantages: scores (N,), the prompt of each (N,) -> (N,)."""
        return rloo_advantages(scores, group_index)
