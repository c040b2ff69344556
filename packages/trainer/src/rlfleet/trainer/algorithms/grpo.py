"""GRPO: group-normalised outcome advantages and the clipped policy loss, and the policy-gradient
step that rloo, reinforce_pp, dr_grpo and ppo share with it.

GRPO (Shao et al., 2024, "DeepSeekMath"; verl's and TRL's ``grpo``) samples every prompt G times,
its group, and gives sample i of group g one advantage on each of its response tokens::

    A_i = (r_i - mean_g(r)) / (std_g(r) + eps)       std Bessel-corrected (verl, TRL); a group of one: 0

With the KL in the reward (``kl_mode: reward``, ``kl_coef > 0``) token t adds its discounted future
KL penalty ``sum_{k >= t} gamma^(k-t) * (-kl_coef * kl_k)`` (OpenRLHF's RLOO does so).

The loss of a token, with ``rho = exp(logp - old_logp)`` its ratio to the policy that sampled it
(PPO's clipped surrogate, Schulman et al., 2017, the default ``update.policy_loss: ppo_clip``; GSPO's
sequence ratio and CISPO's clipped weights are the others, :mod:`~rlfleet.trainer.algorithms.policy_losses`)::

    l_t = -min(rho * A_t, clip(rho, 1 - clip_eps, 1 + clip_eps_high) * A_t)
          - entropy_coef * H_t  +  kl_coef * KL_t                  (KL_t only with the KL in the loss)

reduced over the response tokens by ``loss_agg`` (verl's names for the modes):

- ``token-mean`` (default, DAPO): sum over every real token of the batch / number of real tokens;
  every token weighs the same, so long responses weigh more.
- ``seq-mean-token-sum``: sum over each sequence's tokens, then mean over sequences.
- ``seq-mean-token-mean``: mean over each sequence's tokens, then mean over sequences (the GRPO
  paper); every sequence weighs the same.
- ``seq-mean-token-sum-norm``: each sequence's token sum divided by one constant, the batch's
  response width R (its longest response), then mean over sequences: Dr. GRPO's aggregation
  (:mod:`~rlfleet.trainer.algorithms.dr_grpo`; TRL's ``loss_type="dr_grpo"`` divides by
  ``max_completion_length``, verl divides the token sum by R without the sequence mean).

For gradient accumulation every divisor is the whole (mini-)batch's, not each micro-batch's
(:class:`~rlfleet.trainer.loop.Divisors`): the micro-batch losses then *sum* to the batch's loss.

KL estimators of KL(pi || ref), per token, from the log-probabilities of the sampled tokens. With
samples drawn from pi and ``log_ratio = logp - ref_logp`` (Schulman, "Approximating KL
divergence", 2020):

- ``k1 = log_ratio``: unbiased, high variance, can be negative per token;
- ``k2 = 0.5 * log_ratio**2``: biased, low variance, always >= 0; its gradient is that of the true KL
  at first order;
- ``k3 = exp(-log_ratio) + log_ratio - 1 = exp(ref - logp) - (ref - logp) - 1``: unbiased, >= 0,
  low variance (GRPO's "low_var_kl").

k3 exponentiates, so one token whose log-ratio is large (a token the reference finds very
unlikely) would overflow or dominate the loss. ``clamp`` bounds the log-ratio to [-clamp, clamp]
before the exponential (default 20, as verl does): the value stays finite in float32 and the
gradient is zero beyond the bound. k1 and k2 do not need it; ``clamp=None`` disables it for k3.

One step (:meth:`GRPO.plan`) on a rollout batch and its scores (N,)::

    KL in the loss (or none):
        scores ──advantages──> (N, R) ──policy_plan──> old + reference logprobs as needed (an
            on-policy step, one optimizer step, takes its old logprobs from the loss pass itself)
    KL in the reward, kl_coef > 0:
        old + reference logprobs ──> per-token KL ──> advantages with each token's KL penalty
    ──> PolicyObjective: the loss above on micro-batches, for the update loop

Why the shared pieces live here: the clipped surrogate, the aggregation modes, the KL estimators
and this step are GRPO's own loss and step. RLOO, REINFORCE++ and Dr. GRPO are GRPO with other
advantages (subclasses of :class:`GRPO`) and PPO is this loss with GAE over a critic, the way
torchtitan's ``GRPOLoss`` is its ``DAPOLoss`` with a symmetric clip: they import them from here.
One GRPO step so reads in four trainer files (service, loop, this one, the policy forward).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from typing import ClassVar, get_args

import torch
from torch import Tensor

from rlfleet.common.errors import BatchContractError, ConfigError
from rlfleet.common.schema.algorithms import ALGORITHMS
from rlfleet.common.schema.trainer import LossAgg, StepSettings, UpdateSettings
from rlfleet.trainer import policy
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.off_policy import correction_weights, off_policy_metrics
from rlfleet.trainer.algorithms.policy_losses import TRAINER_POLICY_LOSSES
from rlfleet.trainer.algorithms.policy_losses.ppo_clip import ppo_clip_loss
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.loop import Divisors, Plan, batch_sizes

logger = logging.getLogger(__name__)


# --- masked token math and aggregation ------------------------------------------------------------

LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``values`` where ``mask`` is 1: (N, R) x (N, R) -> scalar."""
    return (values * mask.to(values.dtype)).sum()


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over the real tokens: (N, R) x (N, R) -> scalar (0 when the mask is empty)."""
    return masked_sum(values, mask) / mask.sum().clamp(min=1).to(values.dtype)


def promote(x: Tensor) -> Tensor:
    """``x`` as float32, or as float64 when it already is."""
    return x if x.dtype == torch.float64 else x.float()


def check_token_shapes(mask: Tensor, **tensors: Tensor) -> None:
    """Raise ValueError unless ``mask`` is (N, R) and every named tensor has its shape."""
    if mask.ndim != 2:
        raise ValueError(f"response_mask must be (N, R); got {tuple(mask.shape)}")
    for name, tensor in tensors.items():
        if tensor.shape != mask.shape:
            raise ValueError(f"{name} {tuple(tensor.shape)} does not match response_mask {tuple(mask.shape)}")


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
    check_token_shapes(mask, values=values)
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


def check_loss_agg(mode: str) -> LossAgg:
    """Return ``mode`` if it is a known aggregation mode; raise :class:`ConfigError` otherwise."""
    if mode not in LOSS_AGG_MODES:
        raise ConfigError("loss_agg", mode, f"expected one of {', '.join(LOSS_AGG_MODES)}")
    return mode  # type: ignore[return-value]


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str = "token-mean",
    *,
    num_tokens: float | Tensor | None = None,
    num_seqs: float | Tensor | None = None,
    response_width: float | Tensor | None = None,
) -> Tensor:
    """Reduce per-token ``values`` to a scalar according to ``mode``.

    Args:
        values: (N, R) per-token values (e.g. a per-token loss).
        mask: (N, R) 1 for real tokens, 0 for padding.
        mode: one of :data:`LOSS_AGG_MODES`.
        num_tokens: token-mean divisor; defaults to ``mask.sum()`` (pass the whole batch's count
            when ``values`` is one micro-batch of it).
        num_seqs: seq-mean-* divisor; defaults to N.
        response_width: ``seq-mean-token-sum-norm``'s constant; defaults to R (pass the whole batch's).

    Returns:
        scalar tensor.
    """
    mode = check_loss_agg(mode)
    weights = mask.to(values.dtype)
    if mode == "token-mean":
        divisor = weights.sum().clamp(min=1.0) if num_tokens is None else num_tokens
        return (values * weights).sum() / divisor
    per_seq = (values * weights).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / weights.sum(dim=-1).clamp(min=1.0)
    elif mode == "seq-mean-token-sum-norm":  # one constant for every sequence, not its own length
        per_seq = per_seq / (values.shape[-1] if response_width is None else response_width)
    divisor = max(values.shape[0], 1) if num_seqs is None else num_seqs
    return per_seq.sum() / divisor


# --- KL estimators --------------------------------------------------------------------------------

DEFAULT_LOG_RATIO_CLAMP = 20.0
"""Bound on |logp - ref_logp| inside k3 (see the module docstring)."""


def kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k1 = logp - ref_logp, elementwise: (...) x (...) -> (...)."""
    return logprobs - ref_logprobs


