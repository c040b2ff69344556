"""The workers an embedded run starts, each with its config built from the run's settings.

A trainer's config is the schema's :class:`~rlfleet.common.schema.trainer.TrainerWorkerConfig`, a
rollout worker's the schema's :class:`~rlfleet.common.schema.rollout.RolloutWorkerConfig`: built
from the :class:`~rlfleet.controller.config.TrainerConfig` fields of the same names (declared once,
in the schema) and validated here, so a setting of the job reaches the worker that uses it or the
run refuses to start. The reward worker's config is the endpoint table of its own tier.
"""

from __future__ import annotations

import logging
import uuid
from pathlib import Path
from typing import Any

from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.schema.reward import Spec
from rlfleet.common.schema.rollout import RolloutSettings, RolloutWorkerConfig
from rlfleet.common.schema.trainer import ModelSettings, StepSettings, TrainerWorkerConfig
from rlfleet.common.schema.worker import Placement, TensorPlaneSettings
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.launcher import WorkerSpec, trainer_rank_specs
from rlfleet.controller.ports import Launcher, RunState, not_ready

logger = logging.getLogger(__name__)

TRAINER_ID = "trainer-0"
REWARD_ID = "reward-0"


def tier_counts(config: TrainerConfig, online: bool, reward_worker: bool = True) -> dict[str, int]:
    """Workers each tier must announce before the run starts (a shared reward server is waited for
    on its own; a run whose reward is a Python callable needs no reward worker, ``reward_worker``
    False; an offline run has only a trainer)."""
    if not online:
        return {"trainer": 1}
    reward = 0 if config.reward_url or not reward_worker else 1
    return {"rollout": sum(config.pool_sizes().values()), "reward": reward, "trainer": 1}


def trainer_worker_config(
    config: TrainerConfig, model_path: Path, cluster: str, critic_path: Path | None = None
) -> TrainerWorkerConfig:
    """The trainer worker's config: its model, how it holds it, and the run's step settings."""
    shared = {*Placement.model_fields, *TensorPlaneSettings.model_fields, *ModelSettings.model_fields,
              *StepSettings.model_fields}  # fmt: skip
    return TrainerWorkerConfig(
        cluster=cluster, worker_id=TRAINER_ID, model_path=str(model_path),
        critic_model_path=str(critic_path) if critic_path is not None else None,
        checkpoint_root=str(Path(config.output_dir).resolve()),  # save/resume paths lie inside it
        **config.model_dump(include=shared),
    )  # fmt: skip


def rollout_worker_configs(
    config: TrainerConfig, model_path: Path, cluster: str
) -> list[RolloutWorkerConfig]:
    """A rollout worker per slot of each pool, with that pool's engine settings: ``rollout-<i>``, or
    ``rollout-<pool>-<i>`` with named pools; each seeded apart (``seed + i``)."""
    workers: list[RolloutWorkerConfig] = []
    for pool, (size, settings) in config.pools().items():
        for i in range(size):
            name = f"rollout-{pool}-{i}" if config.rollout_pools else f"rollout-{i}"
            workers.append(
                RolloutWorkerConfig(
                    cluster=cluster,
                    worker_id=name,
                    pool=pool,
                    model_path=str(model_path),
                    device=config.device,
                    seed=config.seed + len(workers),
                    trust_remote_code=config.trust_remote_code,
                    **tensor_plane(config),
                    **settings.model_dump(include=set(RolloutSettings.model_fields)),
                )  # fmt: skip
            )
    return workers


def reward_worker_config(config: TrainerConfig, cluster: str, reward_spec: Any) -> dict[str, Any]:
    """The run's own reward worker: one endpoint, ``reward_endpoint``, scoring with ``reward_spec``.

    Its ``state_dir`` (``fleet/reward-state/<launch>``, new for each launch of the fleet, so a run
    never picks up what an earlier run in the same ``output_dir`` swapped in; a resume gets the
    checkpoint's reward from the controller) keeps what the run changes at run time: a reward
    worker the launcher restarts serves the swapped reward model and its scaler's statistics."""
    launch = f"{REWARD_ID}-{uuid.uuid4().hex[:8]}"
    state = Path(config.output_dir).resolve() / "fleet" / "reward-state" / launch
    loading = {"trust_remote_code": True} if config.trust_remote_code else {}  # unwritten at its default
    return {"cluster": cluster, "endpoints": {config.reward_endpoint: reward_spec}, "state_dir": str(state),
            **loading, **tensor_plane(config)}  # fmt: skip


def tensor_plane(config: TrainerConfig) -> dict[str, Any]:
    """The run's tensor plane settings (bind and advertised host, TLS files): every worker's store
    and clients use them."""
    return config.model_dump(include=set(TensorPlaneSettings.model_fields))


def worker_specs(
    config: TrainerConfig, model_path: Path, cluster: str, *, online: bool, reward_spec: Any = None,
    critic_path: Path | None = None,
) -> list[WorkerSpec]:  # fmt: skip
    """Every process an embedded run starts: the trainer ranks, then (online runs) the reward worker,
    unless scores go to a shared server (``reward_url``) or the controller scores them (no
    ``reward_spec``: a Python reward), and the rollout workers."""
    trainer = trainer_worker_config(config, model_path, cluster, critic_path)
    specs = trainer_rank_specs(trainer, config.num_train_workers, TRAINER_ID)
    if not online:
        return specs
    if not config.reward_url and reward_spec is not None:
        specs.append(WorkerSpec("reward", REWARD_ID, reward_worker_config(config, cluster, reward_spec)))
    specs += [
        WorkerSpec("rollout", w.worker_id, w) for w in rollout_worker_configs(config, model_path, cluster)
    ]
    return specs


async def start_reward_worker(
    launcher: Launcher, registry: WorkerRegistry, state: RunState, spec: Spec
) -> None:
    """Start the reward worker of a run that began with a Python reward (so has none) serving
    ``spec``, with ``launcher``, and wait until ``registry`` sees it announce."""
    config = state.config
    worker = WorkerSpec("reward", REWARD_ID, reward_worker_config(config, state.cluster, spec))
    launcher.spawn(worker)
    logger.info("started the run's reward worker for %r", spec)
    try:
        await registry.wait_for("reward", 1, config.startup_timeout_s)
    except TimeoutError as exc:
        raise not_ready(launcher, registry, config.startup_timeout_s, str(exc)) from None
