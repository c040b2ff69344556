"""The critic's loss (clipped value regression, as PPO) and its explained-variance metric.

With value clipping (``clip_eps``, verl's ``cliprange_value``, OpenRLHF's ``value_clip``) the new
prediction may not move the loss down by more than ``clip_eps`` away from the rollout-time value::

    v_clip = clip(v, old_v - eps, old_v + eps)
    loss_t = 0.5 * max((v - R)^2, (v_clip - R)^2)

Per-token terms reduce with :func:`~rlfleet.trainer.algorithms.losses.aggregate`, so the
critic uses the same aggregation modes (and micro-batch divisors) as the policy loss.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

from rlfleet.trainer.algorithms.losses import aggregate, masked_mean

logger = logging.getLogger(__name__)


def clipped_value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    *,
    clip_eps: float | None = 0.2,
) -> tuple[Tensor, Tensor]:
    """Per-token clipped value loss.

    Args:
        values: (N, R) current critic predictions (with grad).
        old_values: (N, R) critic predictions at rollout time (no grad).
        returns: (N, R) regression targets (GAE returns).
        clip_eps: clip range around ``old_values``; None: plain ``0.5 * (v - R)^2``.

    Returns:
        loss (N, R), and clipped (N, R) float: 1 where the clipped branch is strictly larger (the
        token's gradient is then zero).
    """
    unclipped = (values - returns) ** 2
    if clip_eps is None:
        return 0.5 * unclipped, torch.zeros_like(unclipped)
    if clip_eps <= 0.0:
        raise ValueError(f"clip_eps must be > 0 (or None to disable value clipping); got {clip_eps}")
    v_clipped = old_values + (values - old_values).clamp(-clip_eps, clip_eps)
    clipped = (v_clipped - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), (clipped > unclipped).to(values.dtype)


def value_loss(
    values: Tensor,
    old_values: Tensor,
    returns: Tensor,
    mask: Tensor,
    *,
    clip_eps: float | None = 0.2,
    loss_agg: str = "token-mean",
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The critic loss reduced over ``mask``, with its metrics.

    Args:
        values, old_values, returns, mask: (N, R), see :func:`clipped_value_loss`.
        clip_eps: value clip range; None disables clipping.
        loss_agg: aggregation mode (``token-mean``, ``seq-mean-token-sum``, ``seq-mean-token-mean``).
        num_tokens, num_seqs: whole-batch divisors when this is one micro-batch (see ``aggregate``).

    Returns:
        the scalar loss, and detached scalar metrics ``vf_clip_frac`` (token mean of the clipped
        indicator) and ``vpred_mean`` (token mean of ``values``).
    """
    per_token, is_clipped = clipped_value_loss(values, old_values, returns, clip_eps=clip_eps)
    loss = aggregate(per_token, mask, loss_agg, num_tokens=num_tokens, num_seqs=num_seqs)
    metrics = {
        "vf_clip_frac": masked_mean(is_clipped, mask).detach(),
        "vpred_mean": masked_mean(values, mask).detach(),
    }
    return loss, metrics


@torch.no_grad()
def explained_variance(returns: Tensor, values: Tensor, mask: Tensor) -> Tensor:
    """``1 - Var[R - V] / Var[R]`` over the real tokens: (N, R) x (N, R) x (N, R) -> scalar.

    1 is a perfect critic, 0 one no better than a constant, negative one worse than a constant.
    Both variances are population variances over the masked tokens. When ``Var[R]`` is 0 (a
    constant target, fewer than two tokens) the ratio is undefined and 0 is returned, so the
    metric stays a finite number on the wire.
    """
    weights = mask.to(torch.float64)
    count = weights.sum()
    if count < 1:
        return torch.zeros((), dtype=torch.float32, device=returns.device)
    r, residual = returns.to(torch.float64), (returns - values).to(torch.float64)

    def variance(x: Tensor) -> Tensor:
        mean = (x * weights).sum() / count
        return (((x - mean) * weights) ** 2).sum() / count

    var_r = variance(r)
    if var_r <= 0:
        return torch.zeros((), dtype=torch.float32, device=returns.device)
    return (1.0 - variance(residual) / var_r).to(torch.float32)
