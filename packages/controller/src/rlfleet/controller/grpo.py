"""``GRPOTrainer``: the single controller's GRPO loop, usable as a library.

One step, as the controller runs it (the controller moves refs, never tensors)::

    prompts ──► fleet.generate ──► rollout refs ──► fleet.score ──► scores
                                        │                              │
                                        └──────► fleet.train_step ◄────┘ ──► metrics
    rollout workers ◄── fleet.load_weights ◄── fleet.publish_weights (version + 1)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from rlfleet.common.messages import SamplingParams
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import PromptDataset, PromptItem
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


class GRPOTrainer(FleetRunner):
    """Group Relative Policy Optimization over the rlfleet tiers.

    ``reward`` is a reward spec string of rlfleet-reward (``"concise:max_words=50 + 0.5*relevance"``)
    or its dict form. ``dataset`` is a :class:`PromptDataset` or a path to one.
    """

    def __init__(
        self,
        actor_model_name: str,
        reward: str | dict[str, Any],
        dataset: PromptDataset | str,
        config: TrainerConfig | None = None,
    ) -> None:
        super().__init__(actor_model_name, reward, dataset, config or TrainerConfig())

    # --- the step -------------------------------------------------------------------------

    def _sampling(self, greedy: bool = False) -> SamplingParams:
        cfg = self.config
        return SamplingParams(
            n=1 if greedy else cfg.group_size,
            temperature=0.0 if greedy else cfg.temperature,
            top_p=cfg.rollout.top_p,
            top_k=cfg.rollout.top_k,
            max_tokens=cfg.max_response_length,
            seed=cfg.seed + self.global_step,
        )

    async def _step(self, batch: list[PromptItem]) -> dict[str, float]:
        cfg = self.config
        fleet = self.fleet
        t0 = time.perf_counter()
        results = await fleet.generate([it.token_ids for it in batch], self._sampling(), self.weight_version)
        t1 = time.perf_counter()
        metadata = self._chunk_metadata(batch, results)
        scored = await fleet.score(results, metadata, cfg.reward_endpoint)
        scores = [s for result in scored for s in result.scores]
        t2 = time.perf_counter()
        hyper = {
            "kl_coef": self.kl_coef,
            "group_size": cfg.group_size,
            "num_updates": cfg.rollout_batch_size // cfg.train_batch_size,
        }
        stepped = await fleet.train_step(self.global_step + 1, [r.ref for r in results], scores, hyper)
        t3 = time.perf_counter()
        published = await fleet.publish_weights(cfg.weight_bucket_mb)
        loaded = await fleet.load_weights(published)
        self.weight_version = published.weight_version
        t4 = time.perf_counter()
        await self._release(results)
        metrics = dict(stepped.metrics)
        metrics.update(_reward_metrics(scores, scored))
        generated = sum(r.num_tokens for r in results)
        metrics.update({
            "weight_version": float(self.weight_version),
            "rollout/weight_version_min": float(min(r.weight_version for r in loaded)),
            "rollout/load_s_max": max(r.seconds for r in loaded),
            "kl_coef": float(self.kl_coef),
            "time/generate_s": t1 - t0,
            "time/score_s": t2 - t1,
            "time/train_s": t3 - t2,
            "time/publish_s": t4 - t3,
            "time/step_s": t4 - t0,
            "throughput/gen_tok_s": generated / max(t1 - t0, 1e-9),
            "publish/mb": published.nbytes / 2**20,
            "publish/mb_s": published.nbytes / 2**20 / max(published.seconds, 1e-9),
        })  # fmt: skip
        return metrics

    @staticmethod
    def _chunk_metadata(batch: list[PromptItem], results: list[Any]) -> list[list[dict[str, Any]]]:
        """Per-prompt metadata, split the way the fleet split the prompts (contiguous chunks)."""
        out: list[list[dict[str, Any]]] = []
        start = 0
        for result in results:
            out.append([dict(item.metadata) for item in batch[start : start + result.num_prompts]])
            start += result.num_prompts
        return out

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
                yield StepResult(self.global_step, epoch + 1, metrics, self.weight_version)

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


def _reward_metrics(scores: list[float], scored: list[Any]) -> dict[str, float]:
    import statistics

    metrics = {
        "reward/mean": statistics.fmean(scores),
        "reward/std": statistics.pstdev(scores) if len(scores) > 1 else 0.0,
        "reward/max": max(scores),
        "reward/min": min(scores),
    }
    names = {name for result in scored for name in result.components}
    for name in sorted(names):
        values = [v for result in scored for v in result.components.get(name, [])]
        if values:
            metrics[f"reward/{name}"] = statistics.fmean(values)
    return metrics
