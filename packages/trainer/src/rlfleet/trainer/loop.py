"""One train step's update: the models' optimizers (AdamW, warm-up, clipped step) and the update loop.

The loop runs the losses it is given and never names an algorithm. An algorithm (one file each in
:mod:`rlfleet.trainer.algorithms`) turns a batch into a :class:`Plan`: one :class:`Objective` per
model it trains (its loss over micro-batches of *items*: samples, or preference pairs) and the
metrics it measured before. :func:`train_loop` runs it::

    for epoch in ppo_epochs:
      for rows in mini-batches of the items (shuffled when there are several):   one optimizer step
        for objective in plan.objectives:            (with a critic: the critic's, then the policy's)
          share = this rank's rows of the mini-batch   (by length, or a prompt's rows together where
                                                        its forward shares prompts; padding copies weigh 0)
          for chunk in share, micro_batch_size at a time:           gradient accumulation
            loss, sums = objective.micro_loss(chunk, weights, divisors of the whole mini-batch)
            (loss * W).backward()      FSDP averages gradients over W ranks: the shares must add
          metrics += sums over ranks; clip, AdamW step, schedule step

Every divisor is the mini-batch's (its tokens, its sequences or pairs), so the micro-batches of
every rank add up to the gradient one process computes on the whole mini-batch.

What the actor and the critic share is a :class:`Trainable`: a model with its AdamW, linear
warm-up and clipped step. The learning rate and weight decay are step settings:
:meth:`Trainable.set_rates` writes a step's values into the optimizer when they differ, keeping
the schedule where it is (the rate becomes the schedule's base rate, so a warm-up goes on from its
current fraction). AdamW's betas and epsilon are no settings; they are :data:`BETAS` and
:data:`EPS`. Under FSDP2 the gradient norm comes back as a replicated DTensor (the norm over every
shard); it is made a plain tensor so that every rank takes the same decision. A non-finite norm
or loss (the loss is summed over ranks, so every rank sees the same one) skips the parameter update
(logged; ``update_skipped`` is 1 for that optimizer step, so the step's metric is the fraction
skipped) but still advances the schedule and counts the step; the non-finite metric is reported as
it is (it travels on the wire) and the run goes on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import ClassVar, Protocol

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from rlfleet.common.schema.trainer import ModelSettings, StepSettings, resolve_precision
from rlfleet.trainer.distributed import DistContext
from rlfleet.trainer.policy import PromptLayout, all_reduce_sum, local_rows

logger = logging.getLogger(__name__)

SHAPE_FREE_SDPA = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""The SDPA kernels a trainer's forwards may use: all but cuDNN's (see :meth:`Trainable.computing`)."""


# --- the models a step trains: AdamW, warm-up, the clipped optimizer step -------------------------

BETAS = (0.9, 0.999)
EPS = 1e-8


def warmup_factor(step: int, warmup_steps: int) -> float:
    """The schedule's factor at optimizer step ``step``: linear from ``1 / warmup_steps`` up to 1, then 1."""
    return min(1.0, (step + 1) / warmup_steps) if warmup_steps > 0 else 1.0


def placement(
    model: ModelSettings | None, dist: DistContext | None, device: str
) -> tuple[ModelSettings, DistContext, bool]:
    """A model's settings (the defaults for None), its ranks (one process on ``device`` for None) and
    whether it computes in bf16 (``mixed_precision``, ``auto`` resolved for the ranks' device)."""
    settings = model if model is not None else ModelSettings()
    dist = dist if dist is not None else DistContext(device=torch.device(device))
    return settings, dist, resolve_precision(settings.mixed_precision, str(dist.device)) == "bf16"


