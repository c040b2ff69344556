"""The learning rate of each step: a schedule (constant, linear or cosine decay) with a linear warm-up.

The job's ``lr_schedule`` section (TRL's ``lr_scheduler_type``, ``warmup_steps``, ``warmup_ratio``)::

    learning_rate: 1.0e-5
    lr_schedule: {type: cosine, warmup_ratio: 0.1, min_lr_ratio: 0.0}

The controller resolves it: every step carries the rate of that step as its ``update.learning_rate``
(the step settings a trainer applies, as before), so no trainer needs to know the schedule, a trainer
restored mid-run gets the right rate with its next step, and a resumed run continues where its
checkpoint stood (the position is the run's step, which the checkpoint keeps). The rate the trainer
used is logged every step as ``lr``. The schedule moves once per run step (one step may hold several
optimizer updates, ``rollout_batch_size / train_batch_size`` times ``ppo_epochs``: they share the
step's rate)::

    warm-up (step s < W):  base * (s + 1) / W          (from base / W up to base; never 0)
    then, over the run's remaining steps (p: 0 at step W, towards 1 at the last step):
      constant:  base
      linear:    base * (m + (1 - m) * (1 - p))
      cosine:    base * (m + (1 - m) * (1 + cos(pi * p)) / 2)

with ``W`` = ``warmup_steps``, or ``ceil(warmup_ratio * total steps)``, and ``m`` = ``min_lr_ratio``.
``p = (s - W) / (total - W)`` never reaches 1 on a step that runs, so the last step's rate is above
``base * m`` (a rate of 0 would be refused by the trainer). Unlike Hugging Face's schedulers, the
first warm-up step does not train at rate 0 (an RL step is too dear to spend on nothing). The total
is the run's steps: ``train(num_epochs, max_steps)``'s (or ``steps()``'s).
"""

from __future__ import annotations

import math
from typing import ClassVar, Literal, Protocol

from pydantic import Field, model_validator

from rlfleet.common.schema.config import ConfigModel
from rlfleet.common.schema.trainer import UpdateSettings

LRScheduleType = Literal["constant", "linear", "cosine"]


class LRSchedule(ConfigModel):
    """``lr_schedule: {type, warmup_steps | warmup_ratio, min_lr_ratio}``: how ``learning_rate`` moves
    over the run (``lr_schedule: cosine`` for short); see :mod:`rlfleet.controller.lr_schedule`."""

    SHORT_FORM: ClassVar[str | None] = "type"

    type: LRScheduleType = Field(
        default="constant",
        description="constant | linear (decay towards min_lr_ratio) | cosine (decay towards min_lr_ratio)",
    )
    warmup_steps: int = Field(
        default=0, ge=0, description="run steps of linear warm-up from learning_rate / warmup_steps (0: none)"
    )
    warmup_ratio: float = Field(
        default=0.0, ge=0.0, lt=1.0, allow_inf_nan=False,
        description="warm-up as a fraction of the run's steps (rounded up); instead of warmup_steps",
    )  # fmt: skip
    min_lr_ratio: float = Field(
        default=0.0, ge=0.0, le=1.0, allow_inf_nan=False,
        description="linear and cosine: the fraction of learning_rate the decay goes towards",
    )  # fmt: skip

    @model_validator(mode="after")
    def _one_warmup(self) -> LRSchedule:
        if self.warmup_steps and self.warmup_ratio:
            raise ValueError("lr_schedule: set warmup_steps or warmup_ratio, not both")
        return self

    def warmup(self, total: int) -> int:
        """The warm-up in steps, for a run of ``total`` steps."""
        return self.warmup_steps or math.ceil(self.warmup_ratio * max(total, 0))

    def factor(self, step: int, total: int) -> float:
        """The fraction of the base rate at ``step`` (0-based) of a run of ``total`` steps (0: unknown,
        no decay); always above 0."""
        warmup = self.warmup(total)
        if step < warmup:
            return (step + 1) / warmup
        if self.type == "constant" or total <= warmup:
            return 1.0
        progress = (min(step, total - 1) - warmup) / (total - warmup)
        decay = 1.0 - progress if self.type == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_lr_ratio + (1.0 - self.min_lr_ratio) * decay


class HasSchedule(Protocol):
    """A run's config, as far as its learning rates go (``TrainerConfig``)."""

    @property
    def update(self) -> UpdateSettings: ...

    @property
    def lr_schedule(self) -> LRSchedule: ...


class LearningRates:
    """The rate of each step of a run with ``config`` (its ``update.learning_rate`` under its
    ``lr_schedule``, both read at each step), over the ``total`` steps the run was asked for (set
    when its steps begin; 0: not known, no decay)."""

    def __init__(self, config: HasSchedule) -> None:
        self.config = config
        self.total = 0

    def at(self, step: int) -> float:
        """The learning rate of the step after ``step`` steps were taken."""
        return self.config.update.learning_rate * self.config.lr_schedule.factor(step, self.total)