def kl_k2(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    """k2 = 0.5 * (logp - ref_logp)^2, elementwise: (...) x (...) -> (...)."""
    return 0.5 * (logprobs - ref_logprobs) ** 2


def kl_k3(logprobs: Tensor, ref_logprobs: Tensor, *, clamp: float | None = DEFAULT_LOG_RATIO_CLAMP) -> Tensor:
    """k3 = exp(ref - logp) - (ref - logp) - 1, elementwise: (...) x (...) -> (...).

    Args:
        logprobs: (...) log-probabilities of the sampled tokens under the policy.
        ref_logprobs: (...) the same tokens under the reference model.
        clamp: bound on |ref - logp| before the exponential; None for none.

    Returns:
        (...) non-negative per-token estimates.
    """
    log_ratio = ref_logprobs - logprobs
    if clamp is not None:
        log_ratio = log_ratio.clamp(min=-clamp, max=clamp)
    return log_ratio.exp() - log_ratio - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {
    "k1": kl_k1,
    "k2": kl_k2,
    "k3": kl_k3,
}
"""Estimator name -> function(logprobs, ref_logprobs) -> per-token KL."""


# --- the clipped surrogate ------------------------------------------------------------------------


def approx_kl(logprobs: Tensor, old_logprobs: Tensor) -> Tensor:
    """Per-token k3 estimate of KL(old || new) on tokens sampled from old: ``(r - 1) - log r``.

    Args:
        logprobs: (N, R) current policy.
        old_logprobs: (N, R) sampling policy.

    Returns:
        (N, R) non-negative values; their masked mean is PPO's ``approx_kl`` metric.
    """
    return kl_k3(old_logprobs, logprobs)


def masked_entropy(logits: Tensor, mask: Tensor) -> Tensor:
    """Mean entropy over the real tokens: logits (N, R, V), mask (N, R) -> scalar."""
    return masked_mean(policy.entropy_from_logits(logits), mask)


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
        loss_agg: aggregation mode (see the module docstring).

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


# --- advantages -----------------------------------------------------------------------------------


def check_rewards(rewards: Tensor, group_index: Tensor) -> Tensor:
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
    rewards = check_rewards(rewards, group_index)
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
    centered = check_rewards(rewards, group_index) - mean
    return centered / (std + eps) if norm_by_std else centered


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
    rewards = torch.zeros(response_mask.shape, dtype=promote(scores).dtype, device=scores.device)
    if kl is not None:
        check_token_shapes(response_mask, kl=kl)
        rewards = torch.where(mask, -kl_coef * kl.to(rewards.dtype), rewards)
    elif kl_coef != 0.0:
        raise ValueError(f"kl_coef is {kl_coef} but no per-token kl was given; pass kl=...")
    last = last_token_index(response_mask)
    rows = torch.nonzero(last >= 0).squeeze(-1)
    rewards[rows, last[rows]] += scores[rows].to(rewards.dtype)
    return rewards


@torch.no_grad()
def discounted_returns(rewards: Tensor, response_mask: Tensor, *, gamma: float = 1.0) -> Tensor:
    """Discounted returns ``G_t = sum_{k >= t} gamma^(k-t) r_k`` over the real tokens.

    Masked positions are skipped, not steps: a padded token (or a multi-turn observation token)
    neither adds a reward nor interrupts the sum. A token's future KL penalty with the KL in the
    reward; REINFORCE++ whitens these returns (:func:`masked_whiten`); PPO's GAE is these returns
    of the TD errors, discounted by ``gamma * lam``.

    Args:
        rewards: (N, R) per-token rewards.
        response_mask: (N, R) 1 for real tokens.
        gamma: discount factor.

    Returns:
        (N, R) returns, 0 at masked positions.
    """
    check_token_shapes(response_mask, rewards=rewards)
    rewards = promote(rewards)
    real = response_mask.bool()
    returns = torch.zeros_like(rewards)
    carry = torch.zeros_like(rewards[:, 0])  # G_{t+1} of the next real token; 0 past the end
    for t in range(rewards.shape[1] - 1, -1, -1):
        step = rewards[:, t] + gamma * carry
        carry = torch.where(real[:, t], step, carry)
        returns[:, t] = torch.where(real[:, t], step, 0.0)
    return returns


def reward_kl(kl: Tensor | None, settings: StepSettings) -> tuple[Tensor | None, float]:
    """The per-token KL (N, R) and its coefficient where the step puts the KL into the reward with
    ``kl_coef > 0``; ``(None, 0.0)`` otherwise: no token carries a penalty."""
    if not kl_in_reward(settings):
        return None, 0.0
    if kl is None:
        raise ValueError("a KL in the reward with kl_coef > 0 needs the per-token kl")
    return kl, settings.update.kl_coef


def kl_in_reward(settings: StepSettings) -> bool:
    """Whether the step's KL term is a per-token penalty in the reward (``kl_coef > 0``)."""
    return settings.algorithm.resolved_kl_mode() == "reward" and settings.update.kl_coef > 0


@dataclass(frozen=True)
class TokenAdvantages:
    """An algorithm's advantages of one rollout batch.

    Attributes:
        advantages: (N, R) float32, 0 at padding.
        returns: (N, R) the critic's regression targets (PPO), else None.
        token_rewards: (N, R) the per-token rewards the advantages came from, when token-level.
    """

    advantages: Tensor
    returns: Tensor | None = None
    token_rewards: Tensor | None = None


# --- the loss on micro-batches, and the step ------------------------------------------------------


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

    inputs: policy.PolicyInputs
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
    inputs = policy.build_policy_inputs(batch).to(actor.device)
    token_adv = broadcast_to_tokens(advantages.to(actor.device).float(), inputs.response_mask)
    logprobs = functools.partial(policy.compute_logprobs, actor, inputs, micro_batch_size=micro_batch_size,
                                 temperature=temperature)  # fmt: skip
    old = logprobs() if recompute_old else None
    ref = logprobs(reference=True) if with_reference else None
    return PreparedBatch(inputs, old, token_adv, ref, rollout_logprobs(batch, actor))


def batch_metrics(prepared: PreparedBatch, update: UpdateSettings | None = None) -> dict[str, float]:
    """Metrics of the batch before any step: response length, rollout drift (and, given the step's
    ``update`` settings, the off-policy mismatch and its correction), KL to the reference."""
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
            if update is not None:
                old, engine = prepared.old_logprobs, prepared.rollout_logprobs
                metrics.update(off_policy_metrics(old, engine, mask, update))
    if prepared.ref_logprobs is not None:
        metrics["kl"] = float(masked_mean(kl_k3(prepared.old_logprobs, prepared.ref_logprobs), mask).item())
    return metrics


def rollout_logprobs(batch: Mapping[str, Tensor], actor: Actor) -> Tensor | None:
    """(N, R) float32 the engine reported for the batch, on the actor's device; None without them."""
    rollout = batch.get("rollout_logprobs")
    return None if rollout is None else rollout.to(actor.device).float()


def token_divisors(response_mask: Tensor, rows: Tensor) -> Divisors:
    """The divisors of the mini-batch ``rows`` (K,) of a batch's response mask (N, R)."""
    # every rank holds the whole batch, so these are the global divisors without a collective
    tokens = float(response_mask[rows].sum().clamp(min=1).item())
    return Divisors(tokens, float(len(rows)), float(response_mask.shape[1]))


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
        update, algorithm = self.settings.update, self.settings.algorithm
        self.kl_coef = update.kl_coef if algorithm.resolved_kl_mode() == "loss" else 0.0
        if self.kl_coef > 0 and self.batch.ref_logprobs is None:
            raise ValueError("kl_coef > 0 needs reference logprobs: prepare(..., with_reference=True)")
        self.kl = KL_ESTIMATORS[algorithm.resolved_kl_estimator()]
        self.lengths = self.batch.inputs.attention_mask.sum(dim=-1)
        self.prompts = policy.prompt_layout(self.actor, self.batch.inputs)

    @property
    def trainable(self) -> Actor:
        return self.actor

    def divisors(self, rows: Tensor) -> Divisors:
        return token_divisors(self.batch.inputs.response_mask, rows)

    def micro_loss(self, chunk: Tensor, weights: Tensor, divisors: Divisors) -> tuple[Tensor, Tensor]:
        """Loss share of the rows ``chunk`` (B,) and the shares of :attr:`keys` (see the loop)."""
        s, batch, tokens = self.settings.update, self.batch, divisors.num_tokens
        mb = batch.inputs.select(chunk)
        # the entropy is a metric unless the loss has an entropy term: then its backward costs nothing
        logp, entropy = policy.logprobs(
            self.actor, mb, temperature=s.temperature, entropy_grad=s.entropy_coef != 0
        )
        assert entropy is not None
        mask = mb.response_mask * weights[:, None]
        if batch.old_logprobs is not None:
            old = batch.old_logprobs[chunk]
        else:
            old = logp.detach()
            if self.collect_old is not None:
                real = weights > 0
                self.collect_old[chunk[real]] = (old * mask)[real]
        div = {"num_tokens": tokens, "num_seqs": divisors.num_seqs, "response_width": divisors.response_width}
        pg_tok, clipped = TRAINER_POLICY_LOSSES[s.policy_loss](logp, old, batch.advantages[chunk], mask, s)
        if s.off_policy_correction != "none" and batch.rollout_logprobs is not None:  # off_policy.py
            weights, _ = correction_weights(old, batch.rollout_logprobs[chunk], mb.response_mask, s)
            pg_tok = pg_tok * weights
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


def policy_plan(
    actor: Actor, batch: Mapping[str, Tensor], advantages: Tensor, settings: StepSettings
) -> Plan:
    """The policy's steps on a rollout batch and given advantages (N,) or (N, R), without a critic."""
    n = int(batch["response_ids"].shape[0])
    mini, micro = batch_sizes(settings, n)
    update = settings.update
    loss_kl = update.kl_coef > 0 and settings.algorithm.resolved_kl_mode() == "loss"
    on_policy = update.ppo_epochs == 1 and mini >= n
    prepared = prepare(
        actor, batch, advantages, micro_batch_size=micro, temperature=update.temperature,
        with_reference=loss_kl or actor.ref_model is not None, recompute_old=not on_policy,
    )  # fmt: skip
    if not on_policy:
        objective = PolicyObjective(actor, prepared, settings)
        return Plan([objective], settings, n, actor.generator, batch_metrics(prepared, update))
    old = torch.zeros_like(prepared.advantages)

    def finish() -> dict[str, float]:
        policy.all_reduce_sum(old, actor.dist)  # each rank wrote its own rows
        return batch_metrics(replace(prepared, old_logprobs=old), update)

    return Plan([PolicyObjective(actor, prepared, settings, collect_old=old)], settings, n, actor.generator,
                finish=finish)  # fmt: skip


def advantage_metrics(advantages: Tensor, response_mask: Tensor) -> dict[str, float]:
    """Token mean and mean absolute value of the advantages."""
    mask = response_mask.to(advantages.device)
    return {
        "advantage/abs_mean": float(masked_mean(advantages.abs(), mask).item()),
        "advantage/mean": float(masked_mean(advantages, mask).item()),
    }


def check_scores(batch: Mapping[str, Tensor], scores: Tensor) -> int:
    """N, the samples of a rollout batch, when ``scores`` is (N,); else a BatchContractError."""
    n = int(batch["response_ids"].shape[0])
    if scores.shape != (n,):
        raise BatchContractError("scores", f"{scores.numel()} scores for {n} samples")
    return n


def logprobs_before_update(
    actor: Actor, inputs: policy.PolicyInputs, settings: StepSettings
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The old logprobs (N, R) of ``inputs`` and, where the step uses a reference, the reference's
    (N, R) and the per-token KL estimate between them (N, R), 0 at padding; else None for both."""
    micro = batch_sizes(settings, inputs.num_samples)[1]
    update, algorithm = settings.update, settings.algorithm
    old = policy.compute_logprobs(actor, inputs, micro_batch_size=micro, temperature=update.temperature)
    if not (ALGORITHMS[algorithm.name].uses_reference(update.kl_coef) or actor.ref_model is not None):
        return old, None, None
    ref = policy.compute_logprobs(actor, inputs, micro_batch_size=micro, temperature=update.temperature,
                                  reference=True)  # fmt: skip
    return old, ref, KL_ESTIMATORS[algorithm.resolved_kl_estimator()](old, ref) * inputs.response_mask


def step_metrics(prepared: PreparedBatch, kl: Tensor | None, settings: StepSettings) -> dict[str, float]:
    """:func:`batch_metrics`, the advantages' (:func:`advantage_metrics`) and, with the KL in the
    reward, the mean penalty ``kl_reward``."""
    mask = prepared.inputs.response_mask
    metrics = batch_metrics(prepared, settings.update)
    metrics.update(advantage_metrics(prepared.advantages, mask))
    if kl is not None and settings.algorithm.resolved_kl_mode() == "reward":
        metrics["kl_reward"] = float(masked_mean(kl, mask).item()) * settings.update.kl_coef
    return metrics


# --- the algorithm --------------------------------------------------------------------------------


class GRPO:
    """GRPO's step: its outcome advantages and the clipped policy loss (see the module docstring).

    A variant with other outcome advantages (RLOO, Dr. GRPO) overrides :meth:`advantages`; one
    with other token advantages (REINFORCE++) :meth:`token_advantages`.
    """

    def advantages(self, scores: Tensor, group_index: Tensor) -> Tensor:
        """One advantage per sample: scores (N,), the prompt of each (N,) -> (N,)."""
        return grpo_advantages(scores, group_index)

    @torch.no_grad()
    def token_advantages(
        self, scores: Tensor, group_index: Tensor, response_mask: Tensor, settings: StepSettings,
        *, kl: Tensor | None = None,
    ) -> TokenAdvantages:  # fmt: skip
        """Advantages (N, R) of a batch's scores (N,): each sample's on its tokens (``response_mask``,
        (N, R)), plus with the KL in the reward each token's discounted future penalty (``kl``: the
        per-token KL (N, R) of the sampling policy to the reference, needed then)."""
        scores = scores.float()
        outcome = broadcast_to_tokens(self.advantages(scores, group_index), response_mask)
        kl, coef = reward_kl(kl, settings)
        if kl is None:
            return TokenAdvantages(outcome.float())
        penalty = token_level_rewards(torch.zeros_like(scores), response_mask, kl=kl, kl_coef=coef)
        advantages = outcome + discounted_returns(penalty, response_mask, gamma=settings.algorithm.gamma)
        return TokenAdvantages(advantages.float(), None, penalty)

    def plan(
        self, actor: Actor, critic: Critic | None, batch: Mapping[str, Tensor], scores: Tensor,
        settings: StepSettings,
    ) -> Plan:  # fmt: skip
        """One step on a rollout batch and its scores (N,) (see the module docstring); no critic."""
        n = check_scores(batch, scores)
        if not kl_in_reward(settings):
            adv = self.token_advantages(scores, batch["group_index"], batch["response_mask"], settings)
            steps = policy_plan(actor, batch, adv.advantages, settings)
            steps.metrics.update(advantage_metrics(adv.advantages, batch["response_mask"]))
            return steps
        inputs = policy.build_policy_inputs(batch).to(actor.device)
        mask = inputs.response_mask
        old, ref, kl = logprobs_before_update(actor, inputs, settings)
        groups = batch["group_index"].to(mask.device)
        adv = self.token_advantages(scores.to(mask.device), groups, mask, settings, kl=kl)
        prepared = PreparedBatch(inputs, old, adv.advantages, ref, rollout_logprobs(batch, actor))
        objective = PolicyObjective(actor, prepared, settings)
        return Plan([objective], settings, n, actor.generator, step_metrics(prepared, kl, settings))