class Trainable:
    """A model on one process, or FSDP2-sharded over ``dist``'s ranks, with its AdamW and schedule.

    A subclass loads (and shards) ``model`` first, then calls this ``__init__``: the optimizer
    takes the parameters that require grad. ``bf16`` turns on bf16 autocast in one process (under
    FSDP the mixed-precision policy casts instead).
    """

    role: ClassVar[str] = "model"
    """Names the model in logs; the critic's metrics are prefixed ``critic/``."""
    metric_prefix: ClassVar[str] = ""

    def __init__(
        self,
        model: nn.Module,
        dist: DistContext,
        *,
        bf16: bool,
        learning_rate: float,
        weight_decay: float,
        warmup_steps: int = 0,
    ) -> None:
        self.model = model
        self.dist = dist
        self.bf16 = bf16
        self.warmup_steps = warmup_steps
        params = [p for p in model.parameters() if p.requires_grad]
        # one process: torch's fused AdamW (one kernel over all parameters; on a CPU 8x faster than
        # the default for a 135M model: 0.04 s a step against 0.35 s). FSDP's sharded parameters keep
        # the default implementation
        self.optimizer = torch.optim.AdamW(
            params, lr=learning_rate, betas=BETAS, eps=EPS, weight_decay=weight_decay,
            fused=not dist.distributed and bool(params) or None,
        )  # fmt: skip
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: warmup_factor(step, warmup_steps)
        )
        self.steps = 0

    @property
    def device(self) -> torch.device:
        """Where the parameters (or this rank's shards of them) live."""
        return self.dist.device if self.dist.distributed else next(self.model.parameters()).device

    @contextmanager
    def computing(self) -> Iterator[None]:
        """How the model's forwards run: bf16 autocast in one process when ``bf16`` (under FSDP the
        mixed-precision policy casts), and attention by any SDPA kernel but cuDNN's.

        cuDNN's kernel builds an execution plan for each new shape, and a trainer's micro-batches
        change shape every time (response lengths, packed prompts). Profiled on an H100 (torch 2.11,
        an update of 32 SmolLM2 answers: ``benchmarks/results/trainer_step_profile_h100.txt``), the
        plans took 0.69 s of the update's 1.68 s of host time (2.2 ms per layer's forward, 3.6 ms
        per backward) while the GPU computed for 57 ms. Flash and memory-efficient attention take
        any shape without a plan; the backward follows the forward's kernel.
        """
        enabled = self.bf16 and not self.dist.distributed
        with (
            torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled),
            sdpa_kernel(SHAPE_FREE_SDPA),
        ):
            yield

    def set_rates(self, learning_rate: float, weight_decay: float) -> None:
        """Use ``learning_rate`` (as the schedule's base rate) and ``weight_decay`` from now on."""
        position = self.scheduler.last_epoch
        for i, group in enumerate(self.optimizer.param_groups):
            if self.scheduler.base_lrs[i] != learning_rate:
                self.scheduler.base_lrs[i] = learning_rate
                group["initial_lr"] = learning_rate
                group["lr"] = learning_rate * warmup_factor(position, self.warmup_steps)
            group["weight_decay"] = weight_decay

    def optimizer_step(self, max_grad_norm: float | None = 1.0, *, loss: float = 0.0) -> dict[str, float]:
        """Clip the accumulated gradient, step AdamW and the schedule, zero the gradient.

        The update is skipped (the schedule still steps) when the gradient norm or ``loss`` (the
        mini-batch's, the same on every rank) is not finite.

        Returns:
            ``grad_norm`` (before clipping), ``lr`` (the rate this step used) and ``update_skipped``
            (1.0 or 0.0), with the class's metric prefix.
        """
        params = [p for p in self.model.parameters() if p.requires_grad]
        limit = float("inf") if max_grad_norm is None else max_grad_norm
        grad_norm = torch.nn.utils.clip_grad_norm_(params, limit)
        if isinstance(grad_norm, DTensor):  # FSDP: the norm over all shards, as a replicated DTensor
            grad_norm = grad_norm.full_tensor()
        lr = float(self.optimizer.param_groups[0]["lr"])
        norm = float(grad_norm.item())
        finite = math.isfinite(norm) and math.isfinite(loss)
        if finite:
            self.optimizer.step()
        else:
            logger.warning("%s step %d: gradient norm %s, loss %s; parameter update skipped", self.role,
                           self.steps, norm, loss)  # fmt: skip
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        prefix = self.metric_prefix
        return {f"{prefix}grad_norm": norm, f"{prefix}lr": lr, f"{prefix}update_skipped": float(not finite)}


# --- the update loop ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Divisors:
    """The whole mini-batch's counts that each micro-batch's loss share divides by.

    Attributes:
        num_tokens: real response tokens of the mini-batch (token-mean), at least 1.
        num_seqs: its items (seq-mean; preference pairs).
        response_width: R, the response width of the whole batch (the constant of
            ``seq-mean-token-sum-norm``).
    """

    num_tokens: float
    num_seqs: float
    response_width: float = 1.0


