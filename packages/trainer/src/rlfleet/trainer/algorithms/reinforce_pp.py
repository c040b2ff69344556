"""REINFORCE++: batch-whitened returns without a critic, on GRPO's clipped loss and step.

REINFORCE++ (Hu, 2025, "REINFORCE++: A Simple and Efficient Approach for Aligning Large Language
Models"; OpenRLHF's ``reinforce_plus_plus``, verl's ``reinforce_plus_plus``) needs no group and no
critic: its baseline is the batch. With the KL in the reward (its default), the token rewards are
the score on the last real token minus ``kl_coef * kl_t`` on every token, and the advantages are
their discounted returns whitened over every real token of the batch::

    r_t = -kl_coef * kl_t (+ score on the last token)      G_t = sum_{k >= t} gamma^(k-t) r_k
    A_t = (G_t - mean(G)) / std(G)                         (over the batch's real tokens)

With the KL in the loss, the scores are whitened over the batch, one value per sample (verl whitens
token-level returns, which weighs a sample by its response length; this whitens per sample). The
loss and the step are GRPO's (:mod:`rlfleet.trainer.algorithms.grpo`).
:func:`reinforce_pp_baseline_advantages` is the REINFORCE++-baseline variant (the group mean
subtracted first), kept as a function; no algorithm name selects it.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from rlfleet.common.schema.trainer import StepSettings
from rlfleet.trainer.algorithms.grpo import (
    GRPO,
    TokenAdvantages,
    check_rewards,
    discounted_returns,
    group_stats,
    masked_whiten,
    reward_kl,
    token_level_rewards,
)

logger = logging.getLogger(__name__)


def _batch_whiten(values: Tensor, eps: float) -> Tensor:
    """(N,) -> (N,): subtract the batch mean and divide by the batch std (unbiased; 0 for N=1)."""
    if values.numel() < 2:
        return values - values.mean()
    return (values - values.mean()) / (values.std() + eps)


def reinforce_pp_advantages(rewards: Tensor, group_index: Tensor, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++ (outcome reward, gamma = 1): rewards whitened over the whole batch.

    ``group_index`` is accepted for a uniform signature and ignored. verl whitens token-level
    returns, which weighs a sample by its response length; this whitens per sample.

    Args:
        rewards: (N,) rewards.
        group_index: (N,) unused.
        eps: added to the batch std.

    Returns:
        (N,) advantages.
    """
    return _batch_whiten(check_rewards(rewards, group_index), eps)


def reinforce_pp_baseline_advantages(rewards: Tensor, group_index: Tensor, *, eps: float = 1e-6) -> Tensor:
    """REINFORCE++-baseline: subtract the group mean, then whiten over the whole batch.

    Args:
        rewards: (N,) rewards.
        group_index: (N,) group of each sample.
        eps: added to the batch std.

    Returns:
        (N,) advantages.
    """
    mean, _, _ = group_stats(rewards, group_index)
    return _batch_whiten(check_rewards(rewards, group_index) - mean, eps)


class ReinforcePP(GRPO):
    """REINFORCE++'s step: GRPO's with batch-whitened advantages (token returns with the KL in the reward)."""

    def advantages(self, scores: Tensor, group_index: Tensor) -> Tensor:
        """Scores (N,) whitened over the batch -> (N,); ``group_index`` is not used."""
        return reinforce_pp_advantages(scores, group_index)

    @torch.no_grad()
    def token_advantages(
        self, scores: Tensor, group_index: Tensor, response_mask: Tensor, settings: StepSettings,
        *, kl: Tensor | None = None,
    ) -> TokenAdvantages:  # fmt: skip
        """Advantages (N, R): with the KL in the reward the whitened discounted returns of the token
        rewards (``kl``, (N, R), needed when ``kl_coef > 0``), else the whitened scores on every token."""
        if settings.algorithm.resolved_kl_mode() != "reward":
            return super().token_advantages(scores, group_index, response_mask, settings)
        kl, coef = reward_kl(kl, settings)
        rewards = token_level_rewards(scores.float(), response_mask, kl=kl, kl_coef=coef)
        returns = discounted_returns(rewards, response_mask, gamma=settings.algorithm.gamma)
        return TokenAdvantages(masked_whiten(returns, response_mask).float(), None, rewards)
