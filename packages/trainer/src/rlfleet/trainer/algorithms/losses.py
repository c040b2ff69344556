"""The loss terms: the PPO clipped policy loss, KL estimators, entropy, and masked aggregation.

Every term is elementwise over tokens: any shape in, the same shape out ((N, R) for a batch of N
responses of width R). Mask and reduce them afterwards with :func:`aggregate`, so that the loss
and its metrics share one mask and one aggregation mode.

Aggregation: reducing a per-token quantity (N, R) over a response mask to one scalar, in one of
three modes, named as in verl:

- ``token-mean`` (default, DAPO): sum over every real token of the batch / number of real tokens;
  every token weighs the same, so long responses weigh more.
- ``seq-mean-token-sum``: sum over each sequence's tokens, then mean over sequences (Dr. GRPO
  without its constant normalizer).
- ``seq-mean-token-mean``: mean over each sequence's tokens, then mean over sequences (original
  GRPO); every sequence weighs the same.

For gradient accumulation the divisor must be the one of the whole (mini-)batch, not of each
micro-batch: pass ``num_tokens`` (token-mean) or ``num_seqs`` (seq-mean-*) of the whole batch and
the micro-batch results then *sum* to the full-batch value exactly.

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
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import get_args

import torch
from torch import Tensor

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.trainer import LossAgg

logger = logging.getLogger(__name__)


# --- aggregation ----------------------------------------------------------------------------------

LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAgg)


def masked_sum(values: Tensor, mask: Tensor) -> Tensor:
    """Sum of ``values`` where ``mask`` is 1: (N, R) x (N, R) -> scalar."""
    return (values * mask.to(values.dtype)).sum()


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of ``values`` over the real tokens: (N, R) x (N, R) -> scalar (0 when the mask is empty)."""
    return masked_sum(values, mask) / mask.sum().clamp(min=1).to(values.dtype)


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
) -> Tensor:
    """Reduce per-token ``values`` to a scalar according to ``mode``.

    Args:
        values: (N, R) per-token values (e.g. a per-token loss).
        mask: (N, R) 1 for real tokens, 0 for padding.
        mode: one of :data:`LOSS_AGG_MODES`.
        num_tokens: token-mean divisor; defaults to ``mask.sum()`` (pass the whole batch's count
            when ``values`` is one micro-batch of it).
        num_seqs: seq-mean-* divisor; defaults to N.

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


# --- policy loss and entropy ----------------------------------------------------------------------


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
