"""Token-level rewards and generalized advantage estimation (GAE) for PPO with a critic.

PPO with a critic sees one reward per response token. :func:`token_level_rewards` builds them the
way OpenRLHF and verl do: the sequence score sits on the last real token, and with the KL in the
reward every real token also carries ``-kl_coef * kl_t``::

    r_t = -kl_coef * kl_t  (+ score on the last real token)

:func:`gae_advantages` then runs the GAE recursion backwards over the response (Schulman et al.,
2016)::

    delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last real token is 0: the episode ends)
    A_t     = delta_t + gamma * lam * A_{t+1}
    R_t     = A_t + V_t                          (the critic's regression target)

Masked positions are skipped, not treated as steps: a padded token neither adds a reward nor
interrupts the recursion, so right-padded responses (and masks with holes, such as multi-turn
observation tokens) give the same numbers as unpadded ones. Every output is 0 at masked positions.
With ``gamma = lam = 1`` the advantage is the Monte-Carlo return minus the value.

The recursion accumulates in at least float32 (bf16 values are promoted) and runs without
gradient: advantages and returns are targets, never differentiated.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

logger = logging.getLogger(__name__)


def _promote(x: Tensor) -> Tensor:
    """``x`` as float32, or as float64 when it already is."""
    return x if x.dtype == torch.float64 else x.float()


def _check_same_shape(mask: Tensor, **tensors: Tensor) -> None:
    """Raise ValueError unless ``mask`` is (N, R) and every named tensor has its shape."""
    if mask.ndim != 2:
        raise ValueError(f"response_mask must be (N, R); got {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != mask.shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} does not match response_mask {tuple(mask.shape)}")


def last_token_index(response_mask: Tensor) -> Tensor:
    """Index of the last real token of each row: (N, R) -> (N,) int64, -1 for an all-masked row."""
    positions = torch.arange(response_mask.shape[-1], device=response_mask.device)
    return torch.where(response_mask.bool(), positions, -1).max(dim=-1).values


def token_level_rewards(
    scores: Tensor,
    response_mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
) -> Tensor:
    """Per-token rewards: the score on the last real token, minus ``kl_coef * kl`` on every real token.

    Args:
        scores: (N,) one score per response (from the reward service).
        response_mask: (N, R) 1 for real response tokens.
        kl: (N, R) per-token KL estimate (e.g. ``KL_ESTIMATORS["k1"](logp, ref_logp)``), or None.
        kl_coef: the KL coefficient beta (the KL controller's current value).

    Returns:
        (N, R) float rewards, 0 at masked positions. An all-masked row gets all zeros (its score
        has no token to sit on).
    """
    if scores.ndim != 1 or scores.shape[0] != response_mask.shape[0]:
        raise ValueError(f"scores must be (N,) with N = {response_mask.shape[0]}; got {tuple(scores.shape)}")
    mask = response_mask.bool()
    rewards = torch.zeros(response_mask.shape, dtype=_promote(scores).dtype, device=scores.device)
    if kl is not None:
        _check_same_shape(response_mask, kl=kl)
        rewards = torch.where(mask, -kl_coef * kl.to(rewards.dtype), rewards)
    elif kl_coef != 0.0:
        raise ValueError(f"kl_coef is {kl_coef} but no per-token kl was given; pass kl=...")
    last = last_token_index(response_mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += scores[rows].to(rewards.dtype)
    return rewards


def masked_whiten(values: Tensor, mask: Tensor, *, shift_mean: bool = True, eps: float = 1e-8) -> Tensor:
    """Whiten ``values`` over the real tokens of the whole batch: ``(x - mean) / sqrt(var + eps)``.

    The variance is Bessel-corrected (as verl's ``masked_whiten``); with fewer than two real tokens
    the values are only centered. ``shift_mean=False`` adds the mean back (scale only).

    Args:
        values: (N, R).
        mask: (N, R) 1 for real tokens.
        shift_mean: subtract the mean (True) or keep it.
        eps: added to the variance.

    Returns:
        (N, R), 0 at masked positions.
    """
    _check_same_shape(mask, values=values)
    weights = mask.to(values.dtype)
    count = weights.sum()
    mean = (values * weights).sum() / count.clamp(min=1.0)
    centered = (values - mean) * weights
    if count < 2:
        scaled = centered
    else:
        var = (centered**2).sum() / (count - 1.0)
        scaled = centered * torch.rsqrt(var + eps)
    return scaled if shift_mean else (scaled + mean) * weights


@torch.no_grad()
def gae_advantages(
    rewards: Tensor,
    values: Tensor,
    response_mask: Tensor,
    *,
    gamma: float,
    lam: float,
    whiten: bool = False,
) -> tuple[Tensor, Tensor]:
    """GAE advantages and returns over right-padded (or holed) responses.

    Args:
        rewards: (N, R) per-token rewards (see :func:`token_level_rewards`).
        values: (N, R) critic values of the response tokens, from the rollout-time critic.
        response_mask: (N, R) 1 for real response tokens.
        gamma: discount factor.
        lam: GAE lambda (1: Monte-Carlo return minus value; 0: one-step TD error).
        whiten: whiten the advantages over the batch (:func:`masked_whiten`); the returns are
            always computed from the raw advantages, as verl and OpenRLHF do.

    Returns:
        advantages (N, R) and returns (N, R), float32 (float64 for float64 inputs), 0 at masked
        positions.
    """
    _check_same_shape(response_mask, rewards=rewards, values=values)
    dtype = torch.promote_types(_promote(rewards).dtype, _promote(values).dtype)
    rewards, values = rewards.to(dtype), values.to(dtype)
    mask = response_mask.bool()
    advantages = torch.zeros_like(rewards)
    carry = torch.zeros_like(rewards[:, 0])  # A_{t+1} of the next real token
    next_value = torch.zeros_like(carry)  # V_{t+1} of the next real token; 0 past the end
    for t in range(rewards.shape[1] - 1, -1, -1):
        real = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        step = delta + gamma * lam * carry
        carry = torch.where(real, step, carry)
        next_value = torch.where(real, values[:, t], next_value)
        advantages[:, t] = torch.where(real, step, 0.0)
    returns = (advantages + values) * mask.to(dtype)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


@torch.no_grad()
def discounted_returns(rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Monte-Carlo returns ``G_t = sum_{k >= t} gamma^(k-t) r_k`` over the real tokens.

    This is GAE with ``lam = 1`` and a zero critic; REINFORCE++ with the KL in the reward whitens
    these returns (``masked_whiten``) to get its token-level advantages.

    Args:
        rewards: (N, R) per-token rewards.
        response_mask: (N, R) 1 for real tokens.
        gamma: discount factor.

    Returns:
        (N, R) returns, 0 at masked positions.
    """
    _, returns = gae_advantages(
        rewards, torch.zeros_like(rewards), response_mask, gamma=gamma, lam=1.0, whiten=False
    )
    return returns