class Objective(Protocol):
    """One model's loss over the micro-batches of a mini-batch (see the module docstring)."""

    @property
    def trainable(self) -> Trainable:
        """The model (and optimizer) the loss trains."""
        ...

    @property
    def keys(self) -> tuple[str, ...]:
        """Names of the metric sums :meth:`micro_loss` returns, in order."""
        ...

    @property
    def lengths(self) -> Tensor:
        """(N,) token count of each item: rows are dealt out to ranks by it."""
        ...

    @property
    def prompts(self) -> PromptLayout | None:
        """The items' prompts when its forward shares them (one process then keeps a prompt's rows
        in one micro-batch where that costs less, :meth:`PromptLayout.order`); None: length order."""
        ...

    def divisors(self, rows: Tensor) -> Divisors:
        """The divisors of the mini-batch ``rows`` (K,)."""
        ...

    def micro_loss(self, chunk: Tensor, weights: Tensor, divisors: Divisors) -> tuple[Tensor, Tensor]:
        """The loss share (scalar, with grad) of items ``chunk`` (B,) of weights (B,) (0: a rank's padding
        copy), and its metric shares (``len(keys)``,) float64."""
        ...

    def metrics(self, sums: list[float]) -> dict[str, float]:
        """The mini-batch's metrics from the sums over micro-batches and ranks."""
        ...


@dataclass
class Plan:
    """One step's work for :func:`train_loop`, as an algorithm prepared it.

    Attributes:
        objectives: the losses, one per trained model, stepped in this order for every mini-batch.
        settings: the step's settings (epochs, batch sizes, gradient clipping).
        num_items: N, the items (samples or pairs) of the batch.
        generator: shuffles the items between mini-batches; None keeps their order.
        metrics: measured before the steps (response length, KL, advantages...).
        finish: metrics only known after the steps (an on-policy step's old logprobs), or None.
    """

    objectives: Sequence[Objective]
    settings: StepSettings
    num_items: int
    generator: torch.Generator | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    finish: Callable[[], dict[str, float]] | None = None


def batch_sizes(settings: StepSettings, num_items: int) -> tuple[int, int]:
    """``(mini, micro)``: items per optimizer step (the batch in ``batch.num_updates`` parts) and per
    forward/backward (``update.micro_batch_size``, at most a mini-batch when there are several)."""
    updates, micro = settings.batch.num_updates, settings.update.micro_batch_size
    if updates <= 1:
        return num_items, micro
    mini = -(-num_items // updates)
    return mini, min(micro, mini)


def accumulate(objective: Objective, rows: Tensor, micro_batch_size: int) -> dict[str, float]:
    """Add into ``.grad`` the gradient of ``objective``'s loss on the mini-batch ``rows`` (K,).

    ``rows`` is the whole mini-batch, the same on every rank; each rank runs its share of it in
    micro-batches. No optimizer step, no zeroing. Returns the mini-batch's metrics (over all ranks).
    """
    trainable = objective.trainable
    dist = trainable.dist
    rows = rows.to(trainable.device)
    divisors = objective.divisors(rows)
    share = local_rows(
        rows, objective.lengths, dist.rank, dist.world_size, objective.prompts, micro_batch_size
    )
    trainable.model.train()
    sums = torch.zeros(len(objective.keys), dtype=torch.float64, device=trainable.device)
    for chunk, weights in zip(share.rows.split(micro_batch_size), share.weights.split(micro_batch_size),
                              strict=True):  # fmt: skip
        loss, shares = objective.micro_loss(chunk, weights, divisors)
        (loss * dist.world_size if dist.distributed else loss).backward()
        sums += shares.to(sums.device)
    return objective.metrics(all_reduce_sum(sums, dist).tolist())


def train_loop(plan: Plan) -> dict[str, float]:
    """Run ``plan`` (see the module docstring); returns its metrics.

    Returns:
        ``plan.metrics``, the per-step metrics of every objective (and each model's ``grad_norm``
        and ``lr``) averaged over the optimizer steps, ``num_optimizer_steps``, and what
        ``plan.finish`` adds.
    """
    settings, n = plan.settings, plan.num_items
    mini, micro = batch_sizes(settings, n)
    per_step: list[dict[str, float]] = []
    for _ in range(settings.update.ppo_epochs):
        if plan.generator is not None and mini < n:
            order = torch.randperm(n, generator=plan.generator)
        else:
            order = torch.arange(n)
        for rows in order.split(mini):
            step: dict[str, float] = {}
            for objective in plan.objectives:
                measured = accumulate(objective, rows, micro)
                step.update(measured)
                loss = measured[objective.keys[0]]  # the first key is the objective's loss
                step.update(objective.trainable.optimizer_step(settings.update.max_grad_norm, loss=loss))
            per_step.append(step)
    metrics = dict(plan.metrics)
    metrics.update(mean_over_steps(per_step))
    if plan.finish is not None:
        metrics.update(plan.finish())
    return metrics


def mean_over_steps(per_step: Sequence[dict[str, float]]) -> dict[str, float]:
    """Each metric averaged over the optimizer steps of an update, plus ``num_optimizer_steps``."""
    averaged = {key: sum(step[key] for step in per_step) / len(per_step) for key in per_step[0]}
    averaged["num_optimizer_steps"] = float(len(per_step))
    return averaged
