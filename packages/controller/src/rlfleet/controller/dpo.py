"""``DPOTrainer``: direct preference optimization on a file of (prompt, chosen, rejected) pairs.

DPO is offline: no rollout tier, no reward tier, no weight publishing. The run starts only the
trainer; each step the controller tokenizes a batch of pairs, puts it in its own TensorStore and
sends the trainer a ref to it, the trainer fetches it (the preference-batch contract of
``rlfleet.trainer.dpo_update``), computes the reference log-probs and takes its steps::

    pairs file ──PreferenceDataset──> batch ──collate──> controller TensorStore ──ref──┐
                                                                                     v
                                       metrics <── trainer.step(algorithm="dpo") ◄───┘

``rollout_batch_size`` pairs make one step; ``train_batch_size`` pairs one optimizer update.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import PromptItem
from rlfleet.controller.launcher import WorkerSpec
from rlfleet.controller.loop import StepLoop
from rlfleet.controller.preference import PreferenceDataset

logger = logging.getLogger(__name__)


def dpo_config(config: TrainerConfig) -> TrainerConfig:
    """``config`` with ``algorithm='dpo'``; an explicitly different algorithm is a mistake."""
    if config.algorithm == "dpo":
        return config
    if "algorithm" in config.model_fields_set:
        raise ValueError(f"DPOTrainer trains dpo but the config sets algorithm={config.algorithm!r}")
    return type(config).model_validate({**config.model_dump(), "algorithm": "dpo"})


class DPOTrainer(StepLoop):
    """DPO over a trainer tier alone; ``dataset`` is a :class:`PreferenceDataset` or a path to pairs."""

    uses_rollouts = False

    def __init__(
        self,
        actor_model_name: str,
        dataset: PreferenceDataset | str | Path,
        config: TrainerConfig | None = None,
    ) -> None:
        config = dpo_config(config or TrainerConfig())
        if not isinstance(dataset, PreferenceDataset):
            dataset = PreferenceDataset(
                dataset, max_prompt_length=config.max_prompt_length,
                max_response_length=config.max_response_length, seed=config.seed,
            )  # fmt: skip
        super().__init__(actor_model_name, None, dataset, config)
        self.preferences: PreferenceDataset = dataset

    def tier_counts(self) -> dict[str, int]:
        return {"trainer": 1}

    def worker_specs(self) -> list[WorkerSpec]:
        """Only the trainer: DPO neither generates nor scores."""
        return [spec for spec in super().worker_specs() if spec.tier == "trainer"]

    async def _step(self, batch: list[PromptItem]) -> dict[str, float]:
        cfg = self.config
        store = await self.own_store()
        t0 = time.perf_counter()
        key = f"dpo/{self.cluster}/{self.global_step + 1}"
        ref = store.put_local(key, self.preferences.collate(batch))
        hyper: dict[str, Any] = {"num_updates": cfg.rollout_batch_size // cfg.train_batch_size}
        try:
            stepped = await self.fleet.train_step(self.global_step + 1, [ref], [], hyper, algorithm="dpo")
        finally:
            store.delete(key)
        metrics = dict(stepped.metrics)
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics
