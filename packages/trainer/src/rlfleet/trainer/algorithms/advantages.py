"""Outcome advantages: one scalar reward per sample turned into one advantage per sample.

All estimators here take ``rewards`` (N,) and ``group_index`` (N,) (the prompt each sample
answers; any integer ids, not necessarily contiguous or sorted) and return advantages (N,) in
the rewards' floating dtype. :func:`broadcast_to_tokens` spreads them over the response tokens.

Statistics are computed per group with scatter-adds, so rows of one group need not be adjacent.
A singleton group has no baseline to compare with: GRPO and RLOO give it advantage 0.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


def _check_inputs(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Validate shapes and return ``rewards`` as a floating tensor."""
    if rewards.ndim != 1 or group_index.shape != rewards.shape:
        raise ValueError(
            f"rewards and group_index must both be (N,); got {tuple(rewards.shape)} and "
            f"{tuple(group_index.shape)}"
        )
    return rewards if rewards.is_floating_point() else rewards.float()


def group_stats(
    rewards: Tensor, group_index: Tensor, *, unbiased: bool = True
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sample group mean, std and size.

    Args:
        rewards: (N,) float.
        group_index: (N,) int, the group of each sample.
        unbiased: Bessel-corrected std (divide by n-1, as ``torch.std``); a singleton group gets std 0.

    Returns:
        mean (N,), std (N,), count (N,) float: the statistics of each sample's own group.
    """
    rewards = _check_inputs(rewards, group_index)
    _, inverse = torch.unique(group_index, return_inverse=True)
    num_groups = int(inverse.max().item()) + 1 if inverse.numel() else 0
    count = torch.zeros(num_groups, dtype=rewards.dtype, device=rewards.device)
    count.index_add_(0, inverse, torch.ones_like(rewards))
    total = torch.zeros_like(count).index_add_(0, inverse, rewards)
    mean = (total / count)[inverse]
    sq = torch.zeros_like(count).index_add_(0, inverse, (rewards - mean) ** 2)
    denom = (count - 1.0).clamp(min=1.0) if unbiased else count
    std = (sq / denom).sqrt()[inverse]
    return mean, std, count[inverse]


def grpo_advantages(
    rewards: Tensor,
    group_index: Tensor,
    *,
    norm_by_std: bool = True,
    eps: float = 1e-6,
    unbiased: bool = True,
) -> Tensor:
    """GRPO: ``(r - mean_group) / (std_group + eps)``; without ``norm_by_std`` (Dr. GRPO) ``r - mean_group``.

    Args:
        rewards: (N,) rewards.
        group_index: (N,) group of each sample.
        norm_by_std: divide by the group std (GRPO); False gives the Dr. GRPO variant.
        eps: added to the std, so a group of identical rewards gives exactly 0.
        unbiased: Bessel-corrected std, as verl and TRL use.

    Returns:
        (N,) advantages.
    """
    mean, std, _ = group_stats(rewards, group_index, unbiased=unbiased)
    centered = _check_inputs(rewards, group_index) - mean
    return centered / (std + eps) if norm_by_std else centered


def dr_grpo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Dr. GRPO: ``r - mean_group``, no std normalization. (N,) x (N,) -> (N,)."""
    return grpo_advantages(rewards, group_index, norm_by_std=False)


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
    centered = _check_inputs(rewards, group_index) - mean
    scale = torch.where(count > 1, count / (count - 1.0).clamp(min=1.0), torch.zeros_like(count))
    return centered * scale


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
    return _batch_whiten(_check_inputs(rewards, group_index), eps)


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
    return _batch_whiten(_check_inputs(rewards, group_index) - mean, eps)


def broadcast_to_tokens(advantages: Tensor, response_mask: Tensor) -> Tensor:
    """Spread per-sample advantages over the response tokens, zero at padding.

    Args:
        advantages: (N,) per sample, or (N, R) already per token (then only masked).
        response_mask: (N, R), 1 for real response tokens.

    Returns:
        (N, R) float advantages.
    """
    mask = response_mask.to(advantages.dtype if advantages.is_floating_point() else torch.float32)
    if advantages.ndim == 2:
        if advantages.shape != response_mask.shape:
            raise ValueError(
                f"token advantages {tuple(advantages.shape)} do not match response_mask "
                f"{tuple(response_mask.shape)}"
            )
        return advantages * mask
    if advantages.ndim != 1 or advantages.shape[0] != response_mask.shape[0]:
        raise ValueError(
            f"advantages must be (N,) or (N, R) with N = {response_mask.shape[0]}; "
            f"got {tuple(advantages.shape)}"
        )
    return advantages.unsqueeze(-1) * mask
