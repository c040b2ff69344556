"""Per-token advantages of the online algorithms, with the KL to the reference in the reward or not.

One function turns the reward tier's scores (one per sample) into (N, R) advantages for
``ppo | grpo | rloo | reinforce_pp``. With the KL in the reward every real token carries
``-kl_coef * kl_t`` (:func:`~rlfleet.trainer.algorithms.gae.token_level_rewards`); otherwise the KL,
if any, is a loss term and the rewards are the scores alone.

- ``ppo``: token rewards (score on the last token, KL on every token) -> GAE over the critic's values
  -> advantages (whitened over the batch by default) and the critic's returns.
- ``reinforce_pp`` with the KL in the reward (its default; verl, OpenRLHF): the discounted returns of
  the token rewards, whitened over every real token of the batch. With the KL in the loss: the
  scores whitened over the batch, one value per sample (:func:`reinforce_pp_advantages`).
- ``grpo`` / ``rloo``: the outcome advantage of each sample (group-normalised / leave-one-out)
  on every token, plus, with the KL in the reward, each token's discounted future KL penalty
  ``sum_{k>=t} gamma^(k-t) * (-kl_coef * kl_k)`` (OpenRLHF's RLOO: baseline on the score first,
  then the token-level KL return).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from rlfleet.trainer.algorithms import (
    ADVANTAGES,
    broadcast_to_tokens,
    discounted_returns,
    gae_advantages,
    masked_whiten,
    token_level_rewards,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class TokenAdvantages:
    """What :func:`online_advantages` returns.

    Attributes:
        advantages: (N, R) float32, 0 at padding.
        returns: (N, R) the critic's regression targets (PPO), else None.
        token_rewards: (N, R) the per-token rewards the advantages came from, when token-level.
    """

    advantages: Tensor
    returns: Tensor | None = None
    token_rewards: Tensor | None = None


@torch.no_grad()
def online_advantages(
    algorithm: str,
    scores: Tensor,
    group_index: Tensor,
    response_mask: Tensor,
    *,
    kl: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_in_reward: bool = False,
    values: Tensor | None = None,
    gamma: float = 1.0,
    lam: float = 0.95,
    whiten: bool = True,
) -> TokenAdvantages:
    """Advantages of one rollout batch.

    Args:
        algorithm: ``ppo``, ``grpo``, ``rloo`` or ``reinforce_pp``.
        scores: (N,) one score per sample.
        group_index: (N,) prompt of each sample.
        response_mask: (N, R) 1 for real response tokens.
        kl: (N, R) per-token KL estimate of the sampling policy against the reference; needed when
            the KL is in the reward with ``kl_coef > 0``.
        kl_coef: the KL coefficient of this step.
        kl_in_reward: put ``-kl_coef * kl`` in the token rewards (else the caller adds a loss term).
        values: (N, R) rollout-time critic values (PPO only).
        gamma: discount of GAE and of REINFORCE++ returns.
        lam: GAE lambda.
        whiten: PPO: whiten the GAE advantages over the batch.

    Returns:
        :class:`TokenAdvantages` on the scores' device.
    """
    mask = response_mask
    scores = scores.float()
    reward_kl = kl if kl_in_reward and kl_coef > 0 else None
    coef = kl_coef if reward_kl is not None else 0.0
    if kl_in_reward and kl_coef > 0 and kl is None:
        raise ValueError("a KL in the reward with kl_coef > 0 needs the per-token kl")
    if algorithm == "ppo":
        if values is None:
            raise ValueError("ppo needs the critic's values (N, R)")
        rewards = token_level_rewards(scores, mask, kl=reward_kl, kl_coef=coef)
        adv, returns = gae_advantages(rewards, values, mask, gamma=gamma, lam=lam, whiten=whiten)
        return TokenAdvantages(adv.float(), returns.float(), rewards)
    if algorithm not in ADVANTAGES:
        raise ValueError(f"no advantage estimator for algorithm {algorithm!r}")
    if algorithm == "reinforce_pp" and kl_in_reward:
        rewards = token_level_rewards(scores, mask, kl=reward_kl, kl_coef=coef)
        returns = discounted_returns(rewards, mask, gamma=gamma)
        return TokenAdvantages(masked_whiten(returns, mask).float(), None, rewards)
    outcome = broadcast_to_tokens(ADVANTAGES[algorithm](scores, group_index), mask)
    if reward_kl is None:
        return TokenAdvantages(outcome.float())
    penalty = token_level_rewards(torch.zeros_like(scores), mask, kl=reward_kl, kl_coef=coef)
    adv = outcome + discounted_returns(penalty, mask, gamma=gamma)
    return TokenAdvantages(adv.float(), None, penalty)
