"""The Ray launcher (issue 13): every tier as a process placed by Ray, on whichever node Ray picks.

``launcher: {type: ray}`` (with ``address``: ``auto``, ``ray://host:10001``, or empty for a local
Ray started by the run) replaces the embedded launcher's local processes with Ray-placed ones; the
rest of the run (NATS control plane, gRPC tensor plane, supervision, restarts) is the same.

- **Placement.** Each worker runs inside a small Ray actor, :class:`WorkerHost`, which starts the
  tier's console script (``rlfleet-<tier> serve --config ...``) on its node and watches it. The
  actor reserves what the worker needs (:class:`RayPlacement`: CPUs, GPUs, custom resources per
  tier). A trainer's ranks share one placement group (``STRICT_PACK``: one node, so their
  rendezvous is that node's loopback), rank order kept. Ray sets ``CUDA_VISIBLE_DEVICES`` for each
  actor from the GPUs it reserved, and the worker process inherits it, so no two workers share a
  GPU unless asked to (fractional ``num_gpus``).
- **Fit.** Before it places anything, the launcher sums what every worker of the job reserves
  (:func:`job_reservation`: trainer ranks, rollout workers at the most the ``rollout.scale``
  schedule reaches, the reward worker) and refuses a job the cluster cannot hold, in all or on any
  one node (the trainer's placement group on one), with one line naming both sides
  (:class:`~rlfleet.controller.errors.RayJobDoesNotFit`, :mod:`rlfleet.controller.ray_fit`). A
  local Ray started for the run without ``launcher.num_cpus`` gets the machine's CPUs, or as many
  logical CPUs as the job reserves when that is more (the log says so). Each worker's actor, and
  the trainer's placement group, must be placed within ``startup_timeout_s``, or the run stops with
  :class:`~rlfleet.controller.errors.WorkerStartTimeout` naming it, what it reserves and what is free.
- **Addresses.** The run's nats-server listens on every interface of the controller's node and
  its URL names that node's IP (the one Ray reports); every worker's TensorStore listens on every
  interface of its own node and advertises that node's IP. Nothing assumes loopback. A run given
  ``nats_url`` starts no nats-server (:meth:`RayFleet.join_nats`): every worker gets that URL as
  given and its tier's login (``launcher.worker_auth``) in its environment.
- **Supervision.** The launcher keeps the restart policy (``faults.restart_budget``), exactly as
  embedded, through the same member (:class:`~rlfleet.controller.launcher.RunProcesses`: the
  server, the workers, their restarts, ``processes.json``): a worker process that exits is
  reported with its log tail (read through its actor, wherever it runs) and started again in a
  fresh actor, which Ray may place on another node. A worker process that is alive but frozen
  (stopped, hung), which the run's registry declared dead, is killed by its actor and started
  again the same way (:meth:`RayWorkerProcess.kill_declared_dead`).
- **Ray restarts.** A rollout worker's actor is made with ``max_restarts`` (``launcher.max_restarts``):
  when the actor itself dies (its Ray worker process), Ray makes it again and it starts the worker
  again (:mod:`rlfleet.controller.ray_worker_host`), which rejoins at the current weights.
  :meth:`RayFleet.check` tells the run as soon as the actor is down, so the run forgets the dead
  process and waits for the new one, and the launcher does not start a second one; only an actor
  Ray gave up on falls to the restart budget above. Scaling a pool mid-run (``trainer.scale_rollout``,
  :mod:`rlfleet.controller.rollout_scaling`) places its new workers like the others.

Ray is an optional extra (``rlfleet-controller[ray]``): this module imports it only when a Ray
fleet is built, and the embedded default never does.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.connection import NatsConnection
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.errors import RayJobDoesNotFit, TierDied, WorkerStartTimeout
from rlfleet.controller.launcher import (
    NatsSecurity,
    RunProcesses,
    WorkerProcess,
    WorkerSpec,
    find_script,
    run_security,
    tail_of,
    worker_record,
)
from rlfleet.controller.launcher_settings import RayLauncher
from rlfleet.controller.ray_fit import (
    EPSILON,
    JobReservation,
    TierNeed,
    fit_problem,
    local_ray_cpus,
    machine_cpus,
    read_capacity,
)
from rlfleet.controller.ray_worker_host import RemoteProcess as RemoteProcess  # re-exported
from rlfleet.controller.ray_worker_host import WorkerHost as WorkerHost  # re-exported
from rlfleet.controller.ray_worker_host import host_actor_class
from rlfleet.controller.user_code import code_dirs, worker_pythonpath

logger = logging.getLogger(__name__)

RAY_EXTRA = "rlfleet-controller[ray]"

TIER_ORDER = ("trainer", "rollout", "reward")
"""The tiers a job reserves for, in the order messages name them."""


def import_ray(*, local: bool = False) -> Any:
    """``ray``, or a :class:`ConfigError` that says how to install it.

    ``local``: the run starts its own Ray on this machine, whose workers run this very
    interpreter. Ray's ``uv run`` hook (on by default when the driver runs under ``uv run``) would
    instead copy the working directory and build a fresh environment in it for every worker
    (minutes, and gigabytes with torch), so it is switched off (``RAY_ENABLE_UV_RUN_RUNTIME_ENV=0``).
    A cluster the run joins keeps its own settings (its image, or the hook as its operators chose).
    """
    if local:
        os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] = "0"
    try:
        import ray
        from ray._private import ray_constants
    except ImportError:
        raise ConfigError(
            "launcher", "ray", f"the Ray launcher needs Ray: install {RAY_EXTRA} (uv sync --extra ray)"
        ) from None
    if local:  # read when ray.init runs; the variable alone is too late if Ray was imported already
        ray_constants.RAY_ENABLE_UV_RUN_RUNTIME_ENV = False
    return ray


@dataclass(frozen=True)
class TierResources:
    """What one worker of a tier reserves on its Ray node."""

    num_cpus: float = 1.0
    num_gpus: float = 0.0
    resources: dict[str, float] = field(default_factory=dict)

    def options(self) -> dict[str, Any]:
        out: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus}
        if self.resources:
            out["resources"] = dict(self.resources)
        return out

    def bundle(self) -> dict[str, float]:
        """The same, as a placement-group bundle."""
        bundle = {"CPU": self.num_cpus, **self.resources}
        if self.num_gpus:
            bundle["GPU"] = self.num_gpus
        return {k: v for k, v in bundle.items() if v}


@dataclass(frozen=True)
class RayPlacement:
    """Per-tier reservations (``launcher.resources``: ``{tier: {num_cpus, num_gpus, resources}}``)."""

    tiers: dict[str, TierResources] = field(default_factory=dict)

    @classmethod
    def from_settings(cls, settings: dict[str, dict[str, Any]], *, gpus: dict[str, float]) -> RayPlacement:
        """``settings`` over the defaults: one CPU per worker, ``gpus[tier]`` GPUs (0 on CPU)."""
        tiers = {}
        for tier in TIER_ORDER:
            given = dict(settings.get(tier, {}))
            unknown = set(given) - {"num_cpus", "num_gpus", "resources"}
            if unknown:
                raise ConfigError(f"launcher.resources.{tier}", str(sorted(unknown)),
                                  "allowed keys are num_cpus, num_gpus and resources")  # fmt: skip
            tiers[tier] = TierResources(
                num_cpus=float(given.get("num_cpus", 1.0)),
                num_gpus=float(given.get("num_gpus", gpus.get(tier, 0.0))),
                resources={str(k): float(v) for k, v in dict(given.get("resources", {})).items()},
            )
        unknown_tiers = set(settings) - set(tiers)
        if unknown_tiers:
            raise ConfigError(
                "launcher.resources", str(sorted(unknown_tiers)), "tiers are trainer, rollout, reward"
            )
        return cls(tiers)

    def of(self, tier: str) -> TierResources:
        return self.tiers.get(tier, TierResources())


@dataclass
class RayWorkerProcess(WorkerProcess):
    """A worker started through Ray: the embedded launcher's ``WorkerProcess`` (its exit read the
    same way), with the process behind its actor and the node Ray placed it on."""

    node_ip: str = ""
    host: str = ""
    cuda_visible_devices: str = ""
    node_id: str = ""
    actor_pid: int = 0
    ray_restarts_seen: int = 0
    """Ray restarts of its actor the launcher has handled (told the run about)."""
    located_pid: int = 0
    """The process pid whose node the fields above name."""

    def log_tail(self, lines: int = 15) -> str:
        try:
            return str(self.process._call("log_tail", lines))  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - its node is gone; a shared filesystem may still have it
            return tail_of(self.log_path, lines)

    def kill_group(self) -> None:
        self.process.kill_group()  # type: ignore[attr-defined]

    def kill_declared_dead(self, why: str) -> None:
        """Have the actor SIGKILL its frozen process (the actor stays, so the exit and the log are read
        through it); the launcher's next check starts the worker again in a fresh actor."""
        self.declared_dead = why
        self.process.kill_process(self.pid)  # type: ignore[attr-defined]

    def runs_pid(self, pid: int) -> bool:
        """Whether ``pid`` is this worker's process (on its node: no process group to look at here)."""
        return pid > 0 and pid == self.pid

    def describe(self) -> str:
        code = self.process.poll()
        state = "still running" if code is None else f"exited with code {code}"
        where = f"pid {self.pid} on {self.host} {self.node_ip}"
        return f"{self.spec.tier} worker {self.spec.worker_id} ({where}, {state}; log: {self.log_path})"


