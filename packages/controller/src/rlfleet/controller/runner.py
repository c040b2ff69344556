"""``FleetRunner``: what every controller-side trainer shares.

It resolves the model, binds the dataset to its tokenizer, brings up the fleet (embedded:
a private nats-server and each tier as a process; cluster: joins ``nats_url``), runs the
async steps on its own event loop so users drive training with plain synchronous calls, logs
metrics, saves the final checkpoint and stops exactly what it started.
"""

from __future__ import annotations

import asyncio
import logging
import math
import uuid
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import yaml

from rlfleet.common.kl_control import build_kl_controller
from rlfleet.controller.checkpoints import resolve_resume, resume_run, save_run_checkpoint
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import PromptDataset
from rlfleet.controller.errors import TierDied, TierNotReady
from rlfleet.controller.fleet import Fleet
from rlfleet.controller.launcher import EmbeddedFleet, WorkerSpec, trainer_rank_specs
from rlfleet.controller.loggers import ConsoleProgress, MetricSink, check_loggers, make_sinks
from rlfleet.controller.models import resolve_model
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.reward_control import RewardControls, attach_reward
from rlfleet.controller.samples import SampleTable

logger = logging.getLogger(__name__)
T = TypeVar("T")



class FleetRunner(RewardControls, OwnStore):
    """Base of the RL trainers: fleet lifecycle, event loop, metrics and checkpoints."""

    uses_rollouts: bool = True
    """Whether the run has rollout and reward tiers (False for offline algorithms such as DPO)."""

    def __init__(
        self, actor_model_name: str, reward: str | dict[str, Any] | None, dataset: PromptDataset | str,
        config: TrainerConfig,
    ) -> None:  # fmt: skip
        check_loggers(config.loggers)  # before anything starts: a missing package fails in a second
        self.config = config
        self.kl_controller = build_kl_controller(config.kl_control(config.kl_coef))
        self.reward_spec = reward
        self.initial_reward_spec = reward  # reward_spec follows set_reward_fn; a resume compares the two
        self.global_step = 0
        self.weight_version = 0
        self._epoch = 0
        self.output_dir = Path(config.output_dir)
        self.model_path = resolve_model(actor_model_name, seed=config.seed)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(str(self.model_path))
        if isinstance(dataset, (str, Path)):
            dataset = PromptDataset(
                str(dataset), max_prompt_length=config.max_prompt_length, seed=config.seed
            )
        dataset.bind_tokenizer(self.tokenizer)
        self.dataset = dataset
        self.cluster = config.cluster or f"run-{uuid.uuid4().hex[:8]}"
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._launcher: EmbeddedFleet | None = None
        self._transport: Any = None
        self._fleet: Fleet | None = None
        self._sinks: list[MetricSink] = []
        self._progress: ConsoleProgress | None = None
        self._table: SampleTable | None = None
        self._store = None  # the controller's own TensorStore (OwnStore), started on first use

    @property
    def kl_coef(self) -> float:
        """The KL-to-reference coefficient of the next step (the KL controller's value); set it between steps.

        Setting it overrides the controller: a fixed one keeps the new value, an adaptive one adapts
        from it, a scheduled one stays pinned to it.
        """
        return self.kl_controller.value

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"kl_coef must be a finite number >= 0, got {value}")
        self.kl_controller.value = value

    @property
    def process_ids(self) -> list[int]:
        """Pids of the processes this run started and has not stopped (embedded runs only)."""
        return self._launcher.pids if self._launcher is not None else []

    @property
    def nats_url(self) -> str:
        """The control plane this run uses (embedded: its private nats-server); standalone workers join
        it with ``rlfleet-rollout serve --nats URL --cluster <config.cluster>``."""
        if self._launcher is not None:
            return self._launcher.url
        if self.config.nats_url is None:
            raise RuntimeError("the fleet is not started; call start() or train() first")
        return self.config.nats_url

    # --- lifecycle ------------------------------------------------------------------------

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:
            raise RuntimeError("the fleet is not started; call start() or train() first")
        return self._fleet

    def start(self) -> None:
        """Bring up the fleet (idempotent)."""
        if self._fleet is not None:
            return
        cfg = self.config
        self.output_dir.mkdir(parents=True, exist_ok=True)
        (self.output_dir / "config.yaml").write_text(self.resolved_config_yaml())
        try:
            url = cfg.nats_url
            if url is None:
                self._launcher = EmbeddedFleet(self.output_dir / "fleet")
                url = self._launcher.start_nats()
                for spec in self.worker_specs():
                    self._launcher.spawn(spec)
            self.run(self._connect(url))
            resume = resolve_resume(cfg.resume_from, self.output_dir)
            if resume is not None:
                resume_run(self, resume)
            if cfg.sample_table_size and self.uses_rollouts:
                self._table = SampleTable(self, self.dataset.sample_items(cfg.sample_table_size))
                self.run(self._table.capture("before"))
        except BaseException:
            self.close()
            raise

    async def _connect(self, url: str) -> None:
        from rlfleet.common.nats_transport import NatsTransport

        self._transport = await NatsTransport.connect(url, name="rlfleet-controller", tier="controller")
        fleet = Fleet(self._transport, self.cluster, request_timeout=self.config.request_timeout_s)
        await fleet.start()
        self._fleet = fleet
        try:
            await fleet.wait_ready(self.tier_counts(), self.config.startup_timeout_s)
        except TimeoutError as exc:
            raise self._not_ready(fleet, str(exc)) from None
        await attach_reward(fleet, self.config, url)  # the run's own reward tier, or reward_url's
        logger.info("fleet ready: %s; rollout workers join with: rlfleet-rollout serve --model PATH "
                    "--nats %s --cluster %s --pool NAME", self.tier_counts(), url, self.cluster)  # fmt: skip

    def _not_ready(self, fleet: Fleet, detail: str) -> TierNotReady:
        """Name the started workers that never announced (or just the tiers, when joining a cluster)."""
        missing: list[str] = []
        if self._launcher is not None:
            missing = [
                worker.describe()
                for worker in self._launcher.workers
                if fleet.registry.get(worker.spec.tier, worker.spec.worker_id) is None
            ]
        return TierNotReady(self.config.startup_timeout_s, missing, detail)

    def tier_counts(self) -> dict[str, int]:
        reward = 0 if self.config.reward_url else 1  # a shared reward server is waited for on its own
        return {"rollout": sum(self.config.pool_sizes().values()), "reward": reward, "trainer": 1}

    def worker_specs(self) -> list[WorkerSpec]:
        """The processes an embedded run starts."""
        cfg = self.config
        common = {"cluster": self.cluster}
        specs = [
            *trainer_rank_specs({**common, **self.trainer_worker_config()}, cfg.num_train_workers),
            WorkerSpec(
                "reward", "reward-0", {**common, "endpoints": {cfg.reward_endpoint: self.reward_spec}}
            ),
        ]
        if cfg.reward_url:  # scores go to the shared reward server: no reward worker of our own
            specs = [s for s in specs if s.tier != "reward"]
        specs += self.rollout_specs(common)
        return specs

    def rollout_specs(self, common: dict[str, Any]) -> list[WorkerSpec]:
        """A rollout worker per slot of each pool: ``rollout-<i>``, or ``rollout-<pool>-<i>`` with pools."""
        cfg = self.config
        specs: list[WorkerSpec] = []
        for pool, size in cfg.pool_sizes().items():
            overrides = cfg.rollout_pools[pool] if cfg.rollout_pools else None
            for i in range(size):
                settings = {
                    **common, "pool": pool, "model_path": str(self.model_path), "engine": cfg.rollout.engine,
                    "dtype": cfg.rollout.dtype, "max_batch_size": cfg.rollout.max_batch_size,
                    "seed": cfg.seed + len(specs), "device": cfg.device, **self.rollout_engine_config(),
                }  # fmt: skip
                if overrides is not None:
                    settings.update(overrides.model_dump(exclude={"workers"}, exclude_none=True))
                name = f"rollout-{i}" if overrides is None else f"rollout-{pool}-{i}"
                specs.append(WorkerSpec("rollout", name, settings))
        return specs

    def rollout_engine_config(self) -> dict[str, Any]:
        """The vLLM settings of a rollout worker (the HF engine ignores them)."""
        r = self.config.rollout
        return {"tensor_parallel_size": r.tensor_parallel_size, "enforce_eager": r.enforce_eager,
                "gpu_memory_utilization": r.gpu_memory_utilization, "colocate": r.colocate,
                "sleep_level": r.sleep_level, "cache_policy": self.config.rollout_cache_policy,
                "max_cache_len": self.config.rollout_max_cache_len}  # fmt: skip

    def trainer_worker_config(self) -> dict[str, Any]:
        cfg = self.config
        keys = (
            "learning_rate", "weight_decay", "micro_batch_size", "max_grad_norm", "clip_eps", "kl_coef",
            "entropy_coef", "loss_agg", "ppo_epochs", "temperature", "seed", "algorithm", "device",
            "mixed_precision", "trainable_layers", "sharding",
        )  # fmt: skip
        return {"model_path": str(self.model_path), **{k: getattr(cfg, k) for k in keys},
                "algo": cfg.trainer_algo_settings()}  # fmt: skip

    def resolved_config_yaml(self) -> str:
        data = {
            "model_path": str(self.model_path),
            "reward": self.reward_spec,
            "dataset": str(getattr(self.dataset, "data_path", "")),
            **self.config.model_dump(mode="json"),
        }
        return yaml.safe_dump(data, sort_keys=False)

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run a coroutine on the controller's loop, failing fast if a worker process dies."""
        if self._loop is None or self._loop.is_closed():
            self._loop = asyncio.new_event_loop()
        task = self._loop.create_task(self._guarded(coro))
        self._tasks.add(task)  # kept if Ctrl-C leaves it pending, so close() can cancel it
        result = self._loop.run_until_complete(task)
        self._tasks.discard(task)
        return result

    async def _guarded(self, coro: Coroutine[Any, Any, T]) -> T:
        """Await ``coro`` while watching the processes this run started.

        A dead process ends the wait within a quarter second with :class:`TierDied`; a request that
        fails because its worker died is reported as that death, not as the request's own error.
        """
        task = asyncio.ensure_future(coro)
        try:
            self._check_processes()
            while not task.done():
                await asyncio.wait({task}, timeout=0.25)
                self._check_processes()
        finally:
            if not task.done():
                task.cancel()
            await asyncio.gather(task, return_exceptions=True)  # also when Ctrl-C left it failed
        error = None if task.cancelled() else task.exception()
        if error is not None and self._launcher is not None:
            try:
                for _ in range(10):  # a worker's sockets close a moment before its exit is visible
                    self._check_processes()
                    await asyncio.sleep(0.1)
            except TierDied as died:
                raise died from error
        return task.result()

    def _check_processes(self) -> None:
        if self._launcher is not None:
            self._launcher.check()

    # --- metrics --------------------------------------------------------------------------

    def total_steps(self, num_epochs: int, max_steps: int | None) -> int:
        per_epoch = self.dataset.steps_per_epoch(self.config.rollout_batch_size)
        total = per_epoch * num_epochs
        return min(total, max_steps) if max_steps else total

    def _begin(self, total: int, num_epochs: int) -> None:
        if self._progress is None:
            self._progress = ConsoleProgress(total, num_epochs, self.config.log_every,
                                             enabled="console" in self.config.loggers)  # fmt: skip
            self._sinks = make_sinks(
                self.config.loggers, self.output_dir, self.config.model_dump(mode="json")
            )

    def _record(self, step: int, epoch: int, metrics: dict[str, float]) -> None:
        metrics["epoch"] = float(epoch)
        reward = getattr(self._fleet, "reward", None)  # a RewardControl once the fleet is up
        if reward is not None:
            metrics.update(reward.step_metrics(step))  # the reward version, and whether it changed
        for sink in self._sinks:
            sink.log(step, metrics)
        if self._progress is not None:
            self._progress.update(step, epoch, metrics)
        if self.config.save_every and step % self.config.save_every == 0:
            save_run_checkpoint(self, self.output_dir / f"checkpoint-{step}")

    def save(self, path: str | Path) -> Path:
        """Save the actor in HF format (loadable with ``AutoModelForCausalLM.from_pretrained``)."""
        return Path(self.run(self.fleet.save(str(Path(path).resolve()))))

    def finish(self) -> None:
        """Final checkpoint and the before/after table."""
        final = self.save(self.output_dir / "final")
        if self._table is not None:
            self.run(self._table.capture("after"))
            text = self._table.render()
            (self.output_dir / "samples.md").write_text(text)
            self._say(text)
        self._say(f"final model saved to {final}")

    def _say(self, text: str) -> None:
        if self._progress is not None:
            self._progress.write(text)
        else:
            print(text, flush=True)

    def close(self) -> None:
        """Stop the fleet this run started and release everything (idempotent).

        The processes are stopped whatever else fails on the way out.
        """
        try:
            for sink in self._sinks:
                sink.close()
            self._sinks = []
            if self._progress is not None:
                self._progress.close()
                self._progress = None
            self._stop_store()
            self._disconnect()
        finally:
            launcher, self._launcher = self._launcher, None
            if launcher is not None:
                launcher.stop()
            if self._loop is not None and not self._loop.is_closed():
                self._loop.close()

    def _disconnect(self) -> None:
        """Cancel what a Ctrl-C left running, leave the control plane, cancel what is left."""
        loop = self._loop
        fleet, transport = self._fleet, self._transport
        self._fleet = self._transport = None
        if loop is None or loop.is_closed():
            return
        self._cancel(loop, list(self._tasks))
        self._tasks.clear()
        if transport is not None:
            try:
                loop.run_until_complete(asyncio.wait_for(_leave(fleet, transport), timeout=10.0))
            except (ConnectionError, RuntimeError, TimeoutError) as exc:
                logger.debug("transport close: %s", exc)
        self._cancel(loop, list(asyncio.all_tasks(loop)))

    @staticmethod
    def _cancel(loop: asyncio.AbstractEventLoop, tasks: list[asyncio.Task[Any]]) -> None:
        for task in tasks:
            task.cancel()
        if tasks:
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    def __enter__(self) -> FleetRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _leave(fleet: Fleet | None, transport: Any) -> None:
    if fleet is not None:
        await fleet.close()
    await transport.close()
