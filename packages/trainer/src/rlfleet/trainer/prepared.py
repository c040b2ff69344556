"""A rollout batch made ready for the policy loss, its micro-batch loss, and its batch metrics.

The micro-batch loss is ``pg - entropy_coef * H + kl_coef * KL`` with the divisors of the whole
(mini-)batch, so micro-batches (and ranks) each add their share and the shares sum to the
mini-batch's loss. A row's weight (0 for a padding row a rank runs only to stay in step with the
others) multiplies its mask.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from rlfleet.trainer.algorithms.aggregation import aggregate, masked_mean, masked_sum
from rlfleet.trainer.algorithms.kl import KL_ESTIMATORS, kl_k3
from rlfleet.trainer.algorithms.losses import approx_kl, ppo_clip_loss
from rlfleet.trainer.config import PolicyLossConfig
from rlfleet.trainer.inputs import PolicyInputs

logger = logging.getLogger(__name__)

METRIC_KEYS = ("loss", "pg_loss", "entropy", "clip_frac", "approx_kl", "kl_loss")
"""The per-step sums :func:`micro_batch_loss` returns, in a fixed order (for one all-reduce)."""


@dataclass(frozen=True)
class PreparedBatch:
    """A batch ready for loss computation, all on the actor's device (the whole batch on every rank).

    Attributes:
        inputs: forward inputs, (N, P + R).
        old_logprobs: (N, R) float32, the current policy before the update (no grad); None when the
            update is on-policy (one optimizer step): the loss pass's own logprobs, detached, are
            exactly the old ones then, which saves a forward pass.
        advantages: (N, R) float32, zero at padding.
        ref_logprobs: (N, R) float32 under the reference model, or None.
        rollout_logprobs: (N, R) float32 the engine reported, or None.
    """

    inputs: PolicyInputs
    old_logprobs: Tensor | None
    advantages: Tensor
    ref_logprobs: Tensor | None = None
    rollout_logprobs: Tensor | None = None


def micro_batch_loss(
    logp: Tensor,
    entropy: Tensor,
    old: Tensor,
    advantages: Tensor,
    mask: Tensor,
    ref: Tensor | None,
    loss: PolicyLossConfig,
    *,
    num_tokens: float,
    num_seqs: float,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The loss share of one micro-batch and its metric shares.

    Args:
        logp, entropy: (B, R) under the current policy (``logp`` with grad).
        old, advantages: (B, R) old logprobs (no grad) and per-token advantages.
        mask: (B, R) float, response mask times the row weight.
        ref: (B, R) reference logprobs; needed when ``kl_coef > 0``.
        loss: the loss settings.
        num_tokens, num_seqs: the whole mini-batch's real tokens and sequences (over all ranks).

    Returns:
        the loss share (scalar, with grad) and the detached float64 shares of :data:`METRIC_KEYS`.
    """
    divisors = {"num_tokens": num_tokens, "num_seqs": num_seqs}
    pg_tok, clipped = ppo_clip_loss(
        logp, old, advantages, clip_eps_low=loss.clip_eps, clip_eps_high=loss.clip_eps_high,
        clip_ratio_c=loss.clip_ratio_c,
    )  # fmt: skip
    pg = aggregate(pg_tok, mask, loss.loss_agg, **divisors)
    total = pg
    if loss.entropy_coef > 0:
        total = total - loss.entropy_coef * aggregate(entropy, mask, loss.loss_agg, **divisors)
    kl_loss = torch.zeros((), device=logp.device)
    if loss.kl_coef > 0:
        assert ref is not None, "kl_coef > 0 needs reference logprobs"
        kl_loss = aggregate(KL_ESTIMATORS[loss.kl_estimator](logp, ref), mask, loss.loss_agg, **divisors)
        total = total + loss.kl_coef * kl_loss
    shares = {
        "loss": total,
        "pg_loss": pg,
        "entropy": masked_sum(entropy, mask) / num_tokens,
        "clip_frac": masked_sum(clipped, mask) / num_tokens,
        "approx_kl": masked_sum(approx_kl(logp.detach(), old), mask) / num_tokens,
        "kl_loss": kl_loss,
    }
    return total, {key: value.detach().double() for key, value in shares.items()}


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
        kl = kl_k3(prepared.old_logprobs, prepared.ref_logprobs)
        metrics["kl"] = float(masked_mean(kl, mask).item())
    return metrics