class RayFleet:
    """A run's fleet with every worker placed by Ray (see the module docstring): a
    :class:`~rlfleet.controller.ports.Launcher` beside the embedded one, sharing its
    :class:`~rlfleet.controller.launcher.RunProcesses`.

    ``address``: ``""`` starts a local Ray for the run (``num_cpus`` logical CPUs, default: the
    machine's, or what ``job`` reserves when that is more), ``auto`` joins the cluster of this node,
    ``ray://host:port`` a remote one. ``job``: what the job's workers reserve; given, a job the
    cluster cannot hold is refused here (:class:`RayJobDoesNotFit`), before anything is placed.
    ``start_timeout_s``: the deadline for each worker's actor to be placed and start its process.
    ``restart_budget``, ``python_path`` and ``security``: as the embedded launcher's.
    """

    def __init__(self, run_dir: Path, *, address: str = "", placement: RayPlacement | None = None,
                 num_cpus: int | None = None, max_restarts: int = 0, job: JobReservation | None = None,
                 start_timeout_s: float = 180.0, restart_budget: int = 0, python_path: Sequence[str] = (),
                 security: NatsSecurity | None = None) -> None:  # fmt: skip
        self.code_dirs = code_dirs(python_path)
        self.processes = RunProcesses(
            Path(run_dir),
            security=run_security(security),
            restart_budget=restart_budget,
            start=self._start,
            record=self._record,
        )
        """The server, the workers, their restarts, ``processes.json`` (as the embedded launcher's)."""
        self.on_restart: Callable[[WorkerProcess, TierDied], None] | None = None
        """Told (in :meth:`check`) of each worker started again, by the launcher or by Ray."""
        self.ray = import_ray(local=not address)
        self.address = address
        self.placement = placement or RayPlacement()
        self.start_timeout_s = start_timeout_s
        self._started_ray = False
        connect = not self.ray.is_initialized()
        if connect:
            self._init_ray(num_cpus, job)
        if job is not None:
            self._check_fit(job, disconnect=connect)
        self.node_ip = str(self.ray.util.get_node_ip_address())
        self._host_class = host_actor_class(self.ray)
        self._restarted_class = host_actor_class(self.ray, max_restarts)  # RAY_RESTARTED_TIERS' workers
        self.max_restarts = max_restarts
        self._groups: dict[str, Any] = {}  # tier -> placement group of its ranks
        self.logins: dict[str, NatsConnection] = {}
        """Each worker tier's login on the outside server (:meth:`join_nats`)."""

    def _init_ray(self, num_cpus: int | None, job: JobReservation | None) -> None:
        """Join the cluster at :attr:`address`, or start a local Ray sized for ``job`` (module docstring)."""
        options: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False}
        if self.address:
            self.ray.init(address=self.address, **options)
            return
        note = ""
        if num_cpus is None and job is not None:
            cores, reserved = machine_cpus(), job.total().get("CPU", 0.0)
            num_cpus = local_ray_cpus(reserved, cores)
            if num_cpus is not None:
                note = (f"local Ray started with {num_cpus} logical CPUs for {cores} cores: "
                        f"the job reserves {reserved:g}")  # fmt: skip
        self.ray.init(num_cpus=num_cpus, **options)
        self._started_ray = True
        if note:
            logger.info("%s", note)

    def _check_fit(self, job: JobReservation, *, disconnect: bool) -> None:
        """Refuse ``job`` (:class:`RayJobDoesNotFit`) when the cluster cannot hold it, first leaving
        a Ray this fleet connected to (``disconnect``; a local one stops); warn when it fits but is
        not all free now (other work holds the rest)."""
        local = not self.address
        where = f"the {'local ' if local else ''}Ray cluster at {self.ray.get_runtime_context().gcs_address}"
        cluster = read_capacity(self.ray, where, local=local)
        problem = fit_problem(job, cluster)
        if problem is not None:
            if disconnect:
                self.ray.shutdown()
                self._started_ray = False
            raise RayJobDoesNotFit(problem, job.total(), cluster.total)
        free = self.ray.available_resources()
        busy = {key: value for key, value in job.total().items() if value > free.get(key, 0.0) + EPSILON}
        if busy:
            logger.warning("%s; %s has only %s free now: its workers wait for the rest (startup_timeout_s)",
                           job.describe(), where, {key: free.get(key, 0.0) for key in busy})  # fmt: skip

    # --- the Launcher port ---------------------------------------------------------------------

    @property
    def workers(self) -> list[WorkerProcess]:
        return self.processes.workers

    @property
    def url(self) -> str:
        """The run's nats-server, named by this node's IP (or the outside server's URL as given)."""
        return self.processes.url

    @property
    def pids(self) -> list[int]:
        """The nats-server's pid and each worker's (on whichever node it runs)."""
        return self.processes.pids

    def start_nats(self, cluster: str = "*") -> str:
        """Start the run's nats-server on every interface of this node; its URL names this node's IP."""
        return self.processes.start_nats(cluster, jetstream=False, host="0.0.0.0", advertise=self.node_ip)

    def join_nats(self, url: str, logins: dict[str, NatsConnection]) -> None:
        """Use the nats-server at ``url`` instead of starting one: each worker gets ``url`` as given
        (it must be routable from every Ray node) and its tier's login in ``logins`` (none: open)."""
        self.processes.join_nats(url)
        self.logins = dict(logins)

    def connection(self, role: str = "controller") -> NatsConnection:
        """How a client of ``role`` connects to the run's own nats-server."""
        return self.processes.connection(role)

    def spawn(self, spec: WorkerSpec) -> WorkerProcess:
        """Place one worker with Ray and start it; supervised from now on."""
        return self.processes.spawn(spec)

    def restart_tier(self, tier: str, died: TierDied) -> list[WorkerProcess]:
        """Stop every process of ``tier`` and start them again, in fresh actors."""
        return self.processes.restart_tier(tier, died)

    def retire(self, workers: Sequence[WorkerProcess]) -> None:
        """Stop supervising ``workers``; the caller stops them."""
        self.processes.retire(workers)

    # --- placing a worker ---------------------------------------------------------------------

    def _start(self, spec: WorkerSpec, restart: int = 0) -> RayWorkerProcess:
        """Place ``spec``'s worker with Ray and start its process there."""
        resources = self.placement.of(spec.tier)
        options = resources.options()
        rank = spec.env.get("RANK")
        if rank is not None:  # a trainer rank: all of them in one placement group, on one node
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

            group = self._rank_group(spec.tier, int(spec.env.get("WORLD_SIZE", "1")), resources)
            options["scheduling_strategy"] = PlacementGroupSchedulingStrategy(
                group, placement_group_bundle_index=int(rank)
            )
        program = list(spec.command) if spec.command else [find_script(spec.script)]
        credentials = self.processes.credentials
        if self.processes.outside_url is not None:
            role = self.logins[spec.tier].env() if spec.tier in self.logins else {}
        else:
            role = credentials.env(spec.tier) if credentials is not None else {}
        env = {"PYTHONUNBUFFERED": "1", **spec.env, **role}
        env["PYTHONPATH"] = worker_pythonpath(self.code_dirs, spec.env.get("PYTHONPATH"))  # then the node's
        launch = {"command": program, "config": spec.config_data(self.url), "env": env, "restart": restart,
                  "work_dir": str(self.processes.run_dir / "workers"), "name": spec.worker_id}  # fmt: skip
        host = self._restarted_class if spec.tier in RAY_RESTARTED_TIERS else self._host_class
        actor = host.options(name=None, **options).remote(launch)  # starts the process (again on a restart)
        started = self._placed(actor.describe.remote(), f"{spec.worker_id}'s Ray actor", resources.bundle(),
                               on_timeout=lambda: self.ray.kill(actor))  # fmt: skip
        logger.info("ray placed %s worker %s on %s (%s), pid %d, CUDA_VISIBLE_DEVICES=%r", spec.tier,
                    spec.worker_id, started["host"], started["node_ip"], started["pid"],
                    started["cuda_visible_devices"])  # fmt: skip
        process = RemoteProcess(self.ray, actor, int(started["pid"]))
        return RayWorkerProcess(spec, process, Path(started["log"]), started["node_ip"], started["host"],  # type: ignore[arg-type]
                                started["cuda_visible_devices"], started["node_id"],
                                started["actor_pid"], located_pid=int(started["pid"]))  # fmt: skip

    def check(self) -> None:
        """Each crashed worker started again within the budget, the run told (as the embedded
        launcher does: :meth:`RunProcesses.restarted`); then each worker whose actor Ray restarted
        (it started the process again, which rejoins at the current weights): the run is told, as
        of a restart by the launcher, so it forgets the dead process and waits for the new one; not
        counted against ``restart_budget`` (Ray's ``max_restarts`` bounds these), and never
        restarted twice."""
        for restarted, died in self.processes.restarted():
            if self.on_restart is not None:
                self.on_restart(restarted, died)
        for worker in list(self.workers):
            process = worker.process
            if not isinstance(worker, RayWorkerProcess) or not isinstance(process, RemoteProcess):
                continue
            if process.ray_restarts > worker.ray_restarts_seen:  # at once, while Ray restarts it
                worker.ray_restarts_seen = process.ray_restarts
                self._ray_restarted(worker)
            if not process.down and worker.located_pid not in (0, process.pid):
                self._locate(worker)  # back, perhaps on another node

    def _locate(self, worker: RayWorkerProcess) -> None:
        worker.located_pid = worker.pid
        try:
            started = self.ray.get(worker.process.actor.describe.remote(), timeout=60)  # type: ignore[attr-defined]
            worker.node_ip, worker.host = started["node_ip"], started["host"]
            worker.node_id, worker.actor_pid = started["node_id"], int(started["actor_pid"])
        except Exception as exc:  # noqa: BLE001 - died again: the next check sees it
            logger.warning("restarted actor of %s did not say where it runs: %s", worker.spec.worker_id, exc)
        self.processes.write()

    def _ray_restarted(self, worker: RayWorkerProcess) -> None:
        """Tell the run (``on_restart``) that ``worker``'s actor died and Ray starts it again."""
        why = f"its Ray actor died; Ray restarted it ({worker.ray_restarts_seen} of {self.max_restarts})"
        died = TierDied(worker.spec.tier, worker.spec.worker_id, -9, error=why,
                        log_path=worker.log_path, log_tail=tail_of(worker.log_path, 20))  # fmt: skip
        logger.warning("%s", died)
        self.processes.write()
        if self.on_restart is not None:
            self.on_restart(worker, died)

    def _rank_group(self, tier: str, world: int, resources: TierResources) -> Any:
        group = self._groups.get(tier)
        if group is None:
            from ray.util.placement_group import placement_group, remove_placement_group

            group = placement_group([resources.bundle() for _ in range(world)], strategy="STRICT_PACK")
            together = {key: value * world for key, value in resources.bundle().items()}
            self._placed(group.ready(), f"the {tier}'s placement group ({world} ranks on one node)", together,
                         on_timeout=lambda: remove_placement_group(group))  # fmt: skip
            self._groups[tier] = group
        return group

    def _placed(
        self, ref: Any, what: str, reserves: dict[str, float], on_timeout: Callable[[], object]
    ) -> Any:
        """``ref``'s value once Ray placed ``what``; past :attr:`start_timeout_s`, ``on_timeout()``
        (drop the pending request) and :class:`WorkerStartTimeout`."""
        try:
            return self.ray.get(ref, timeout=self.start_timeout_s)
        except self.ray.exceptions.GetTimeoutError:
            available = {str(k): float(v) for k, v in self.ray.available_resources().items()}
            on_timeout()
            raise WorkerStartTimeout(what, self.start_timeout_s, reserves, available) from None

    def _record(self, worker: WorkerProcess) -> dict[str, Any]:
        """A worker's line of ``processes.json``, with where Ray placed it."""
        record = worker_record(worker, self.processes.restarts)
        if isinstance(worker, RayWorkerProcess):
            record.update(node_ip=worker.node_ip, node_id=worker.node_id, host=worker.host,
                          cuda_visible_devices=worker.cuda_visible_devices,
                          actor_pid=worker.actor_pid)  # fmt: skip
            if worker.ray_restarts_seen:
                record["ray_restarts"] = worker.ray_restarts_seen
        return record

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every process placed (as the embedded launcher does), then free the placement
        groups and a local Ray this fleet started."""
        try:
            self.processes.stop(timeout)
        finally:
            for group in self._groups.values():
                try:
                    from ray.util.placement_group import remove_placement_group

                    remove_placement_group(group)
                except Exception:  # noqa: BLE001 - the cluster may be gone already
                    pass
            self._groups.clear()
            if self._started_ray:
                self.ray.shutdown()
                self._started_ray = False

    def __enter__(self) -> RayFleet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


RAY_RESTARTED_TIERS = ("rollout",)
"""Tiers whose actors Ray restarts (``launcher.max_restarts``): their worker starts again by itself and
rejoins at the current weights. A reward worker's or trainer's death goes to the launcher's
supervision instead (a trainer needs its checkpoint restored by the run)."""


def placement_for(config: TrainerConfig) -> RayPlacement:
    """A job's reservations: its ``launcher.resources`` over one CPU per worker and, on CUDA, one GPU
    per trainer rank and ``tensor_parallel_size`` GPUs per rollout worker (half a GPU each for a
    trainer and rollout workers colocated on it)."""
    gpus: dict[str, float] = {}
    if config.placement.device == "cuda":
        engine = config.rollout.vllm()
        colocated = engine is not None and engine.colocate
        tp = engine.tensor_parallel_size if engine is not None else 1
        gpus = {"trainer": 0.5 if colocated else 1.0, "rollout": 0.5 if colocated else float(tp)}
    resources = config.launcher.resources if isinstance(config.launcher, RayLauncher) else {}
    return RayPlacement.from_settings(resources, gpus=gpus)


def job_reservation(config: TrainerConfig, specs: list[WorkerSpec]) -> JobReservation:
    """What ``specs`` (every worker the run starts) reserve on Ray under ``config``'s placement
    (:func:`placement_for`): a trainer's ranks (``RANK`` set) as one group on one node, and the
    rollout tier at the most workers its ``rollout.scale`` schedule reaches."""
    placement = placement_for(config)
    counts: dict[str, int] = {}
    for spec in specs:
        counts[spec.tier] = counts.get(spec.tier, 0) + 1
    if counts.get("rollout"):
        sizes, peak = dict(config.pool_sizes()), sum(config.pool_sizes().values())
        for step in sorted(config.rollout.scale):
            sizes.update(config.rollout.scale[step])
            peak = max(peak, sum(sizes.values()))
        counts["rollout"] += peak - sum(config.pool_sizes().values())
    packed = {spec.tier for spec in specs if "RANK" in spec.env}
    order = sorted(counts, key=lambda tier: (TIER_ORDER + (tier,)).index(tier))
    return JobReservation([TierNeed(tier, counts[tier], placement.of(tier).bundle(), tier in packed)
                           for tier in order])  # fmt: skip
