"""Overlong shaping (DAPO, Yu et al., 2025): what a step does with answers that run into the cap.

An answer cut at the response cap ``L`` (``update.response_cap``, the controller's
``max_response_length``) carries no verdict on its content, and rewarding or punishing it by the
content rule alone teaches noise. DAPO's two remedies, each off by default:

- **soft overlong penalty** (``overlong_buffer: B > 0``): a sample of ``|y|`` tokens gets::

      penalty = -overlong_penalty * clamp((|y| - (L - B)) / B, 0, 1)

  added to its score before the advantages: 0 up to ``L - B`` tokens, falling linearly to
  ``-overlong_penalty`` at the cap;
- **overlong filtering** (``mask_truncated``): a sample cut at the cap (``L`` tokens, the last not a
  stop token) gives no loss: its row of the batch's ``loss_mask`` (:data:`rlfleet.trainer.policy.LOSS_MASK`)
  is zero, while the model still reads it whole and its score counts in its group's baseline.

Each step reports ``overlong/truncated_frac`` (samples cut at the cap), and with the penalty on
``overlong/penalty_mean``, with the filter on ``overlong/masked_frac``.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.trainer import UpdateSettings
from rlfleet.trainer.policy import LOSS_MASK


def truncated(response_ids: Tensor, response_mask: Tensor, cap: int, stop_ids: Tensor) -> Tensor:
    """(N,) bool: samples of ``cap`` tokens or more whose last token is not one of ``stop_ids``."""
    lengths = response_mask.sum(dim=-1)
    last = response_ids.gather(1, (lengths - 1).clamp(min=0)[:, None])[:, 0]
    return (lengths >= cap) & ~torch.isin(last, stop_ids.to(last.device))


def length_penalty(lengths: Tensor, cap: int, buffer: int, penalty: float) -> Tensor:
    """(N,) float: DAPO's soft overlong penalty of each length (see the module docstring)."""
    over = (lengths.float() - (cap - buffer)) / buffer
    return -penalty * over.clamp(0.0, 1.0)


def shape(
    batch: Mapping[str, Tensor], scores: Tensor, update: UpdateSettings, stop_ids: Tensor
) -> tuple[dict[str, Tensor], Tensor, dict[str, float]]:
    """The batch (its response mask zeroed on filtered samples), the scores with the penalty, metrics."""
    cap = update.response_cap
    if cap is None:
        reason = "overlong shaping needs the responses' length cap (the controller sends max_response_length)"
        raise ConfigError("update.response_cap", None, reason)
    if update.overlong_buffer > cap:
        raise ConfigError("update.overlong_buffer", update.overlong_buffer, f"longer than the cap ({cap})")
    mask = batch["response_mask"]
    cut = truncated(batch["response_ids"], mask, cap, stop_ids)
    out, metrics = dict(batch), {"overlong/truncated_frac": float(cut.float().mean().item())}
    if update.overlong_buffer > 0:
        penalty = length_penalty(mask.sum(dim=-1), cap, update.overlong_buffer, update.overlong_penalty)
        scores = scores + penalty.to(scores.device, scores.dtype)
        metrics["overlong/penalty_mean"] = float(penalty.mean().item())
    if update.mask_truncated:
        kept = batch.get(LOSS_MASK, mask)  # a multi-turn batch's own mask (its observations) stays
        out[LOSS_MASK] = kept * (~cut).to(kept.dtype)[:, None]  # attention still reads them whole
        metrics["overlong/masked_frac"] = metrics["overlong/truncated_frac"]
    return out, scores, metrics
