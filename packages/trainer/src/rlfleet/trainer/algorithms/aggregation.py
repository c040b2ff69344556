"""Reducing a per-token quantity (N, R) over a response mask to one scalar.

Three modes, named as in verl:

- ``token-mean`` (default, DAPO): sum over every real token of the batch / number of real tokens;
  every token weighs the same, so long responses weigh more.
- ``seq-mean-token-sum``: sum over each sequence's tokens, then mean over sequences (Dr. GRPO
  without its constant normalizer).
- ``seq-mean-token-mean``: mean over each sequence's tokens, then mean over sequences (original
  GRPO); every sequence weighs the same.

For gradient accumulation the divisor must be the one of the whole (mini-)batch, not of each
micro-batch: pass ``num_tokens`` (token-mean) or ``num_seqs`` (seq-mean-*) of the whole batch and
the micro-batch results then *sum* to the full-batch value exactly.
"""

from __future__ import annotations

import logging
from typing import Literal, get_args

from torch import Tensor

from rlfleet.common.errors import ConfigError

logger = logging.getLogger(__name__)

LossAgg = Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"]
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
