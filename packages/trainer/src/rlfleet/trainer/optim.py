"""The optimizer the actor and the critic share: AdamW with linear warm-up, and one clipped step.

Under FSDP2 the gradient norm comes back as a replicated DTensor (the norm over every shard); it
is made a plain tensor so that every rank takes the same decision. A non-finite norm skips the
parameter update (logged) but still advances the schedule and counts the step.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Sequence

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from rlfleet.trainer.config import OptimizerConfig

logger = logging.getLogger(__name__)


def build_optimizer(
    params: Iterable[nn.Parameter], optim: OptimizerConfig
) -> tuple[torch.optim.AdamW, torch.optim.lr_scheduler.LambdaLR]:
    """AdamW over ``params`` and its schedule: linear warm-up over ``optim.warmup_steps``, then flat."""
    optimizer = torch.optim.AdamW(
        list(params), lr=optim.lr, betas=optim.betas, eps=optim.eps, weight_decay=optim.weight_decay
    )
    warmup = optim.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0
    )
    return optimizer, scheduler


def clipped_step(
    params: Sequence[nn.Parameter],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    max_grad_norm: float | None,
    *,
    what: str,
) -> tuple[float, float]:
    """Clip the accumulated gradient of ``params``, step the optimizer and schedule, zero the gradient.

    ``what`` names the model in the log line of a skipped update. Returns the gradient norm before
    clipping and the learning rate this step used.
    """
    limit = float("inf") if max_grad_norm is None else max_grad_norm
    grad_norm = torch.nn.utils.clip_grad_norm_(params, limit)
    if isinstance(grad_norm, DTensor):  # FSDP: the norm over all shards, as a replicated DTensor
        grad_norm = grad_norm.full_tensor()
    lr = float(optimizer.param_groups[0]["lr"])
    if torch.isfinite(grad_norm):
        optimizer.step()
    else:
        logger.warning("%s: gradient norm is %s; parameter update skipped", what, grad_norm)
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    return float(grad_norm.item()), lr


def mean_over_steps(per_step: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each metric averaged over the optimizer steps of an update, plus ``num_optimizer_steps``."""
    averaged = {key: sum(step[key] for step in per_step) / len(per_step) for key in per_step[0]}
    averaged["num_optimizer_steps"] = float(len(per_step))
    return averaged
