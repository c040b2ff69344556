"""``FleetRun``: one training run, everything the trainers share.

It resolves the model, binds the dataset to its tokenizer, brings up the fleet (its own
nats-server or ``nats_url``'s; each tier a local process, Ray-placed with ``launcher: ray``, or,
with ``nats_url`` alone, started elsewhere), tells the trainer the run's fixed settings, drives a
step program over the dataset's seeded epochs on its own event loop (so users train with plain
synchronous calls), logs metrics, saves and resumes checkpoints, and stops exactly what it started::

    start():  launcher.spawn(worker specs) ─► connect ─► wait_ready ─► reward tier ─► trainer.configure
              ─► resume_from? ─► "before" eval (run_eval.py)
    steps():  for each batch: program.step(batch) ─► metrics ─► sinks / [PROGRESS] ─► checkpoint?
              (a crashed worker: restarted, the step run again; the trainer: restored from the
              latest checkpoint, the steps after it run again; see supervision.py)
    finish(): final HF export ─► "after" eval, samples.md;  close(): leave, stop every started process

A step program (:class:`StepProgram`: online RL or DPO) writes one step against the run's
``fleet``, ``store``, ``kl_controller`` and :meth:`FleetRun.publish`.
"""

from __future__ import annotations

import logging
import math
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from rlfleet.common.atomic_files import write_atomic
from rlfleet.common.control.messages import TrainerConfigure, WeightsLoaded, WeightsPublished
from rlfleet.common.schema.algorithms import ALGORITHMS
from rlfleet.common.schema.connection import NatsConnection, mask_url
from rlfleet.common.schema.trainer import model_fingerprint
from rlfleet.controller.checkpoints import read_checkpoint_state, resolve_resume, write_checkpoint_state
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import PromptDataset, PromptItem
from rlfleet.controller.errors import TierNotReady
from rlfleet.controller.fleet import Fleet
from rlfleet.controller.launcher import EmbeddedFleet, WorkerSpec
from rlfleet.controller.launcher_settings import build_launcher
from rlfleet.controller.loggers import RunMetrics
from rlfleet.controller.models import resolve_model
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.rollout_scaling import scale_due
from rlfleet.controller.run_eval import RunEval
from rlfleet.controller.run_reward import RunReward, attach_reward
from rlfleet.controller.run_tokenizer import load_run_tokenizer
from rlfleet.controller.step_program import KLController, StepProgram, StepResult
from rlfleet.controller.supervision import GuardedLoop, SupervisedFleet, Supervisor
from rlfleet.controller.watchdog import Watchdog
from rlfleet.controller.worker_configs import tier_counts, worker_specs

logger = logging.getLogger(__name__)


