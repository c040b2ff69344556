"""``FleetRun``: one training run, the composition root that builds, starts, loops and closes.

It resolves the model, binds the dataset to its tokenizer, builds the launcher (:func:`build_launcher`)
and brings up the fleet (its own nats-server or ``nats_url``'s; each tier a local process,
Ray-placed with ``launcher: {type: ray}``, or, with ``nats_url`` alone, started elsewhere), tells the
trainer the run's fixed settings, drives a step program over the dataset's seeded epochs on its
own event loop (so users train with plain synchronous calls), logs metrics, saves and resumes
checkpoints, and stops exactly what it started::

    start():  launcher.spawn(worker specs) ─► connect ─► wait_ready ─► reward tier ─► trainer.configure
              ─► resume_from? ─► "before" eval (run_eval.py)
    steps():  for each batch: program.step(batch, fleet, next ones) ─► metrics ─► sinks / [PROGRESS]
              ─► checkpoint?  (max_staleness k: the next k batches generate while it trains)
              (a crashed worker: restarted, the step run again; the trainer: restored from the
              latest checkpoint, the steps after it run again; see supervision.py)
    finish(): final HF export ─► "after" eval, samples.md;  close(): leave, stop every started process

Nothing below imports this module: each helper receives the ports it uses
(:mod:`rlfleet.controller.ports`), and this is where they are wired. The run's position is its
:class:`~rlfleet.controller.ports.RunState` (``run.state``); the helpers that move it on are the
step loop here, :func:`~rlfleet.controller.fleet.publish` and :meth:`FleetRun.resume`::

    Supervisor(state, loop, metrics, checkpoints=run, fleet=..., launcher=...)   supervision.py
    RunEval(state, dataset, tokenizer, store, reward, say).capture(label, fleet)    run_eval.py
    RolloutScaler(state, model_path, launcher, fleet, loop, rejoining)           rollout_scaling.py
    attach_reward(fleet, config, url, reward, store, start_worker)                run_reward.py
    OnlineStep / DPOStep(state, store, kl_controller, ...).step(batch, fleet)     online.py, dpo.py
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import yaml

from rlfleet.common.atomic_files import write_atomic
from rlfleet.common.control.messages import TrainerConfigure
from rlfleet.common.control.transport import Transport
from rlfleet.common.schema.algorithms import ALGORITHMS
from rlfleet.common.schema.connection import NatsConnection, mask_url
from rlfleet.common.schema.trainer import model_fingerprint
from rlfleet.controller.checkpoints import (
    forget_checkpoint_state,
    read_checkpoint_state,
    resolve_resume,
    write_checkpoint_state,
)
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.dataset import PromptDataset, PromptItem
from rlfleet.controller.fleet import publish
from rlfleet.controller.launcher import EmbeddedFleet, WorkerSpec, starting_line
from rlfleet.controller.launcher_settings import RayLauncher, worker_logins
from rlfleet.controller.loggers import RunMetrics
from rlfleet.controller.models import resolve_model
from rlfleet.controller.own_store import OwnStore
from rlfleet.controller.ports import FleetClient, KLController, Launcher, RunState, StepProgram, not_ready
from rlfleet.controller.progress_bars import hide_third_party_bars
from rlfleet.controller.rollout_ahead import BatchLookahead
from rlfleet.controller.rollout_scaling import RolloutScaler, check_request, scale_due
from rlfleet.controller.run_eval import RunEval
from rlfleet.controller.run_reward import RunReward, attach_reward
from rlfleet.controller.run_tokenizer import load_run_tokenizer
from rlfleet.controller.saved_config import data_section, local_or_as_is, saved_job
from rlfleet.controller.supervision import GuardedLoop, SupervisedFleet, Supervisor
from rlfleet.controller.watchdog import Watchdog
from rlfleet.controller.worker_configs import start_reward_worker, tier_counts, worker_specs

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


def build_launcher(config: TrainerConfig, run_dir: Path, specs: Sequence[WorkerSpec] = ()) -> Launcher:
    """The launcher that starts ``config``'s tiers under ``run_dir``: an ``EmbeddedFleet`` or a ``RayFleet``.

    ``specs``: the workers the run will start; a ``RayFleet`` refuses at once a job whose
    reservations its Ray cluster cannot hold, and sizes a local Ray it starts to them."""
    budget, code = config.faults.restart_budget, config.python_path  # code: on every worker's PYTHONPATH
    ray = config.launcher
    if isinstance(ray, RayLauncher):
        from rlfleet.controller.ray_launcher import RayFleet, job_reservation, placement_for

        outside = config.fleet.nats_url  # the controller's login may come from RLFLEET_NATS_*: checked now
        logins = worker_logins(config, config.fleet.nats_auth.resolved()) if outside is not None else {}
        job = job_reservation(config, list(specs)) if specs else None
        fleet = RayFleet(run_dir, address=ray.address, num_cpus=ray.num_cpus, placement=placement_for(config),
                         restart_budget=budget, job=job, start_timeout_s=config.startup_timeout_s,
                         max_restarts=ray.max_restarts, python_path=code)  # fmt: skip
        if outside is not None:
            fleet.join_nats(outside, logins)
        return fleet
    from rlfleet.controller.gpu_assignment import assignment_for

    return EmbeddedFleet(run_dir, restart_budget=budget, gpus=assignment_for(config), python_path=code)


def resumed_line(checkpoint: Path, step: int) -> str:
    """The console's line for a run that continues from ``resume_from``: ``resumed from checkpoint-10
    (step 10; metrics.jsonl and TensorBoard keep steps 1-10)``."""
    kept = f"metrics keep steps 1-{step}" if step > 0 else "no earlier metrics"
    return f"resumed from {checkpoint.name} (step {step}; {kept}; {checkpoint.resolve()})"


class FleetRun:
    """A run: its model, data, fleet, event loop, own TensorStore, KL controller, metrics and checkpoints."""

    def __init__(
        self, model_name: str, dataset: PromptDataset, config: TrainerConfig, *, kl_controller: KLController,
        reward: Any = None, critic_model_name: str | None = None,
    ) -> None:  # fmt: skip
        hide_third_party_bars()  # transformers' loading bars would cut through the console's lines
        self.config = config
        cluster = config.fleet.cluster or f"run-{uuid.uuid4().hex[:8]}"
        self.state = RunState(config, Path(config.output_dir), cluster, publish_dtype=config.publish_dtype())
        """Where the run stands: what every helper reads, and the step loop moves on."""
        self.resume_path = resolve_resume(config.resume_from, self.state.output_dir)
        """The checkpoint the run continues from (a bad ``resume_from`` fails here, before anything runs)."""
        spec = ALGORITHMS[config.algorithm.name]
        kl_off = not spec.online or not spec.uses_reference(config.update.kl_coef)  # no KL term measured
        self.metrics = RunMetrics(
            config.loggers, self.state.output_dir, config.masked_dump(), config.log_every, kl_off=kl_off
        )
        self.online = spec.online
        self.lookahead: BatchLookahead | None = None  # the batches of steps(), some taken ahead
        """Whether the run generates and scores (rollout and reward tiers); False for DPO."""
        self.kl_controller = kl_controller
        """The KL coefficient of each step (built from the config's ``kl`` section by the trainer)."""
        self.reward = RunReward.of(reward, config) if spec.online else None
        self.model_name = model_name
        self.model_path = resolve_model(model_name, seed=config.placement.seed)
        critic = critic_model_name or config.critic_model_name
        self.critic_path = resolve_model(critic, seed=config.placement.seed) if critic else self.model_path
        """The critic's backbone (PPO): the named model, else the actor's checkpoint."""
        self.tokenizer = load_run_tokenizer(self.model_path, trust_remote_code=config.model.trust_remote_code,
                                            chat_template=config.chat_template)  # fmt: skip
        dataset.bind_tokenizer(self.tokenizer)
        self.dataset = dataset
        self.launcher: Launcher | None = None
        self.loop = GuardedLoop(lambda: self.launcher)
        self.store = OwnStore(config.tensor_plane, listen_all=config.fleet.nats_url is not None)
        self.transport: Transport | None = None
        self._fleet: FleetClient | None = None
        self.supervisor = Supervisor(
            self.state, self.loop, self.metrics, self, fleet=lambda: self._fleet,
            launcher=lambda: self.launcher, configure=self.trainer_configure,
        )  # fmt: skip
        self.job: dict[str, Any] | None = None
        """The job file's data (``JobConfig.masked_dump()``) when ``rlfleet train`` built the run:
        what ``config.yaml`` writes; None: the run's config, model, reward and dataset are."""
        self.run_length: tuple[int, int | None] = (1, None)
        """``(num_epochs, max_steps)`` of the training loop, for ``config.yaml``."""
        self.evals = (
            RunEval(self.state, dataset, self.tokenizer, self.store, self.reward, self.metrics.say)
            if self.online and (config.sample_table_size or config.eval.data)
            else None
        )

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
    def fleet(self) -> FleetClient:
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
        if self.config.fleet.nats_url is None:
            raise RuntimeError("the fleet is not started; call start() or train() first")
        return self.config.fleet.nats_url

    # --- start -----------------------------------------------------------------------------------

    def worker_specs(self) -> list[WorkerSpec]:
        """The processes an embedded run starts, each with its validated worker config."""
        spec = self.reward.worker_spec if self.reward is not None else None
        critic = self.critic_path if ALGORITHMS[self.config.algorithm.name].needs_critic else None
        return worker_specs(self.config, self.model_path, self.state.cluster, online=self.online,
                            reward_spec=spec, critic_path=critic)  # fmt: skip

    def trainer_configure(self) -> TrainerConfigure:
        """The run's fixed trainer settings, as the trainer is told them before the first step."""
        cfg = self.config
        return TrainerConfigure(model=cfg.model.model_copy(deep=True), device=cfg.placement.device,
                                critic=ALGORITHMS[cfg.algorithm.name].needs_critic,
                                model_fingerprint=model_fingerprint(self.model_path))  # fmt: skip

    def start(self) -> None:
        """Bring up the fleet and resume from ``resume_from`` (idempotent)."""
        if self._fleet is not None:
            return
        cfg, output_dir = self.config, self.state.output_dir
        output_dir.mkdir(parents=True, exist_ok=True)
        write_atomic(output_dir / "config.yaml", self.resolved_config_yaml())
        try:
            url, auth, env = cfg.fleet.nats_url, cfg.fleet.nats_auth, None
            ray = isinstance(cfg.launcher, RayLauncher)
            if url is None or ray:  # ray with nats_url: tiers placed, on that server
                specs = self.worker_specs()  # ray: the job must fit its cluster before anything starts
                launcher = self.launcher = build_launcher(cfg, output_dir / "fleet", specs)  # embedded or ray
                self.supervisor.attach(launcher)
                if url is None:
                    url = launcher.start_nats(self.state.cluster)
                    auth, env = launcher.connection("controller"), {}  # not the shell's RLFLEET_NATS_*
                    self._write_join_config(launcher, url)
                self.metrics.say(starting_line(specs))
                for spec in specs:
                    launcher.spawn(spec)
            began = time.monotonic()
            self.loop.run(self._connect(url, auth, env))
            self.metrics.say(f"fleet ready after {time.monotonic() - began:.0f} s")
            if self.resume_path is not None:
                self.resume(self.resume_path)
                self.metrics.say(resumed_line(self.resume_path, self.state.global_step))
            if self.evals is not None:  # the held-out eval (eval.data) and the before/after table
                self.loop.run(self.evals.capture("before", self.fleet))
        except BaseException:
            self.close()
            raise

    @property
    def join_config(self) -> Path:
        """An embedded run's config file for a rollout worker that joins it (``rlfleet-rollout serve
        --config FILE --model PATH --pool NAME``): the URL, cluster and the rollout role's credential
        (readable by this user only)."""
        return self.state.output_dir / "fleet" / "join-rollout.yaml"

    def _write_join_config(self, launcher: Launcher, url: str) -> None:
        """``join-rollout.yaml`` (the rollout role's login) and ``status.yaml`` (the observer's, for
        ``rlfleet status --run OUTPUT_DIR``) of the run's own server, readable by this user only."""
        self.join_config.parent.mkdir(parents=True, exist_ok=True)
        status = self.join_config.parent / "status.yaml"
        for role, path in (("rollout", self.join_config), ("observer", status)):
            auth = launcher.connection(role)
            password = auth.password.get_secret_value()
            login = {"user": auth.user, "password": password, "inbox_prefix": auth.inbox_prefix}
            data = {"nats_url": url, "cluster": self.state.cluster, "nats_auth": login}
            write_atomic(path, yaml.safe_dump(data, sort_keys=False), mode=0o600)

    async def _connect(self, url: str, auth: NatsConnection, env: dict[str, str] | None = None) -> None:
        from rlfleet.common.control.nats_transport import NatsTransport

        cfg, cluster = self.config, self.state.cluster
        self.transport = await NatsTransport.connect(
            url, name="rlfleet-controller", tier="controller", auth=auth, env=env,
            outage_grace_s=cfg.faults.outage_grace_s,
        )  # fmt: skip
        self.watchdog = Watchdog(cfg.faults.stall_report_s)  # names a worker that owes a result too long
        fleet = SupervisedFleet(self.watchdog.watch(self.transport), cluster,
                                request_timeout=cfg.request_timeout_s,
                                dead_after=cfg.faults.dead_after_s, faults=cfg.faults)  # fmt: skip
        self.watchdog.attach(fleet.registry)
        await fleet.start()
        self._fleet = fleet
        counts = tier_counts(cfg, self.online, self.reward is not None and self.reward.python is None)
        try:
            await fleet.wait_ready(counts, cfg.startup_timeout_s)
        except TimeoutError as exc:
            raise not_ready(self.launcher, fleet.registry, cfg.startup_timeout_s, str(exc)) from None
        if self.reward is not None:  # the run's own reward tier, or reward.url's
            launcher = self.launcher
            start = partial(start_reward_worker, launcher, fleet.registry, self.state) if launcher else None
            await attach_reward(fleet, cfg, url, self.reward, self.store, start)
        await fleet.configure_trainer(self.trainer_configure())
        if cfg.fleet.nats_url is None:
            logger.info("fleet ready: %s; rollout workers join with: rlfleet-rollout serve --config %s "
                        "--model PATH --pool NAME", counts, self.join_config)  # fmt: skip
        else:
            logger.info("fleet ready: %s; rollout workers join with: rlfleet-rollout serve --model PATH "
                        "--nats %s --cluster %s --pool NAME", counts, mask_url(url), cluster)  # fmt: skip

    def resolved_config_yaml(self) -> str:
        """``config.yaml``: the run as a job file that ``rlfleet train`` runs again (saved_config.py):
        the CLI's job as loaded (:attr:`job`), else the config in its nested form with the model's
        ``name`` (as given) in its section, the reward's ``spec`` (the one the run started with) in
        its, the dataset's ``data`` section and the run's length; and where the model and the data
        resolved to (``model_path``, ``dataset``), credentials left out."""
        job = self.job
        if job is None:
            job = self.config.masked_dump()
            job["model"] = {"name": self.model_name, **job["model"]}
            spec = self.reward.initial_spec if self.reward is not None else None
            job["reward"] = {**job["reward"], "spec": spec}
            num_epochs, max_steps = self.run_length
            job.update(data=data_section(self.dataset), num_epochs=num_epochs, max_steps=max_steps)
        dataset = local_or_as_is(str(getattr(self.dataset, "data_path", "")))
        path = self.state.output_dir / "config.yaml"
        return saved_job(job, model_path=str(self.model_path), dataset=dataset, header_path=path)

    # --- steps -----------------------------------------------------------------------------------

    def total_steps(self, num_epochs: int, max_steps: int | None) -> int:
        total = self.dataset.steps_per_epoch(self.config.batch.rollout_batch_size) * num_epochs
        return min(total, max_steps) if max_steps else total

    def steps(self, program: StepProgram, num_epochs: int, max_steps: int | None) -> Iterator[StepResult]:
        """Run ``program`` one step at a time. A worker's crash is survived where the supervisor can
        (:mod:`rlfleet.controller.supervision`: a trainer restored from a checkpoint rewinds the
        run, whose steps after it come again); a failed step (a worker lost for good, Ctrl-C) stops
        the fleet before the error reaches the caller; leaving the loop early keeps it running."""
        self.run_length = (num_epochs, max_steps)
        if self._fleet is not None:  # started before: config.yaml says the run's length now
            write_atomic(self.state.output_dir / "config.yaml", self.resolved_config_yaml())
        self.start()
        state = self.state
        total = self.total_steps(num_epochs, max_steps)
        self.metrics.begin(total, num_epochs, from_step=state.global_step)  # resumed: the steps before stay
        ahead = self.config.max_staleness if self.online else 0
        rewound = True
        while rewound:
            rewound = False
            self.lookahead = batches = BatchLookahead(self._batches(num_epochs), self.dataset)
            for epoch, batch in batches:
                if state.global_step >= total:
                    return
                try:
                    if self.online and self.config.rollout.scale:  # the job's schedule, before its step
                        for pool, n in scale_due(state, self.launcher).items():
                            self.scale_rollout(pool, n)
                    spare = program.spare_batches  # dynamic sampling's budget: batches past the bound
                    upcoming = batches.peek(min(ahead, total - state.global_step - 1) + spare)
                    metrics = self.supervisor.run_step(program, batch, upcoming)
                    if metrics is None:  # the trainer was restored from a checkpoint: go on from there
                        rewound = True
                        break
                    state.global_step += 1
                    for _ in range(program.extra_batches):  # the step used them: handed out, never again
                        epoch, _ = next(batches)
                    state.epoch = epoch
                    rewound = self.supervisor.guard(self._record, epoch + 1, metrics) is None
                except BaseException:  # re-raised: only makes sure no process outlives a failed run
                    self.close()
                    raise
                if rewound:
                    break
                routes = dict(program.last_routes)
                try:
                    yield StepResult(
                        state.global_step, epoch + 1, metrics, state.weight_version, routes=routes
                    )
                except GeneratorExit:  # the caller left early: the batches taken ahead come again next time
                    self._untake()
                    raise

    def _untake(self) -> None:
        """Put the dataset back to the position after the last batch trained (batches taken ahead of
        it, for a pipelined run, are handed out again; their rollouts in flight are reused)."""
        position = self.lookahead.position() if self.lookahead is not None else None
        if position is not None:
            self.dataset.load_state_dict(position)
        self.lookahead = None

    def dataset_position(self) -> dict[str, int]:
        """The dataset's position after the last batch trained (what a checkpoint saves)."""
        position = self.lookahead.position() if self.lookahead is not None else None
        return position if position is not None else self.dataset.state_dict()

    def _batches(self, num_epochs: int) -> Iterator[tuple[int, list[PromptItem]]]:
        """``(epoch, batch)`` from the dataset's position on (a rewind moves the position back)."""
        for epoch in range(self.state.epoch, num_epochs):
            for batch in self.dataset.batches(self.config.batch.rollout_batch_size, epoch=epoch):
                yield epoch, batch

    def _record(self, epoch: int, metrics: dict[str, float]) -> bool:
        """Log a step's metrics; save a checkpoint, run the held-out eval when due."""
        step = self.state.global_step
        metrics["epoch"] = float(epoch)
        reward = getattr(self._fleet, "reward", None)  # a RewardControl once an online fleet is up
        if reward is not None:
            metrics.update(reward.step_metrics(step))  # the reward version, and whether it changed
        self.metrics.log(step, epoch, metrics)
        if self.evals is not None and self.evals.due(step):
            self.loop.run(self.evals.capture(f"step-{step}", self.fleet))
        if self.config.save_every and step % self.config.save_every == 0:
            self.save_checkpoint(self.state.output_dir / f"checkpoint-{step}")
        return True

    def scale_rollout(self, pool: str, n: int) -> list[str]:
        """Make rollout pool ``pool`` ``n`` workers, between steps (see rollout_scaling.py)."""
        check_request(self.config, self.launcher, pool, n)
        self.start()
        assert self.launcher is not None, "a run with a launcher started it"
        scaler = RolloutScaler(self.state, self.model_path, self.launcher, self.fleet, self.loop,
                               self.supervisor.rejoining)  # fmt: skip
        return scaler.scale(pool, n)

    # --- checkpoints (the run's Checkpoints port) ------------------------------------------------

    def save(self, path: str | Path) -> Path:
        """Save the actor in HF format (loadable with ``AutoModelForCausalLM.from_pretrained``)."""
        return Path(self.loop.run(self.fleet.save(str(Path(path).resolve()))))

    def save_checkpoint(self, path: Path) -> Path:
        """Have the trainer write its full state in ``path``, then write the controller's state."""
        root = path.resolve()
        forget_checkpoint_state(root)
        self.loop.run(self.fleet.save(str(root), mode="full"))
        position = self.dataset_position()  # not past the batches a pipelined run generates ahead
        state: dict[str, Any] = {
            "global_step": self.state.global_step,
            "epoch": position["epoch"],
            "dataset": position,
            "kl_controller": self.kl_controller.state_dict(),
            "weight_version": self.state.weight_version,
        }
        if self.reward is not None:
            state.update(self.loop.run(self.reward.checkpoint_state(self.fleet.reward)))
        write_checkpoint_state(root, state)
        logger.info("checkpoint of step %d saved to %s", self.state.global_step, root)
        return root

    def resume(self, path: Path, weight_version: int | None = None) -> None:
        """Restore the trainer from ``path``, republish its weights, restore the controller's position.

        The weights go out as the checkpoint's version, or as ``weight_version`` (a trainer restored
        mid-run: a new version, so that no worker takes them for the ones it holds)."""
        saved = read_checkpoint_state(path)
        version = int(saved["weight_version"]) if weight_version is None else weight_version
        self.loop.run(self._restore_tiers(path.resolve(), version))
        self.dataset.load_state_dict(saved["dataset"])
        self.kl_controller.load_state_dict(saved["kl_controller"])
        state = self.state
        state.global_step = int(saved["global_step"])
        state.weight_version = version
        state.epoch = int(saved["epoch"])
        if self.reward is not None:
            self.loop.run(self.reward.restore(self.fleet.reward, saved))
        logger.info("resumed from %s at step %d (weight version %d)", path, state.global_step, version)

    async def _restore_tiers(self, path: Path, version: int) -> None:
        await self.fleet.load_checkpoint(str(path), version)
        if self.online:
            await publish(self.fleet, self.state, version)

    # --- the end ---------------------------------------------------------------------------------

    def finish(self) -> None:
        """Final checkpoint and the before/after table."""
        final = self.save(self.state.output_dir / "final")
        if self.evals is not None:
            self.loop.run(self.evals.capture("after", self.fleet))
            self.evals.write()
        elif not self.online and self.config.sample_table_size:  # DPO: its pairs and their margins
            from rlfleet.controller.dpo_samples import write_dpo_samples

            cfg = self.config
            text = write_dpo_samples(self.state.output_dir, self.model_path, self.dataset,
                                     cfg.sample_table_size, cfg.algorithm.beta)  # fmt: skip
            self.metrics.say(text)
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

    async def _leave(self, fleet: FleetClient | None, transport: Transport | None) -> None:
        await self.store.stop()
        if transport is not None:
            if fleet is not None:
                await fleet.close()
            await transport.close()
