"""Scale a rollout pool while the run goes on (issue 13 point 2): ``trainer.scale_rollout(pool, n)``.

Between steps, the run's launcher (embedded: local processes; ``launcher: ray``: new Ray actors,
placed like the pool's other workers) starts or stops rollout workers of ``pool`` until it has
``n``. The job's ``rollout.workers`` (or ``rollout.pools.<pool>.workers``) is the size a run
starts with; this changes it for the rest of the run.

- **Adding.** A new worker gets the pool's engine settings under the next free id
  (``rollout-<i>``, or ``rollout-<pool>-<i>`` with named pools) and loads the trainer's current
  weights before it announces (``rollout/catch_up.py``, as a restarted worker does). The run waits
  for its announce and, should it still hold another version, loads the published one into it
  through the fleet's admission path (:meth:`~rlfleet.controller.fleet.Fleet.admit`); the fleet
  routes generate requests only to workers at the current version in any case. It is supervised
  (restarted within the budget) as the others are.
- **On a schedule.** The job's ``rollout.scale: {step: {pool: n}}`` does the same before each step
  it names (:func:`scale_due`, read by the run's step loop).
- **Removing.** The newest workers go first. Each leaves the launcher's supervision (so its exit
  is not taken for a crash: :meth:`~rlfleet.controller.ports.Launcher.retire`), then is SIGTERMed:
  it drains (refuses new requests, which go to another worker, finishes what it took, says it
  leaves) within its ``drain_s``, and is killed past that. A chunk whose producer is gone before
  the reward and trainer tiers fetched it is generated again (``lost_chunks.py``), so no sample is
  lost.

:class:`RolloutScaler` receives the ports it uses (:mod:`rlfleet.controller.ports`): the run's
state, its launcher and fleet client, and its loop.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path

from rlfleet.common.errors import ConfigError
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.errors import TierNotReady
from rlfleet.controller.launcher import WorkerProcess, WorkerSpec, drain_bound
from rlfleet.controller.ports import FleetClient, Launcher, RunState, describe_worker
from rlfleet.controller.supervision import GuardedLoop
from rlfleet.controller.worker_configs import rollout_env, rollout_worker_configs

logger = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""Seconds past a removed worker's ``drain_s`` before it is killed."""


def pool_workers(launcher: Launcher, pool: str) -> list[WorkerProcess]:
    """The launcher's rollout workers of ``pool``, oldest id first."""
    found = [w for w in launcher.workers
             if w.spec.tier == "rollout" and getattr(w.spec.config, "pool", None) == pool]  # fmt: skip
    return sorted(found, key=lambda w: _index(w.spec.worker_id))


def _index(worker_id: str) -> int:
    tail = worker_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else -1


def check_request(config: TrainerConfig, launcher: Launcher | None, pool: str, n: int) -> None:
    """Refuse ``scale_rollout(pool, n)`` before anything starts: a run without a launcher (it joined
    a fleet by ``nats_url``), an unknown pool, a negative size."""
    if launcher is None:
        raise ConfigError("scale_rollout", pool, "this run joins a fleet by nats_url and starts no workers; "
                          "start or stop rollout workers where that fleet runs")  # fmt: skip
    if pool not in config.pools():
        raise ConfigError(
            "scale_rollout", pool, f"no such rollout pool; the pools are {sorted(config.pools())}"
        )
    if n < 0:
        raise ValueError(f"scale_rollout({pool!r}, {n}): n must be >= 0")


def scale_due(state: RunState, launcher: Launcher | None) -> dict[str, int]:
    """The job's ``rollout.scale`` entry for the step about to run: each pool it names that has
    another size now, and the size to give it."""
    sizes = state.config.rollout.scale.get(state.global_step + 1) or {}
    return {pool: n for pool, n in sizes.items()
            if len(pool_workers(launcher, pool) if launcher is not None else []) != n}  # fmt: skip


