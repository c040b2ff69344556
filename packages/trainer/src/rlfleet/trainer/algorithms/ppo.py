"""PPO: GAE advantages over a critic, the critic's clipped value loss, and GRPO's clipped policy loss.

PPO as RLHF runs it (Schulman et al., 2017; Ouyang et al., 2022; OpenRLHF's and verl's ``gae``)
trains a value model (the critic, :mod:`rlfleet.trainer.critic`) beside the policy and sees one
reward per response token: the sequence score on the last real token and, with the KL in the
reward (its default), ``-kl_coef * kl_t`` on every token::

    r_t = -kl_coef * kl_t  (+ score on the last real token)

Generalized advantage estimation (Schulman et al., 2016) runs backwards over the response::

    delta_t = r_t + gamma * V_{t+1} - V_t        (V after the last real token is 0: the episode ends)
    A_t     = delta_t + gamma * lam * A_{t+1}    = sum_{k >= t} (gamma * lam)^(k-t) delta_k
    R_t     = A_t + V_t                          (the critic's regression target)

Masked positions are skipped, not treated as steps: a padded token neither adds a reward nor
interrupts the recursion, so right-padded responses (and masks with holes, such as multi-turn
observation tokens) give the same numbers as unpadded ones. Every output is 0 at masked positions.
With ``gamma = lam = 1`` the advantage is the Monte-Carlo return minus the value. The recursion
accumulates in at least float32 (bf16 values are promoted) and runs without gradient: advantages
and returns are targets, never differentiated.

The critic's loss, with value clipping (``value_clip``: verl's ``cliprange_value``, OpenRLHF's
``value_clip``): the new prediction may not move the loss down by more than ``value_clip`` away
from the rollout-time value::

    v_clip = clip(v, old_v - eps, old_v + eps)
    loss_t = 0.5 * max((v - R)^2, (v_clip - R)^2)

reduced by the step's ``loss_agg`` like the policy loss. The policy's loss is GRPO's clipped
surrogate (:mod:`rlfleet.trainer.algorithms.grpo`) on these advantages, and so are its old and
reference logprobs and metrics. Each mini-batch steps the critic, then the policy.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from rlfleet.common.schema.trainer import StepSettings
from rlfleet.trainer import policy
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.grpo import (
    PolicyObjective,
    PreparedBatch,
    TokenAdvantages,
    aggregate,
    check_scores,
    check_token_shapes,
    discounted_returns,
    logprobs_before_update,
    masked_mean,
    masked_sum,
    masked_whiten,
    promote,
    reward_kl,
    rollout_logprobs,
    step_metrics,
    token_divisors,
    token_level_rewards,
)
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.loop import Divisors, Plan, batch_sizes

logger = logging.getLogger(__name__)


# --- advantages -----------------------------------------------------------------------------------


def next_real_values(values: Tensor, response_mask: Tensor) -> Tensor:
    """V_{t+1} at every position t: the value of the next real token after it, 0 past the last.

    (N, R) x (N, R) -> (N, R); masked positions in between are skipped.
    """
    n, width = values.shape
    positions = torch.arange(width, device=values.device).expand(n, width)
    real_at = torch.where(response_mask.bool(), positions, width)  # width: no real token here
    # the first real position at or after each column, then shifted: strictly after it
    first_from = torch.flip(torch.cummin(torch.flip(real_at, [1]), dim=1).values, [1])
    after = torch.cat([first_from[:, 1:], torch.full_like(first_from[:, :1], width)], dim=1)
    padded = torch.cat([values, torch.zeros_like(values[:, :1])], dim=1)  # column width: the end, V = 0
    return padded.gather(1, after)


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
    """GAE advantages and returns over right-padded (or holed) responses: the TD errors' discounted
    returns (see the module docstring).

    Args:
        rewards: (N, R) per-token rewards (see :func:`~rlfleet.trainer.algorithms.grpo.token_level_rewards`).
        values: (N, R) critic values of the response tokens, from the rollout-time critic.
        response_mask: (N, R) 1 for real response tokens.
        gamma: discount factor.
        lam: GAE lambda (1: Monte-Carlo return minus value; 0: one-step TD error).
        whiten: whiten the advantages over the batch (``masked_whiten``); the returns are
            always computed from the raw advantages, as verl and OpenRLHF do.

    Returns:
        advantages (N, R) and returns (N, R), float32 (float64 for float64 inputs), 0 at masked
        positions.
    """
    check_token_shapes(response_mask, rewards=rewards, values=values)
    dtype = torch.promote_types(promote(rewards).dtype, promote(values).dtype)
    rewards, values = rewards.to(dtype), values.to(dtype)
    deltas = rewards + gamma * next_real_values(values, response_mask) - values
    advantages = discounted_returns(deltas, response_mask, gamma=gamma * lam)
    returns = (advantages + values) * response_mask.to(dtype)
    if whiten:
        advantages = masked_whiten(advantages, response_mask)
    return advantages, returns


# --- the critic's loss ----------------------------------------------------------------------------


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
        loss_agg: aggregation mode (:func:`~rlfleet.trainer.algorithms.grpo.aggregate`).
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


@dataclass
class ValueObjective:
    """The critic's clipped value loss (around the rollout-time ``old_values``, to the GAE ``returns``,
    both (N, R)) on micro-batches of ``inputs``, all on the critic's device."""

    critic: Critic
    inputs: policy.PolicyInputs
    old_values: Tensor
    returns: Tensor
    settings: StepSettings
    keys: ClassVar[tuple[str, ...]] = ("critic/vf_loss", "critic/vf_clip_frac", "critic/vpred_mean")

    def __post_init__(self) -> None:
        self.lengths = self.inputs.attention_mask.sum(dim=-1)
        self.prompts: policy.PromptLayout | None = None  # the critic's forward runs every row whole

    @property
    def trainable(self) -> Critic:
        return self.critic

    def divisors(self, rows: Tensor) -> Divisors:
        return token_divisors(self.inputs.response_mask, rows)

    def micro_loss(self, chunk: Tensor, weights: Tensor, divisors: Divisors) -> tuple[Tensor, Tensor]:
        """Loss share of the rows ``chunk`` (B,) and the shares of :attr:`keys` (see the loop)."""
        tokens = divisors.num_tokens
        mb = self.inputs.select(chunk)
        mask = mb.response_mask * weights[:, None].to(mb.response_mask.device)
        values = self.critic.values(mb)
        per_token, clipped = clipped_value_loss(
            values, self.old_values[chunk], self.returns[chunk], clip_eps=self.settings.algorithm.value_clip
        )
        loss = aggregate(
            per_token,
            mask,
            self.settings.update.loss_agg,
            num_tokens=tokens,
            num_seqs=divisors.num_seqs,
            response_width=divisors.response_width,
        )
        shares = (
            loss,
            masked_sum(clipped.float(), mask) / tokens,
            masked_sum(values.detach(), mask) / tokens,
        )
        return loss, torch.stack([share.detach().double() for share in shares])

    def metrics(self, sums: list[float]) -> dict[str, float]:
        return dict(zip(self.keys, sums, strict=True))


