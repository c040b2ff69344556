"""The ppo family (``ppo | grpo | rloo | reinforce_pp``): its advantages, its policy and value losses,
and how one step of it becomes a :class:`~rlfleet.trainer.loop.Plan` for the update loop.

One step on a rollout batch and its scores (N,)::

    grpo | rloo | reinforce_pp with the KL in the loss (or none):
        scores ──outcome advantages──> (N, R) ──> policy_plan: old + reference logprobs as needed;
                                                  an on-policy step (one optimizer step) takes its
                                                  old logprobs from the loss pass itself
    ppo, or a KL in the reward with kl_coef > 0:
        old + reference logprobs, critic values (ppo) ──> token rewards ──> token advantages
        (GAE over the values for ppo) ──> objectives: the critic's value loss, then the policy's

Policy loss of a micro-batch: ``pg - entropy_coef * H + kl_coef * KL`` (KL in the loss only), with
the divisors of the whole mini-batch. Value loss: PPO's clipped regression to the GAE returns.
The pure tensor math lives beside this file (``advantages``, ``gae``, ``losses``, ``kl``, ``value``).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from rlfleet.common.errors import BatchContractError
from rlfleet.common.schema.algorithms import ALGORITHMS
from rlfleet.common.schema.trainer import StepSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms import (
    ADVANTAGES,
    KL_ESTIMATORS,
    aggregate,
    approx_kl,
    broadcast_to_tokens,
    clipped_value_loss,
    discounted_returns,
    explained_variance,
    gae_advantages,
    kl_k3,
    masked_mean,
    masked_sum,
    masked_whiten,
    ppo_clip_loss,
    token_level_rewards,
)
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.distributed import all_reduce_sum
from rlfleet.trainer.forward import PolicyInputs, build_policy_inputs
from rlfleet.trainer.loop import Divisors, Plan, batch_sizes
from rlfleet.trainer.shared_prompt import PromptLayout

logger = logging.getLogger(__name__)


# --- advantages -----------------------------------------------------------------------------


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
    """Advantages of one rollout batch of scores (N,) over its response mask (N, R).

    - ``ppo``: token rewards (score on the last token, ``-kl_coef * kl_t`` on every token with the KL
      in the reward) -> GAE over the critic's ``values`` (N, R) -> advantages (whitened over the
      batch with ``whiten``) and the critic's returns.
    - ``reinforce_pp`` with the KL in the reward (verl, OpenRLHF): the discounted returns of the token
      rewards, whitened over every real token. With the KL in the loss: the scores whitened over
      the batch, one value per sample.
    - ``grpo`` / ``rloo``: the outcome advantage of each sample (group-normalised / leave-one-out) on
      every token, plus, with the KL in the reward, each token's discounted future KL penalty
      ``sum_{k>=t} gamma^(k-t) * (-kl_coef * kl_k)`` (OpenRLHF's RLOO).

    ``kl`` (N, R) is the per-token KL of the sampling policy against the reference, needed with the
    KL in the reward and ``kl_coef > 0``; ``group_index`` (N,) is the prompt of each sample.
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


# --- the batch the losses read ---------------------------------------------------------------


@dataclass(frozen=True)
class PreparedBatch:
    """A rollout batch ready for the policy loss, on the actor's device (the whole batch on every rank).

    Attributes:
        inputs: forward inputs, (N, P + R).
        old_logprobs: (N, R) float32 under the policy before the update (no grad); None for an
            on-policy step (one optimizer step), whose loss pass gives them.
        advantages: (N, R) float32, zero at padding.
        ref_logprobs: (N, R) float32 under the reference model, or None.
        rollout_logprobs: (N, R) float32 the engine reported, or None.
    """

    inputs: PolicyInputs
    old_logprobs: Tensor | None
    advantages: Tensor
    ref_logprobs: Tensor | None = None
    rollout_logprobs: Tensor | None = None


def prepare(
    actor: Actor,
    batch: Mapping[str, Tensor],
    advantages: Tensor,
    *,
    micro_batch_size: int,
    temperature: float = 1.0,
    with_reference: bool = False,
    recompute_old: bool = True,
) -> PreparedBatch:
    """Build inputs, compute old (and reference) logprobs, spread ``advantages`` (N,) / (N, R) over tokens."""
    inputs = build_policy_inputs(batch).to(actor.device)
    token_adv = broadcast_to_tokens(advantages.to(actor.device).float(), inputs.response_mask)
    rollout = batch.get("rollout_logprobs")
    old = ref = None
    if recompute_old:
        old = actor.compute_logprobs(inputs, micro_batch_size=micro_batch_size, temperature=temperature)
    if with_reference:
        ref = actor.compute_logprobs(inputs, micro_batch_size=micro_batch_size, temperature=temperature,
                                     reference=True)  # fmt: skip
    rollout = None if rollout is None else rollout.to(actor.device).float()
    return PreparedBatch(inputs, old, token_adv, ref_logprobs=ref, rollout_logprobs=rollout)


def batch_metrics(prepared: PreparedBatch) -> dict[str, float]:
    """Metrics of the batch before any step: response length, rollout drift, KL to the reference."""
    mask = prepared.inputs.response_mask
    metrics = {"response_length": float(mask.sum(dim=-1).float().mean().item())}
    if prepared.old_logprobs is None:
        return metrics
    if prepared.rollout_logprobs is not None:
        # NaN marks tokens no engine produced (responses a rollout fn wrote): left out of the drift
        known = mask * torch.isfinite(prepared.rollout_logprobs)
        if known.any():
            diff = (prepared.old_logprobs - prepared.rollout_logprobs.nan_to_num()).abs()
            metrics["rollout_logprob_diff"] = float(masked_mean(diff, known).item())
    if prepared.ref_logprobs is not None:
        metrics["kl"] = float(masked_mean(kl_k3(prepared.old_logprobs, prepared.ref_logprobs), mask).item())
    return metrics


def _divisors(response_mask: Tensor, rows: Tensor) -> Divisors:
    # every rank holds the whole batch, so these are the global divisors without a collective
    return Divisors(float(response_mask[rows].sum().clamp(min=1).item()), float(len(rows)))


# --- losses -------------------------------------------------------------------------------


@dataclass
class PolicyObjective:
    """The policy loss ``pg - entropy_coef * H + kl_coef * KL`` on micro-batches of ``batch``.

    ``kl_coef`` is the step's with the KL in the loss, 0 with it in the reward. Without
    ``batch.old_logprobs`` (on-policy) each pass's detached logprobs are the old ones, written into
    ``collect_old`` (N, R) when given (each rank its own rows).
    """

    actor: Actor
    batch: PreparedBatch
    settings: StepSettings
    collect_old: Tensor | None = None
    keys: ClassVar[tuple[str, ...]] = ("loss", "pg_loss", "entropy", "clip_frac", "approx_kl", "kl_loss")

    def __post_init__(self) -> None:
        self.kl_coef = self.settings.kl_coef if self.settings.resolved_kl_mode() == "loss" else 0.0
        if self.kl_coef > 0 and self.batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs: prepare(..., with_reference=True)")
        self.kl = KL_ESTIMATORS[self.settings.resolved_kl_estimator()]
        self.lengths = self.batch.inputs.attention_mask.sum(dim=-1)
        self.prompts = self.actor.prompt_layout(self.batch.inputs)

    @property
    def trainable(self) -> Actor:
        return self.actor

    def divisors(self, rows: Tensor) -> Divisors:
        return _divisors(self.batch.inputs.response_mask, rows)

    def micro_loss(self, chunk: Tensor, weights: Tensor, divisors: Divisors) -> tuple[Tensor, Tensor]:
        """Loss share of the rows ``chunk`` (B,) and the shares of :attr:`keys` (see the loop)."""
        s, batch, tokens = self.settings, self.batch, divisors.num_tokens
        mb = batch.inputs.select(chunk)
        # the entropy is a metric unless the loss has an entropy term: then its backward costs nothing
        logp, entropy = self.actor.logprobs(mb, temperature=s.temperature, entropy_grad=s.entropy_coef != 0)
        assert entropy is not None
        mask = mb.response_mask * weights[:, None]
        if batch.old_logprobs is not None:
            old = batch.old_logprobs[chunk]
        else:
            old = logp.detach()
            if self.collect_old is not None:
                real = weights > 0
                self.collect_old[chunk[real]] = (old * mask)[real]
        div = {"num_tokens": tokens, "num_seqs": divisors.num_seqs}
        pg_tok, clipped = ppo_clip_loss(logp, old, batch.advantages[chunk], clip_eps_low=s.clip_eps)
        pg = aggregate(pg_tok, mask, s.loss_agg, **div)
        total = pg
        if s.entropy_coef != 0:
            total = total - s.entropy_coef * aggregate(entropy, mask, s.loss_agg, **div)
        kl_loss = torch.zeros((), device=logp.device)
        if self.kl_coef > 0:
            assert batch.ref_logprobs is not None
            kl_loss = aggregate(self.kl(logp, batch.ref_logprobs[chunk]), mask, s.loss_agg, **div)
            total = total + self.kl_coef * kl_loss
        shares = (total, pg, masked_sum(entropy, mask) / tokens, masked_sum(clipped, mask) / tokens,
                  masked_sum(approx_kl(logp.detach(), old), mask) / tokens, kl_loss)  # fmt: skip
        return total, torch.stack([share.detach().double() for share in shares])

    def metrics(self, sums: list[float]) -> dict[str, float]:
        values = dict(zip(self.keys, sums, strict=True))
        if self.kl_coef <= 0:
            del values["kl_loss"]
        return values


@dataclass
class ValueObjective:
    """PPO's clipped value loss (around the rollout-time ``old_values``, to the GAE ``returns``, both
    (N, R)) on micro-batches of ``inputs``, all on the critic's device."""

    critic: Critic
    inputs: PolicyInputs
    old_values: Tensor
    returns: Tensor
    settings: StepSettings
    keys: ClassVar[tuple[str, ...]] = ("critic/vf_loss", "critic/vf_clip_frac", "critic/vpred_mean")

    def __post_init__(self) -> None:
        self.lengths = self.inputs.attention_mask.sum(dim=-1)
        self.prompts: PromptLayout | None = None  # the critic's forward runs every row whole

    @property
    def trainable(self) -> Critic:
        return self.critic

    def divisors(self, rows: Tensor) -> Divisors:
        return _divisors(self.inputs.response_mask, rows)

    def micro_loss(self, chunk: Tensor, weights: Tensor, divisors: Divisors) -> tuple[Tensor, Tensor]:
        """Loss share of the rows ``chunk`` (B,) and the shares of :attr:`keys` (see the loop)."""
        s, tokens = self.settings, divisors.num_tokens
        mb = self.inputs.select(chunk)
        mask = mb.response_mask * weights[:, None].to(mb.response_mask.device)
        values = self.critic.values(mb)
        per_token, clipped = clipped_value_loss(
            values, self.old_values[chunk], self.returns[chunk], clip_eps=s.value_clip
        )
        loss = aggregate(per_token, mask, s.loss_agg, num_tokens=tokens, num_seqs=divisors.num_seqs)
        shares = (
            loss,
            masked_sum(clipped.float(), mask) / tokens,
            masked_sum(values.detach(), mask) / tokens,
        )
        return loss, torch.stack([share.detach().double() for share in shares])

    def metrics(self, sums: list[float]) -> dict[str, float]:
        return dict(zip(self.keys, sums, strict=True))


# --- one step ------------------------------------------------------------------------------


def policy_plan(
    actor: Actor, batch: Mapping[str, Tensor], advantages: Tensor, settings: StepSettings
) -> Plan:
    """The policy's steps on a rollout batch and given advantages (N,) or (N, R), without a critic."""
    n = int(batch["response_ids"].shape[0])
    mini, micro = batch_sizes(settings, n)
    loss_kl = settings.kl_coef > 0 and settings.resolved_kl_mode() == "loss"
    on_policy = settings.ppo_epochs == 1 and mini >= n
    prepared = prepare(
        actor, batch, advantages, micro_batch_size=micro, temperature=settings.temperature,
        with_reference=loss_kl or actor.ref_model is not None, recompute_old=not on_policy,
    )  # fmt: skip
    if not on_policy:
        objective = PolicyObjective(actor, prepared, settings)
        return Plan([objective], settings, n, actor.generator, batch_metrics(prepared))
    old = torch.zeros_like(prepared.advantages)

    def finish() -> dict[str, float]:
        all_reduce_sum(old, actor.dist)  # each rank wrote its own rows
        return batch_metrics(replace(prepared, old_logprobs=old))

    return Plan([PolicyObjective(actor, prepared, settings, collect_old=old)], settings, n, actor.generator,
                finish=finish)  # fmt: skip


def plan(
    actor: Actor, critic: Critic | None, batch: Mapping[str, Tensor], scores: Tensor, settings: StepSettings
) -> Plan:
    """One step of ``settings.algorithm`` on a rollout batch and its scores (N,) (see the module doc)."""
    n = int(batch["response_ids"].shape[0])
    if scores.shape != (n,):
        raise BatchContractError("scores", f"{scores.numel()} scores for {n} samples")
    kl_in_reward = settings.resolved_kl_mode() == "reward"
    if critic is None and not (kl_in_reward and settings.kl_coef > 0):
        adv = online_advantages(settings.algorithm, scores, batch["group_index"], batch["response_mask"],
                                kl_in_reward=kl_in_reward, gamma=settings.gamma)  # fmt: skip
        steps = policy_plan(actor, batch, adv.advantages, settings)
        steps.metrics.update(_advantage_metrics(adv.advantages, batch["response_mask"]))
        return steps
    inputs = build_policy_inputs(batch).to(actor.device)
    mask, (_, micro) = inputs.response_mask, batch_sizes(settings, n)
    old = actor.compute_logprobs(inputs, micro_batch_size=micro, temperature=settings.temperature)
    ref = kl = values = None
    if ALGORITHMS[settings.algorithm].uses_reference(settings.kl_coef) or actor.ref_model is not None:
        ref = actor.compute_logprobs(inputs, micro_batch_size=micro, temperature=settings.temperature,
                                     reference=True)  # fmt: skip
        kl = KL_ESTIMATORS[settings.resolved_kl_estimator()](old, ref) * mask
    if critic is not None:
        values = critic.compute_values(inputs.to(critic.device), micro_batch_size=micro).to(mask.device)
    adv = online_advantages(
        settings.algorithm, scores.to(mask.device), batch["group_index"].to(mask.device), mask, kl=kl,
        kl_coef=settings.kl_coef, kl_in_reward=kl_in_reward, values=values, gamma=settings.gamma,
        lam=settings.lam, whiten=settings.whiten_advantages,
    )  # fmt: skip
    rollout = batch.get("rollout_logprobs")
    prepared = PreparedBatch(inputs, old, adv.advantages, ref,
                             None if rollout is None else rollout.to(actor.device).float())  # fmt: skip
    metrics = batch_metrics(prepared)
    metrics.update(_advantage_metrics(adv.advantages, mask))
    if kl is not None and kl_in_reward:
        metrics["kl_reward"] = float(masked_mean(kl, mask).item()) * settings.kl_coef
    objectives: list[PolicyObjective | ValueObjective] = [PolicyObjective(actor, prepared, settings)]
    if critic is not None and values is not None and adv.returns is not None:
        metrics["critic/values_mean"] = float(masked_mean(values, mask).item())
        metrics["critic/returns_mean"] = float(masked_mean(adv.returns, mask).item())
        metrics["critic/explained_variance"] = float(explained_variance(adv.returns, values, mask))
        device = critic.device
        value_loss = ValueObjective(
            critic, inputs.to(device), values.to(device), adv.returns.to(device), settings
        )
        objectives.insert(0, value_loss)  # each mini-batch: the critic's step, then the policy's
    return Plan(objectives, settings, n, actor.generator, metrics)


def _advantage_metrics(advantages: Tensor, response_mask: Tensor) -> dict[str, float]:
    """Token mean and mean absolute value of the advantages."""
    mask = response_mask.to(advantages.device)
    return {
        "advantage/abs_mean": float(masked_mean(advantages.abs(), mask).item()),
        "advantage/mean": float(masked_mean(advantages, mask).item()),
    }
