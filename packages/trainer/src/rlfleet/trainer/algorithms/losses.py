"""Policy-gradient loss terms: the PPO clipped surrogate, its health metrics, and entropy.

Every function is elementwise over tokens and returns (N, R) tensors; reduce them with
:func:`rlfleet.trainer.algorithms.aggregation.aggregate` so that the loss and its metrics share
one mask and one aggregation mode.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from rlfleet.trainer.algorithms.aggregation import aggregate, masked_mean
from rlfleet.trainer.algorithms.kl import kl_k3

logger = logging.getLogger(__name__)


def ppo_clip_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    clip_ratio_c: float | None = None,
) -> tuple[Tensor, Tensor]:
    """Per-token PPO clipped surrogate loss.

    ``ratio = exp(logp - old_logp)``; ``loss = -min(ratio * A, clip(ratio, 1 - eps_low, 1 + eps_high) * A)``.
    With ``clip_ratio_c`` (dual-clip PPO, > 1) the loss of a negative-advantage token is further
    capped at ``-A * clip_ratio_c``, so a very large ratio cannot blow the update up.

    Args:
        logprobs: (N, R) log-probs of the sampled tokens under the current policy (with grad).
        old_logprobs: (N, R) the same under the policy that sampled (no grad).
        advantages: (N, R) per-token advantages.
        clip_eps_low: lower clip range.
        clip_eps_high: upper clip range; defaults to ``clip_eps_low`` (DAPO's clip-higher sets it larger).
        clip_ratio_c: dual-clip constant, or None.

    Returns:
        loss (N, R) per token, and clipped (N, R) float: 1 where the clipped branch was chosen
        (its value exceeds the unclipped one, so the token gives no gradient).
    """
    high = clip_eps_low if clip_eps_high is None else clip_eps_high
    log_ratio = logprobs - old_logprobs
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_eps_low, 1.0 + high)
    loss = torch.maximum(unclipped, clipped)
    is_clipped = (clipped > unclipped).to(logprobs.dtype)
    if clip_ratio_c is not None:
        if clip_ratio_c <= 1.0:
            raise ValueError(f"clip_ratio_c must be > 1 for dual-clip PPO; got {clip_ratio_c}")
        capped = torch.minimum(loss, -advantages * clip_ratio_c)
        loss = torch.where(advantages < 0, capped, loss)
    return loss, is_clipped


def approx_kl(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(old || new) on tokens sampled from old: ``(r - 1) - log r``.

    Args:
        logprobs: (N, R) current policy.
        old_logprobs: (N, R) sampling policy.

    Returns:
        (N, R) non-negative values; their masked mean is PPO's ``approx_kl`` metric.
    """
    return kl_k3(old_logprobs, logprobs)


def entropy_from_logits(logits: Tensor) -> Tensor:
    """Entropy of the softmax distribution over the last dim: (..., V) -> (...).

    ``H = logsumexp(z) - sum(softmax(z) * z)``, computed in float32 (no (…, V) log-softmax kept).
    """
    z = logits.float()
    return torch.logsumexp(z, dim=-1) - (torch.softmax(z, dim=-1) * z).sum(dim=-1)


def masked_entropy(logits: Tensor, mask: Tensor) -> Tensor:
    """Mean entropy over the real tokens: logits (N, R, V), mask (N, R) -> scalar."""
    return masked_mean(entropy_from_logits(logits), mask)


def ppo_policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    *,
    clip_eps_low: float = 0.2,
    clip_eps_high: float | None = None,
    clip_ratio_c: float | None = None,
    loss_agg: str = "token-mean",
) -> tuple[Tensor, dict[str, Tensor]]:
    """The PPO clipped loss reduced over ``mask``, with its metrics, on one whole batch.

    Args:
        logprobs, old_logprobs, advantages, mask: (N, R).
        clip_eps_low, clip_eps_high, clip_ratio_c: see :func:`ppo_clip_loss`.
        loss_agg: aggregation mode (see :mod:`~rlfleet.trainer.algorithms.aggregation`).

    Returns:
        the scalar loss, and metrics ``clip_frac`` and ``approx_kl`` (token means, detached scalars).
    """
    per_token, is_clipped = ppo_clip_loss(
        logprobs,
        old_logprobs,
        advantages,
        clip_eps_low=clip_eps_low,
        clip_eps_high=clip_eps_high,
        clip_ratio_c=clip_ratio_c,
    )
    metrics = {
        "clip_frac": masked_mean(is_clipped, mask).detach(),
        "approx_kl": masked_mean(approx_kl(logprobs, old_logprobs), mask).detach(),
    }
    return aggregate(per_token, mask, loss_agg), metrics
