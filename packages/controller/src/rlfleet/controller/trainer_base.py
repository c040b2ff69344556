"""``TrainerBase``: the public handle every trainer shares, over one run and one step program.

A trainer is a :class:`~rlfleet.controller.run.FleetRun` (fleet, loop, store, metrics,
checkpoints) plus the step program of its algorithm family; this class is what users call on it
(``steps()``, ``train()``, ``kl_coef``, ``save()`` ...): the run's state (its
:class:`~rlfleet.controller.ports.RunState`) read-only, and what the run does. ``GRPOTrainer``
and ``PPOTrainer`` add the reward and routing methods of online RL
(:class:`~rlfleet.controller.online.OnlineTrainer`); ``DPOTrainer`` adds nothing.

It also tells the user's callbacks (:mod:`rlfleet.controller.callbacks`) what each step, evaluation
and save brought, as the steps are handed out, and sets the learning-rate schedule's length
(:mod:`rlfleet.controller.lr_schedule`) to the steps asked for.
"""

from __future__ import annotations

from collections.abc import Coroutine, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from rlfleet.controller.callbacks import Callbacks
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import DataSource, PromptDataset, held_out_file
from rlfleet.controller.lr_schedule import LearningRates
from rlfleet.controller.plots import write_run_plots
from rlfleet.controller.ports import FleetClient, StepProgram
from rlfleet.controller.run import FleetRun, StepResult

T = TypeVar("T")


def with_held_out(config: TrainerConfig, eval_dataset: DataSource | None) -> TrainerConfig:
    """``config`` whose held-out evaluation reads ``eval_dataset`` (TRL's ``eval_dataset``: a path, a
    list of dicts or a ``datasets.Dataset``, the rows written to ``output_dir/eval_data.jsonl``, which
    ``config.yaml`` then names); None: ``config`` as it is. Both it and ``eval.data``: an error."""
    if eval_dataset is None:
        return config
    if config.eval.data is not None:
        raise ValueError(f"eval_dataset is given and the config sets eval.data={config.eval.data!r}; set one")
    data = held_out_file(eval_dataset, config.output_dir)
    held_out = {**config.eval.model_dump(exclude_unset=True), "data": data}
    return type(config).model_validate({**dict(config), "eval": held_out})


