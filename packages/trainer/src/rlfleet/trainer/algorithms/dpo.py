"""Direct preference optimization: the loss on (chosen, rejected) pairs and its metrics.

From the sequence log-probabilities of the chosen and rejected responses under the policy (pi)
and the frozen reference (ref), with ``h = (pi_c - ref_c) - (pi_r - ref_r)``:

- ``sigmoid`` (Rafailov et al., 2023): ``-logsigmoid(beta * h)``; with ``label_smoothing = s``
  (conservative DPO, labels flipped with probability s):
  ``-(1 - s) * logsigmoid(beta * h) - s * logsigmoid(-beta * h)``;
- ``ipo`` (Azar et al., 2023): ``(h - 1 / (2 * beta))^2``; the paper uses length-averaged log-probs
  (``sequence_logprobs(..., average=True)``).

The implicit rewards are ``beta * (pi - ref)`` of each response; the metrics are their batch means,
the accuracy (chosen reward strictly above the rejected one) and the margin (chosen - rejected).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

logger = logging.getLogger(__name__)

DPOLossType = Literal["sigmoid", "ipo"]


def sequence_logprobs(token_logprobs: Tensor, mask: Tensor, *, average: bool = False) -> Tensor:
    """Sum (or mean) of token log-probs over the real tokens of each row.

    Args:
        token_logprobs: (N, R) log-probs of the response tokens.
        mask: (N, R) 1 for the response tokens that count (not the prompt, not padding).
        average: divide by the number of real tokens (IPO, SimPO-style length normalization).

    Returns:
        (N,); 0 for an all-masked row.
    """
    if token_logprobs.shape != mask.shape or token_logprobs.ndim != 2:
        raise ValueError(
            f"token_logprobs {tuple(token_logprobs.shape)} and mask {tuple(mask.shape)} must both be (N, R)"
        )
    weights = mask.to(token_logprobs.dtype)
    total = (token_logprobs * weights).sum(dim=-1)
    return total / weights.sum(dim=-1).clamp(min=1.0) if average else total


def dpo_sigmoid_losses(logits: Tensor, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """Per-pair (conservative) DPO loss from ``h = policy log-ratio - reference log-ratio``: (N,) -> (N,)."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5); got {label_smoothing}")
    loss = -F.logsigmoid(beta * logits) * (1.0 - label_smoothing)
    if label_smoothing > 0.0:
        loss = loss - F.logsigmoid(-beta * logits) * label_smoothing
    return loss


def ipo_losses(logits: Tensor, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """Per-pair IPO loss ``(h - 1/(2 beta))^2``: (N,) -> (N,); label smoothing does not apply."""
    if label_smoothing != 0.0:
        raise ValueError(f"label_smoothing applies to the sigmoid loss only; got {label_smoothing} with ipo")
    return (logits - 1.0 / (2.0 * beta)) ** 2


DPO_LOSSES: dict[str, Callable[..., Tensor]] = {"sigmoid": dpo_sigmoid_losses, "ipo": ipo_losses}
"""DPO loss type -> ``fn(logits (N,), *, beta, label_smoothing) -> (N,)``."""
DPO_LOSS_TYPES: tuple[str, ...] = get_args(DPOLossType)


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    num_pairs: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The DPO loss over a batch of preference pairs, and its metrics.

    Args:
        policy_chosen, policy_rejected: (N,) sequence log-probs under the policy (with grad).
        ref_chosen, ref_rejected: (N,) the same under the reference (no grad).
        beta: inverse temperature of the implicit reward (> 0).
        loss_type: ``sigmoid`` or ``ipo`` (see :data:`DPO_LOSSES`).
        label_smoothing: conservative-DPO flip probability in [0, 0.5) (sigmoid only).
        num_pairs: divisor of the summed per-pair losses; defaults to N. Pass the whole batch's
            count when these are one micro-batch of it, so micro-batch losses sum to the batch loss.
        weights: (N,) per-pair weights (1 counts, 0 ignores: a rank's padding copies); metrics are
            then weighted means. None: every pair counts.

    Returns:
        the scalar loss, and detached scalar metrics (means over these N pairs): ``chosen_reward``
        ``beta * (pi_c - ref_c)``, ``rejected_reward``, ``accuracy`` (chosen reward > rejected one)
        and ``margin`` (chosen reward - rejected reward).
    """
    n = policy_chosen.shape[0]
    others = {"policy_rejected": policy_rejected, "ref_chosen": ref_chosen, "ref_rejected": ref_rejected}
    for name, t in others.items():
        if policy_chosen.ndim != 1 or t.shape != policy_chosen.shape:
            raise ValueError(
                f"policy_chosen {tuple(policy_chosen.shape)} and {name} {tuple(t.shape)} must both be (N,)"
            )
    if beta <= 0.0:
        raise ValueError(f"beta must be > 0; got {beta}")
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}; got {loss_type!r}")
    chosen_logratio = policy_chosen - ref_chosen
    rejected_logratio = policy_rejected - ref_rejected
    logits = chosen_logratio - rejected_logratio
    losses = DPO_LOSSES[loss_type](logits, beta=beta, label_smoothing=label_smoothing)
    if weights is not None:
        losses = losses * weights
    counted = float(n) if weights is None else float(weights.sum().item())
    loss = losses.sum() / (max(counted, 1.0) if num_pairs is None else num_pairs)
    with torch.no_grad():
        chosen_reward = beta * chosen_logratio
        rejected_reward = beta * rejected_logratio
        per_pair = {
            "chosen_reward": chosen_reward,
            "rejected_reward": rejected_reward,
            "accuracy": (chosen_reward > rejected_reward).to(chosen_reward.dtype),
            "margin": chosen_reward - rejected_reward,
        }
        if weights is not None:
            per_pair = {k: v * weights for k, v in per_pair.items()}
        metrics = {k: v.sum() / max(counted, 1.0) for k, v in per_pair.items()}
    return loss, metrics
