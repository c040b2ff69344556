"""PPO's clipped surrogate per token (Schulman et al., 2017), with DAPO's asymmetric clip.

With ``rho = exp(logp - old_logp)`` a token's ratio to the policy that sampled it::

    l_t = -min(rho * A_t, clip(rho, 1 - eps_low, 1 + eps_high) * A_t)

``eps_low`` is ``update.clip_eps``; ``eps_high`` is ``update.clip_eps_high`` (DAPO's clip-higher,
Yu et al., 2025: a larger upper bound, 0.28 against 0.2, lets unlikely tokens with a positive
advantage grow, which keeps the policy's entropy from collapsing), ``clip_eps`` when unset. A token
whose clipped branch is chosen gives no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from rlfleet.common.schema.trainer import UpdateSettings


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


def ppo_clip_policy_loss(
    logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, update: UpdateSettings
) -> tuple[Tensor, Tensor]:
    """``update.policy_loss: ppo_clip`` (see the module docstring); ``mask`` is not needed per token."""
    low, high = update.clip_range
    return ppo_clip_loss(logprobs, old_logprobs, advantages, clip_eps_low=low, clip_eps_high=high)