# --- the algorithm --------------------------------------------------------------------------------


class PPO:
    """PPO's step: GAE advantages over the critic's values, then per mini-batch the critic's clipped
    value loss and the policy's clipped loss (see the module docstring)."""

    @torch.no_grad()
    def token_advantages(
        self, scores: Tensor, group_index: Tensor, response_mask: Tensor, settings: StepSettings,
        *, kl: Tensor | None = None, values: Tensor | None = None,
    ) -> TokenAdvantages:  # fmt: skip
        """GAE advantages and the critic's returns (N, R) of a batch's scores (N,) over the critic's
        ``values`` (N, R); ``kl`` (N, R) is needed with the KL in the reward and ``kl_coef > 0``.
        ``group_index`` is not used: a token is compared with the critic's value, not with other samples."""
        if values is None:
            raise ValueError("ppo needs the critic's values (N, R)")
        kl, coef = reward_kl(kl, settings)
        rewards = token_level_rewards(scores.float(), response_mask, kl=kl, kl_coef=coef)
        gae = settings.algorithm
        advantages, returns = gae_advantages(rewards, values, response_mask, gamma=gae.gamma, lam=gae.lam,
                                             whiten=gae.whiten_advantages)  # fmt: skip
        return TokenAdvantages(advantages.float(), returns.float(), rewards)

    def plan(
        self, actor: Actor, critic: Critic | None, batch: Mapping[str, Tensor], scores: Tensor,
        settings: StepSettings,
    ) -> Plan:  # fmt: skip
        """One step on a rollout batch and its scores (N,): old and reference logprobs, the critic's
        values, GAE, then the critic's and the policy's losses."""
        n = check_scores(batch, scores)
        if critic is None:  # run_step refuses such a step first, naming the setting
            raise ValueError("ppo trains a critic; this trainer holds none")
        inputs = policy.build_policy_inputs(batch).to(actor.device)
        mask = inputs.response_mask
        old, ref, kl = logprobs_before_update(actor, inputs, settings)
        micro = batch_sizes(settings, n)[1]
        values = critic.compute_values(inputs.to(critic.device), micro_batch_size=micro).to(mask.device)
        groups = batch["group_index"].to(mask.device)
        adv = self.token_advantages(scores.to(mask.device), groups, mask, settings, kl=kl, values=values)
        assert adv.returns is not None
        prepared = PreparedBatch(inputs, old, adv.advantages, ref, rollout_logprobs(batch, actor))
        metrics = step_metrics(prepared, kl, settings)
        metrics["critic/values_mean"] = float(masked_mean(values, mask).item())
        metrics["critic/returns_mean"] = float(masked_mean(adv.returns, mask).item())
        metrics["critic/explained_variance"] = float(explained_variance(adv.returns, values, mask))
        device = critic.device
        critic_loss = ValueObjective(
            critic, inputs.to(device), values.to(device), adv.returns.to(device), settings
        )
        objectives = [critic_loss, PolicyObjective(actor, prepared, settings)]  # the critic's step first
        return Plan(objectives, settings, n, actor.generator, metrics)
