"""``StepLoop``: the synchronous step loop every controller-side trainer shares (GRPO/PPO/DPO).

A subclass supplies ``_step(batch) -> metrics`` (one async step on one dataset batch); the loop
brings the fleet up, walks the dataset's seeded epochs, records metrics, and stops every process
it started when a step fails, as the user leaves ``train()`` or calls ``close()``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rlfleet.controller.runner import FleetRunner

logger = logging.getLogger(__name__)


@dataclass
class StepResult:
    """What one step produced: its metrics and where it stands."""

    step: int
    epoch: int
    metrics: dict[str, float]
    weight_version: int
    samples: list[dict[str, Any]] = field(default_factory=list)
    routes: dict[str, Any] = field(default_factory=dict)
    """Where the step's prompts went (GRPO/PPO): route -> :class:`rlfleet.controller.routing.RouteSummary`."""


class StepLoop(FleetRunner):
    """A :class:`FleetRunner` that trains in steps of ``rollout_batch_size`` dataset items."""

    async def _step(self, batch: list[Any]) -> dict[str, float]:
        """One training step on ``batch``; returns its metrics."""
        raise NotImplementedError(f"{type(self).__name__} does not define a step")

    def steps(self, num_epochs: int = 1, max_steps: int | None = None) -> Iterator[StepResult]:
        """Run training one step at a time; act between steps (``trainer.kl_coef = ...``).

        A failed step (a worker died, Ctrl-C) stops the fleet before the error reaches the caller;
        leaving the loop early keeps it running for :meth:`finish` and :meth:`close`.
        """
        self.start()
        total = self.total_steps(num_epochs, max_steps)
        self._begin(total, num_epochs)
        cfg = self.config
        for epoch in range(self._epoch, num_epochs):
            for batch in self.dataset.batches(cfg.rollout_batch_size, epoch=epoch):
                if self.global_step >= total:
                    return
                try:
                    metrics = self.run(self._step(batch))
                    self.global_step += 1
                    self._epoch = epoch
                    self._record(self.global_step, epoch + 1, metrics)
                except BaseException:  # re-raised: only makes sure no process outlives a failed run
                    self.close()
                    raise
                routes = dict(getattr(self, "last_routes", {}))
                yield StepResult(self.global_step, epoch + 1, metrics, self.weight_version, routes=routes)

    def train(self, num_epochs: int = 1, max_steps: int | None = None) -> list[StepResult]:
        """Train for ``num_epochs`` (or ``max_steps``), then save the final model and stop the fleet."""
        results: list[StepResult] = []
        try:
            for result in self.steps(num_epochs, max_steps):
                results.append(result)
            self.finish()
        finally:
            self.close()
        return results