class FleetRun:
    """A run: its model, data, fleet, event loop, own TensorStore, KL controller, metrics and checkpoints."""

    def __init__(
        self, model_name: str, dataset: PromptDataset, config: TrainerConfig, *, kl_controller: KLController,
        reward: Any = None, critic_model_name: str | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.output_dir = Path(config.output_dir)
        self.resume_path = resolve_resume(config.resume_from, self.output_dir)
        """The checkpoint the run continues from (a bad ``resume_from`` fails here, before anything runs)."""
        self.metrics = RunMetrics(config.loggers, self.output_dir, config.masked_dump(), config.log_every)
        spec = ALGORITHMS[config.algorithm]
        self.online = spec.online
        """Whether the run generates and scores (rollout and reward tiers); False for DPO."""
        self.kl_controller = kl_controller
        """The KL coefficient of each step (built from the config's KL fields by the trainer)."""
        self.reward = RunReward.of(reward, config) if spec.online else None
        self.global_step = 0
        self.weight_version = 0
        self.epoch = 0
        self.model_path = resolve_model(model_name, seed=config.seed)
        critic = critic_model_name or config.critic_model_name
        self.critic_path = resolve_model(critic, seed=config.seed) if critic else self.model_path
        """The critic's backbone (PPO): the named model, else the actor's checkpoint."""
        self.tokenizer = load_run_tokenizer(self.model_path, trust_remote_code=config.trust_remote_code,
                                            chat_template=config.chat_template)  # fmt: skip
        dataset.bind_tokenizer(self.tokenizer)
        self.dataset = dataset
        self.cluster = config.cluster or f"run-{uuid.uuid4().hex[:8]}"
        self.launcher: EmbeddedFleet | None = None
        self.loop = GuardedLoop(lambda: self.launcher)
        self.supervisor = Supervisor(self)
        self.store = OwnStore(config, listen_all=config.nats_url is not None)
        self.publish_dtype = config.publish_dtype()
        """The dtype weights are published in, fixed by the engines' dtype when the run is made."""
        self.transport: Any = None
        self._fleet: Fleet | None = None
        self.evals = RunEval(self) if self.online and (config.sample_table_size or config.eval_data) else None

    # --- what a trainer exposes ------------------------------------------------------------------

    @property
    def kl_coef(self) -> float:
        """The KL coefficient of the next step (the KL controller's value)."""
        return self.kl_controller.value

    @kl_coef.setter
    def kl_coef(self, value: float) -> None:
        value = float(value)
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"kl_coef must be a finite number >= 0, got {value}")
        self.kl_controller.value = value

    @property
    def fleet(self) -> Fleet:
        if self._fleet is None:
            raise RuntimeError("the fleet is not started; call start() or train() first")
        return self._fleet

    @property
    def process_ids(self) -> list[int]:
        """Pids of the processes this run started and has not stopped (embedded runs only)."""
        return self.launcher.pids if self.launcher is not None else []

    @property
    def nats_url(self) -> str:
        """The control plane this run uses (embedded: its private nats-server)."""
        if self.launcher is not None:
            return self.launcher.url
        if self.config.nats_url is None:
            raise RuntimeError("the fleet is not started; call start() or train() first")
        return self.config.nats_url

    # --- start -----------------------------------------------------------------------------------

    def worker_specs(self) -> list[WorkerSpec]:
        """The processes an embedded run starts, each with its validated worker config."""
        spec = self.reward.worker_spec if self.reward is not None else None
        critic = self.critic_path if ALGORITHMS[self.config.algorithm].needs_critic else None
        return worker_specs(self.config, self.model_path, self.cluster, online=self.online, reward_spec=spec,
                            critic_path=critic)  # fmt: skip

    def trainer_configure(self) -> TrainerConfigure:
        """The run's fixed trainer settings, as the trainer is told them before the first step."""
        cfg = self.config
        return TrainerConfigure(model=cfg.model_settings(), device=cfg.device,
                                critic=ALGORITHMS[cfg.algorithm].needs_critic,
                                model_fingerprint=model_fingerprint(self.model_path))  # fmt: skip

    def start(self) -> None:
        """Bring up the fleet and resume from ``resume_from`` (idempotent)."""
        if self._fleet is not None:
            return
        cfg = self.config
        self.output_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(self.output_dir / "config.yaml", self.resolved_config_yaml())
        try:
            url, auth, env = cfg.nats_url, cfg.nats_auth, None
            if url is None or cfg.launcher == "ray":  # ray with nats_url: tiers placed, on that server
                specs = self.worker_specs()  # ray: the job must fit its cluster before anything starts
                self.launcher = build_launcher(cfg, self.output_dir / "fleet", specs)  # embedded or ray
                self.supervisor.attach(self.launcher)
                if url is None:
                    url = self.launcher.start_nats(self.cluster)
                    auth, env = self.launcher.connection("controller"), {}  # not the shell's RLFLEET_NATS_*
                    self._write_join_config(url)
                for spec in specs:
                    self.launcher.spawn(spec)
            self.loop.run(self._connect(url, auth, env))
            if self.resume_path is not None:
                self.resume(self.resume_path)
            if self.evals is not None:  # the held-out eval (eval_data) and the before/after table
                self.loop.run(self.evals.capture("before"))
        except BaseException:
            self.close()
            raise

    @property
    def join_config(self) -> Path:
        """An embedded run's config file for a rollout worker that joins it (``rlfleet-rollout serve
        --config FILE --model PATH --pool NAME``): the URL, cluster and the rollout role's credential
        (readable by this user only)."""
        return self.output_dir / "fleet" / "join-rollout.yaml"

    def _write_join_config(self, url: str) -> None:
        """``join-rollout.yaml`` (the rollout role's login) and ``status.yaml`` (the observer's, for
        ``rlfleet status --run OUTPUT_DIR``) of the run's own server, readable by this user only."""
        assert self.launcher is not None
        self.join_config.parent.mkdir(parents=True, exist_ok=True)
        status = self.join_config.parent / "status.yaml"
        for role, path in (("rollout", self.join_config), ("observer", status)):
            auth = self.launcher.connection(role)
            password = auth.password.get_secret_value()
            login = {"user": auth.user, "password": password, "inbox_prefix": auth.inbox_prefix}
            data = {"nats_url": url, "cluster": self.cluster, "nats_auth": login}
            write_atomic(path, yaml.safe_dump(data, sort_keys=False), mode=0o600)

    async def _connect(self, url: str, auth: NatsConnection, env: dict[str, str] | None = None) -> None:
        from rlfleet.common.control.nats_transport import NatsTransport

        cfg = self.config
        self.transport = await NatsTransport.connect(
            url, name="rlfleet-controller", tier="controller", auth=auth, env=env,
            outage_grace_s=cfg.faults.outage_grace_s,
        )  # fmt: skip
        self.watchdog = Watchdog(cfg.faults.stall_report_s)  # names a worker that owes a result too long
        fleet = SupervisedFleet(self.watchdog.watch(self.transport), self.cluster,
                                request_timeout=cfg.request_timeout_s,
                                dead_after=cfg.faults.dead_after_s, faults=cfg.faults)  # fmt: skip
        self.watchdog.attach(fleet.registry)
        await fleet.start()
        self._fleet = fleet
        counts = tier_counts(cfg, self.online, self.reward is not None and self.reward.python is None)
        try:
            await fleet.wait_ready(counts, cfg.startup_timeout_s)
        except TimeoutError as exc:
            raise self.not_ready(fleet, str(exc)) from None
        if self.online:
            await attach_reward(fleet, cfg, url, self)  # the run's own reward tier, or reward_url's
        await fleet.configure_trainer(self.trainer_configure())
        if cfg.nats_url is None:
            logger.info("fleet ready: %s; rollout workers join with: rlfleet-rollout serve --config %s "
                        "--model PATH --pool NAME", counts, self.join_config)  # fmt: skip
        else:
            logger.info("fleet ready: %s; rollout workers join with: rlfleet-rollout serve --model PATH "
                        "--nats %s --cluster %s --pool NAME", counts, mask_url(url),
                        self.cluster)  # fmt: skip

    def not_ready(self, fleet: Fleet, detail: str) -> TierNotReady:
        """Name the started workers that never announced (or just the tiers, when joining a cluster)."""
        missing: list[str] = []
        if self.launcher is not None:
            missing = [
                worker.describe()
                for worker in self.launcher.workers
                if fleet.registry.get(worker.spec.tier, worker.spec.worker_id) is None
            ]
        return TierNotReady(self.config.startup_timeout_s, missing, detail)

    def describe_worker(self, worker_id: str) -> str:
        """A started worker's id, pid, state and log (just its id when this run did not start it)."""
        for worker in self.launcher.workers if self.launcher is not None else []:
            if worker.spec.worker_id == worker_id:
                return worker.describe()
        return worker_id

    def resolved_config_yaml(self) -> str:
        data = {
            "model_path": str(self.model_path),
            "reward": self.reward.spec if self.reward is not None else None,
            "dataset": str(getattr(self.dataset, "data_path", "")),
            **self.config.masked_dump(),
        }
        return yaml.safe_dump(data, sort_keys=False)

    # --- steps -----------------------------------------------------------------------------------

    async def publish(self, weight_version: int = -1) -> tuple[WeightsPublished, list[WeightsLoaded]]:
        """Publish the trainer's weights (as ``weight_version``; -1: the next) and have every rollout
        worker load them; the run then generates at that version."""
        cfg = self.config
        published = await self.fleet.publish_weights(
            cfg.weight_bucket_mb, weight_version, carrier=cfg.weight_carrier, dtype=self.publish_dtype
        )
        loaded = await self.fleet.load_weights(published)
        self.weight_version = published.weight_version
        return published, loaded

    def total_steps(self, num_epochs: int, max_steps: int | None) -> int:
        total = self.dataset.steps_per_epoch(self.config.rollout_batch_size) * num_epochs
        return min(total, max_steps) if max_steps else total

    def steps(self, program: StepProgram, num_epochs: int, max_steps: int | None) -> Iterator[StepResult]:
        """Run ``program`` one step at a time. A worker's crash is survived where the supervisor can
        (:mod:`rlfleet.controller.supervision`: a trainer restored from a checkpoint rewinds the
        run, whose steps after it come again); a failed step (a worker lost for good, Ctrl-C) stops
        the fleet before the error reaches the caller; leaving the loop early keeps it running."""
        self.start()
        total = self.total_steps(num_epochs, max_steps)
        self.metrics.begin(total, num_epochs)
        rewound = True
        while rewound:
            rewound = False
            for epoch, batch in self._batches(num_epochs):
                if self.global_step >= total:
                    return
                try:
                    if self.config.rollout_scale:  # the job's schedule, before the step it names
                        scale_due(self)
                    metrics = self.supervisor.run_step(program, batch)
                    if metrics is None:  # the trainer was restored from a checkpoint: go on from there
                        rewound = True
                        break
                    self.global_step += 1
                    self.epoch = epoch
                    rewound = self.supervisor.guard(self._record, epoch + 1, metrics) is None
                except BaseException:  # re-raised: only makes sure no process outlives a failed run
                    self.close()
                    raise
                if rewound:
                    break
                routes = dict(program.last_routes)
                yield StepResult(self.global_step, epoch + 1, metrics, self.weight_version, routes=routes)

    def _batches(self, num_epochs: int) -> Iterator[tuple[int, list[PromptItem]]]:
        """``(epoch, batch)`` from the dataset's position on (a rewind moves the position back)."""
        for epoch in range(self.epoch, num_epochs):
            for batch in self.dataset.batches(self.config.rollout_batch_size, epoch=epoch):
                yield epoch, batch

    def _record(self, epoch: int, metrics: dict[str, float]) -> bool:
        """Log a step's metrics; save a checkpoint, run the held-out eval when due."""
        step = self.global_step
        metrics["epoch"] = float(epoch)
        reward = getattr(self._fleet, "reward", None)  # a RewardControl once an online fleet is up
        if reward is not None:
            metrics.update(reward.step_metrics(step))  # the reward version, and whether it changed
        self.metrics.log(step, epoch, metrics)
        if self.evals is not None and self.evals.due(step):
            self.loop.run(self.evals.capture(f"step-{step}"))
        if self.config.save_every and step % self.config.save_every == 0:
            self.save_checkpoint(self.output_dir / f"checkpoint-{step}")
        return True

    # --- checkpoints -----------------------------------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Save the actor in HF format (loadable with ``AutoModelForCausalLM.from_pretrained``)."""
        return Path(self.loop.run(self.fleet.save(str(Path(path).resolve()))))

    def save_checkpoint(self, path: Path) -> Path:
        """Have the trainer write its full state in ``path``, then write the controller's state."""
        root = path.resolve()
        self.loop.run(self.fleet.save(str(root), mode="full"))
        state: dict[str, Any] = {
            "global_step": self.global_step,
            "epoch": self.dataset.epoch,
            "dataset": self.dataset.state_dict(),
            "kl_controller": self.kl_controller.state_dict(),
            "weight_version": self.weight_version,
        }
        if self.reward is not None:
            state.update(self.loop.run(self.reward.checkpoint_state(self.fleet.reward)))
        write_checkpoint_state(root, state)
        logger.info("checkpoint of step %d saved to %s", self.global_step, root)
        return root

    def resume(self, path: Path, weight_version: int | None = None) -> None:
        """Restore the trainer from ``path``, republish its weights, restore the controller's position.

        The weights go out as the checkpoint's version, or as ``weight_version`` (a trainer restored
        mid-run: a new version, so that no worker takes them for the ones it holds)."""
        state = read_checkpoint_state(path)
        version = int(state["weight_version"]) if weight_version is None else weight_version
        self.loop.run(self._restore_tiers(path.resolve(), version))
        self.dataset.load_state_dict(state["dataset"])
        self.kl_controller.load_state_dict(state["kl_controller"])
        self.global_step = int(state["global_step"])
        self.weight_version = version
        self.epoch = int(state["epoch"])
        if self.reward is not None:
            self.loop.run(self.reward.restore(self.fleet.reward, state))
        logger.info("resumed from %s at step %d (weight version %d)", path, self.global_step, version)

    async def _restore_tiers(self, path: Path, version: int) -> None:
        await self.fleet.load_checkpoint(str(path), version)
        if self.online:
            await self.publish(version)

    # --- the end ---------------------------------------------------------------------------------

    def finish(self) -> None:
        """Final checkpoint and the before/after table."""
        final = self.save(self.output_dir / "final")
        if self.evals is not None:
            self.loop.run(self.evals.capture("after"))
            self.evals.write(self.metrics.say)
        self.metrics.say(f"final model saved to {final}")

    def close(self) -> None:
        """Stop the fleet this run started and release everything (idempotent).

        The processes are stopped whatever else fails on the way out.
        """
        try:
            fleet, transport = self._fleet, self.transport
            self._fleet = self.transport = None
            self.loop.shutdown(lambda: self._leave(fleet, transport))  # no task left to write metrics
            self.metrics.close()
        finally:
            launcher, self.launcher = self.launcher, None
            if launcher is not None:
                launcher.stop()
            self.loop.close()

    async def _leave(self, fleet: Fleet | None, transport: Any) -> None:
        await self.store.stop()
        if transport is not None:
            if fleet is not None:
                await fleet.close()
            await transport.close()
