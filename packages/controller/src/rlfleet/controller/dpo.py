"""``DPOTrainer``: direct preference optimization on a file of (prompt, chosen, rejected) pairs.

DPO is offline: no rollout tier, no reward tier, no weight publishing. The run starts only the
trainer; each step the controller tokenizes a batch of pairs, puts it in its own TensorStore and
sends the trainer a ref to it, the trainer fetches it (the preference-batch contract of
``rlfleet.common.schema.batch``), computes the reference log-probs and takes its steps::

    pairs file ──PreferenceDataset──> batch ──collate──> controller TensorStore ──ref──┐
                                                                                     v
                   metrics <── trainer.step(settings: algorithm dpo, beta, ...) ◄────┘

``rollout_batch_size`` pairs make one step; ``train_batch_size`` pairs one optimizer update.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from typing import Any

from rlfleet.common.schema.algorithms import ALGORITHMS
from rlfleet.common.schema.trainer import StepSettings
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import DataSource, PromptItem
from rlfleet.controller.lr_schedule import LearningRates
from rlfleet.controller.online import build_kl_controller
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.ports import FleetClient, KLController, RunState
from rlfleet.controller.preference import PreferenceDataset
from rlfleet.controller.run import FleetRun
from rlfleet.controller.trainer_base import TrainerBase


def dpo_config(config: TrainerConfig) -> TrainerConfig:
    """``config`` with an offline algorithm (one that trains on preference pairs: ``dpo`` unless it
    names another); an online algorithm set explicitly is a mistake."""
    name = config.algorithm.name
    if not ALGORITHMS[name].online:
        return config
    if "name" in config.algorithm.model_fields_set:
        raise ValueError(f"DPOTrainer trains dpo but the config sets algorithm={name!r}")
    algorithm = {**config.algorithm.model_dump(exclude_unset=True), "name": "dpo"}  # its other settings kept
    return type(config).model_validate({**dict(config), "algorithm": algorithm})


class DPOStep:
    """The DPO step program: a batch of ``pairs`` travels from the controller's own ``store`` to the
    trainer, at ``state``'s step (the steps carry ``kl_controller``'s coefficient, which DPO's loss
    does not use)."""

    def __init__(
        self, state: RunState, store: OwnStore, kl_controller: KLController, pairs: PreferenceDataset,
        rates: LearningRates | None = None,
    ) -> None:  # fmt: skip
        self.state = state
        self.rates = rates or LearningRates(state.config)  # each step's learning rate (lr_schedule)
        self.store = store
        self.kl_controller = kl_controller
        self.pairs = pairs
        self.last_routes: dict[str, Any] = {}  # DPO generates nothing: no routes
        self.spare_batches = self.extra_batches = 0  # every step trains its own batch

    async def step(
        self, batch: list[PromptItem], fleet: FleetClient, upcoming: Sequence[list[PromptItem]] = ()
    ) -> dict[str, float]:
        state = self.state
        store = await self.store.get()
        t0 = time.perf_counter()
        key = f"dpo/{state.cluster}/{state.global_step + 1}"
        ref = store.put_local(key, self.pairs.collate(batch))
        settings = StepSettings.of(state.config, kl_coef=self.kl_controller.value,
                                   learning_rate=self.rates.at(state.global_step))  # fmt: skip
        try:
            stepped = await fleet.train_step(state.global_step + 1, [ref], [], settings)
        finally:
            store.delete(ref.key)
        metrics = dict(stepped.metrics)
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics


class DPOTrainer(TrainerBase):
    """DPO over a trainer tier alone; ``dataset`` is a :class:`PreferenceDataset`, a path to pairs, a
    list of dicts or a ``datasets.Dataset``; ``callbacks`` as :mod:`rlfleet.controller.callbacks`."""

    def __init__(
        self,
        actor_model_name: str,
        dataset: PreferenceDataset | DataSource,
        config: TrainerConfig | None = None,
        *,
        callbacks: Iterable[Any] = (),
    ) -> None:
        config = dpo_config(config or TrainerConfig())
        if not isinstance(dataset, PreferenceDataset):
            dataset = PreferenceDataset(
                dataset, max_prompt_length=config.max_prompt_length,
                max_response_length=config.max_response_length, seed=config.placement.seed,
            )  # fmt: skip
        # the steps carry its coefficient, which DPO's loss does not use
        kl_controller = build_kl_controller(config.kl, config.update.kl_coef)
        fleet_run = FleetRun(actor_model_name, dataset, config, kl_controller=kl_controller)
        rates = LearningRates(config)
        program = DPOStep(fleet_run.state, fleet_run.store, fleet_run.kl_controller, dataset, rates)
        super().__init__(fleet_run, program, rates, callbacks)
        self.preferences: PreferenceDataset = dataset