class RolloutScaler:
    """Resizes the rollout pools of a started run, between steps: new workers started by its
    ``launcher`` and admitted at its weights through its ``fleet``, removed ones drained.
    ``rejoining``: the supervisor's restarted workers not back yet (a removed one is no longer
    waited for)."""

    def __init__(
        self, state: RunState, model_path: Path, launcher: Launcher, fleet: FleetClient, loop: GuardedLoop,
        rejoining: dict[tuple[str, str], str | None],
    ) -> None:  # fmt: skip
        self.state = state
        self.model_path = model_path
        self.launcher = launcher
        self.fleet = fleet
        self.loop = loop
        self.rejoining = rejoining

    def scale(self, pool: str, n: int) -> list[str]:
        """Make ``pool`` ``n`` workers (:func:`check_request` passed); returns their ids."""
        current = pool_workers(self.launcher, pool)
        others = [w for w in self.launcher.workers if w.spec.tier == "rollout" and w not in current]
        if n == 0 and not others:
            raise ValueError(f"scale_rollout({pool!r}, 0) would leave the run without a rollout worker")
        if n > len(current):
            self._add(pool, n - len(current))
        elif n < len(current):
            self.loop.run(self._remove(current[n:][::-1]))
        ids = [w.spec.worker_id for w in pool_workers(self.launcher, pool)]
        logger.info("rollout pool %s scaled to %d worker(s): %s", pool, len(ids), ", ".join(ids))
        return ids

    def _add(self, pool: str, count: int) -> None:
        cfg = self.state.config
        template = next(c for c in rollout_worker_configs(cfg, self.model_path, self.state.cluster)
                        if c.pool == pool)  # fmt: skip
        used = {w.spec.worker_id for w in self.launcher.workers}
        added, i = [], 0
        while len(added) < count:
            name = f"rollout-{pool}-{i}" if cfg.rollout.pools else f"rollout-{i}"
            if name not in used:
                placement = template.placement.model_copy(update={"seed": template.placement.seed + i})
                config = template.model_copy(update={"worker_id": name, "placement": placement})
                self.launcher.spawn(WorkerSpec("rollout", name, config, env=rollout_env(cfg)))
                added.append(name)
            i += 1
        self.loop.run(self._admitted(added))

    async def _admitted(self, worker_ids: list[str]) -> None:
        """Wait until each new worker announced and holds the run's current weight version."""
        fleet, version = self.fleet, self.state.weight_version
        timeout = self.state.config.startup_timeout_s
        deadline = asyncio.get_running_loop().time() + timeout
        pending = list(worker_ids)
        while pending:
            for worker_id in list(pending):
                info = fleet.registry.get("rollout", worker_id)
                if info is None:
                    continue
                if info.weight_version == version or version == 0:
                    pending.remove(worker_id)
                    logger.info("rollout worker %s admitted at weight version %d", worker_id,
                                info.weight_version)  # fmt: skip
                elif fleet.published is not None and fleet.published.weight_version == version:
                    await fleet.admit(info, fleet.published)  # the fleet's own admission of a stale worker
            if pending and asyncio.get_running_loop().time() > deadline:
                missing = [describe_worker(self.launcher, w) for w in pending]
                raise TierNotReady(
                    timeout, missing, f"new rollout worker(s) not admitted at version {version}"
                )
            if pending:
                await asyncio.sleep(0.1)

    async def _remove(self, workers: list[WorkerProcess]) -> None:
        """Take ``workers`` out of supervision, let each drain (SIGTERM), kill what outlives its bound."""
        self.launcher.retire(workers)  # no longer supervised: its exit is not a crash
        for worker in workers:
            self.rejoining.pop(("rollout", worker.spec.worker_id), None)
            worker.process.send_signal(signal.SIGTERM)
        for worker in workers:
            bound = drain_bound(worker.spec) + STOP_GRACE_S
            try:
                await asyncio.to_thread(worker.process.wait, bound)
            except Exception as exc:  # noqa: BLE001 - subprocess.TimeoutExpired or the actor gone: kill it
                logger.warning("rollout worker %s did not stop within %.0f s (%s); killing it",
                               worker.spec.worker_id, bound, exc)  # fmt: skip
            worker.kill_group()
            self.fleet.forget("rollout", worker.spec.worker_id)  # its leave may be lost
            logger.info("rollout worker %s removed (drained)", worker.spec.worker_id)
