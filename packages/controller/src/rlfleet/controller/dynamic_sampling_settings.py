"""The job's ``dynamic_sampling`` section: ``enabled``, ``max_batches`` (the over-sampling budget),
``min_std``. What a step does with it: :mod:`rlfleet.controller.dynamic_sampling`."""

from __future__ import annotations

from pydantic import Field

from rlfleet.common.schema.config import ConfigModel


class DynamicSamplingSettings(ConfigModel):
    """The job's ``dynamic_sampling`` section (online algorithms that compare a prompt's samples)."""

    enabled: bool = Field(default=False, description="drop groups without a learning signal, sample more")
    max_batches: int = Field(
        default=3, ge=1, le=64,
        description="the over-sampling budget: batches of rollout_batch_size prompts a step may generate "
        "in all (its own and up to max_batches - 1 of the run's next ones)",
    )  # fmt: skip
    min_std: float = Field(
        default=0.0, ge=0.0, allow_inf_nan=False,
        description="a group is kept when the population std of its rewards is above this (0: kept unless "
        "all are equal)",
    )  # fmt: skip