class TrainerBase:
    """Drives ``program`` over ``fleet_run``: steps, the KL coefficient, saving, shutting down;
    ``rates``: the learning rate of each step (the program's), ``callbacks``: the user's."""

    def __init__(
        self, fleet_run: FleetRun, program: StepProgram, rates: LearningRates | None = None,
        callbacks: Iterable[Any] = (),
    ) -> None:  # fmt: skip
        self.fleet_run = fleet_run
        self.program = program
        self.rates = rates
        self.callbacks = Callbacks(callbacks)
        self._evals_told = 0  # the run's evaluations the callbacks were told of

    def add_callback(self, callback: Any) -> None:
        """Add a callback (TRL's ``add_callback``): see :mod:`rlfleet.controller.callbacks`."""
        self.callbacks.add(callback)

    # --- the run's state ---------------------------------------------------------------------------

    @property
    def config(self) -> TrainerConfig:
        return self.fleet_run.state.config

    @property
    def dataset(self) -> PromptDataset:
        return self.fleet_run.dataset

    @property
    def tokenizer(self) -> Any:
        return self.fleet_run.tokenizer

    @property
    def model_path(self) -> Path:
        """The actor's model directory (a built-in name resolved to one)."""
        return self.fleet_run.model_path

    @property
    def output_dir(self) -> Path:
        return self.fleet_run.state.output_dir

    @property
    def cluster(self) -> str:
        """The run's cluster name (the second token of its NATS subjects)."""
        return self.fleet_run.state.cluster

    @property
    def global_step(self) -> int:
        """Steps taken (a resumed run counts those of the checkpoint)."""
        return self.fleet_run.state.global_step

    @property
    def weight_version(self) -> int:
        """The weight version the rollout workers hold (0 before the first publish)."""
        return self.fleet_run.state.weight_version

    @property
    def kl_coef(self) -> float:
        """The KL-to-reference coefficient of the next step (the KL controller's value); set it between steps.

        Setting it overrides the controller: a fixed one keeps the new value, an adaptive one adapts
        from it, a scheduled one stays pinned to it.
        """
        return self.fleet_run.kl_coef

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        self.fleet_run.kl_coef = value

    @property
    def fleet(self) -> FleetClient:
        """The handle on the tiers (once started)."""
        return self.fleet_run.fleet

    @property
    def process_ids(self) -> list[int]:
        """Pids of the processes this run started and has not stopped (embedded runs only)."""
        return self.fleet_run.process_ids

    @property
    def nats_url(self) -> str:
        """The control plane this run uses (embedded: its private nats-server); standalone workers join
        it with ``rlfleet-rollout serve --nats URL --cluster <trainer.cluster>``."""
        return self.fleet_run.nats_url

    # --- driving it --------------------------------------------------------------------------------

    def start(self) -> None:
        """Bring up the fleet (idempotent; ``steps()`` and ``train()`` call it)."""
        self.fleet_run.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the run's event loop (e.g. one of ``trainer.fleet``'s requests)."""
        return self.fleet_run.loop.run(coro)

    def steps(self, num_epochs: int = 1, max_steps: int | None = None) -> Iterator[StepResult]:
        """Run training one step at a time; act between steps (``trainer.kl_coef = ...``).

        A failed step (a worker died, Ctrl-C) stops the fleet before the error reaches the caller;
        leaving the loop early keeps it running for :meth:`finish` and :meth:`close`.
        """
        if self.rates is not None:  # the schedule runs over the steps asked for
            self.rates.total = self.fleet_run.total_steps(num_epochs, max_steps)
        return self._told(self.fleet_run.steps(self.program, num_epochs, max_steps))

    def _told(self, results: Iterator[StepResult]) -> Iterator[StepResult]:
        """``results``, each step's callbacks called before it is handed out (its metrics, then the
        evaluations and the checkpoint it brought)."""
        try:
            for result in results:
                self.callbacks.step_end(result.step, result.metrics)
                self._tell_evaluations()
                every = self.config.save_every
                if every and result.step % every == 0:  # the run saved one (FleetRun._record)
                    self.callbacks.save(result.step, self.output_dir / f"checkpoint-{result.step}")
                yield result
        finally:
            close = getattr(results, "close", None)
            if close is not None:  # left early: the run puts back the batches it took ahead
                close()

    def _tell_evaluations(self) -> None:
        """Tell the callbacks of the evaluations the run recorded since the last call."""
        evals = self.fleet_run.evals
        records = evals.records if evals is not None else []
        for record in records[self._evals_told :]:
            self.callbacks.evaluate(int(record["step"]), record["summary"])
        self._evals_told = len(records)

    def train(self, num_epochs: int = 1, max_steps: int | None = None) -> list[StepResult]:
        """Train for ``num_epochs`` (or ``max_steps``), then save the final model and stop the fleet."""
        try:
            results = list(self.steps(num_epochs, max_steps))
            self.finish()
        finally:
            self.close()
        return results

    def save(self, path: str | Path) -> Path:
        """Save the actor in HF format (loadable with ``AutoModelForCausalLM.from_pretrained``)."""
        saved = self.fleet_run.save(path)
        self.callbacks.save(self.global_step, saved)
        return saved

    def finish(self) -> None:
        """Final checkpoint, the before/after table and held-out eval, the run's plots (PNG)."""
        self.fleet_run.finish()
        self.callbacks.save(self.global_step, (self.output_dir / "final").resolve())
        self._tell_evaluations()
        write_run_plots(self.output_dir, self.fleet_run.metrics.say)  # a failed plot only warns

    def close(self) -> None:
        """Stop the fleet this run started and release everything (idempotent)."""
        self.fleet_run.close()

    def __enter__(self) -> TrainerBase:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
