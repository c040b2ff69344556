"""The workers an embedded run starts, each with its config built from the run's settings.

A worker's config is its tier's schema class (:class:`~rlfleet.common.schema.trainer.TrainerWorkerConfig`,
:class:`~rlfleet.common.schema.rollout.RolloutWorkerConfig`,
:class:`~rlfleet.common.schema.reward.RewardWorkerConfig`), composed of the run's sections as
they are (``model``, ``placement``, ``tensor_plane``, a pool's rollout settings, the step settings
of ``update``, ``algorithm`` and ``batch``) and validated here, so a setting of the job reaches the
worker that uses it or the run refuses to start. The launcher writes each in the previous
release's flat form (:meth:`~rlfleet.controller.launcher.WorkerSpec.config_data`), which workers of
either release read.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path
from typing import TypeVar

from pydantic import BaseModel

from rlfleet.common.control.membership import WorkerRegistry
from rlfleet.common.control.transport import REWARD_NATS_ENV_PREFIX, TOKEN_ENV
from rlfleet.common.schema.reward import RewardWorkerConfig, Spec
from rlfleet.common.schema.rollout import RolloutSettings, RolloutWorkerConfig
from rlfleet.common.schema.trainer import StepSettings, TrainerWorkerConfig
from rlfleet.common.schema.worker import FleetAddress, ModelLoading
from rlfleet.controller.config import TrainerConfig
from rlfleet.controller.cpu_shares import cpu_thread_env
from rlfleet.controller.launcher import WorkerSpec, trainer_rank_specs
from rlfleet.controller.ports import Launcher, RunState, not_ready

logger = logging.getLogger(__name__)

TRAINER_ID = "trainer-0"
REWARD_ID = "reward-0"
S = TypeVar("S", bound=BaseModel)


def _copy(section: S) -> S:
    """A section of the run's config for a worker's own (the worker's config never shares the run's)."""
    return section.model_copy(deep=True)


def tier_counts(config: TrainerConfig, online: bool, reward_worker: bool = True) -> dict[str, int]:
    """Workers each tier must announce before the run starts (a shared reward server is waited for
    on its own; a run whose reward is a Python callable needs no reward worker, ``reward_worker``
    False; an offline run has only a trainer)."""
    if not online:
        return {"trainer": 1}
    reward = 0 if config.reward.url or not reward_worker else 1
    return {"rollout": sum(config.pool_sizes().values()), "reward": reward, "trainer": 1}


def trainer_worker_config(
    config: TrainerConfig, model_path: Path, cluster: str, critic_path: Path | None = None
) -> TrainerWorkerConfig:
    """The trainer worker's config: its model, how it holds it, and the run's step settings."""
    return TrainerWorkerConfig(
        fleet=FleetAddress(cluster=cluster), placement=_copy(config.placement),
        tensor_plane=_copy(config.tensor_plane), worker_id=TRAINER_ID, model_path=str(model_path),
        model=_copy(config.model), step=StepSettings.of(config),
        critic_model_path=str(critic_path) if critic_path is not None else None,
        checkpoint_root=str(Path(config.output_dir).resolve()),  # save/resume paths lie inside it
    )  # fmt: skip


def lora_ready(config: TrainerConfig, settings: RolloutSettings) -> RolloutSettings:
    """``settings`` able to serve the run's LoRA adapter: a run that publishes its adapter
    (``model.lora`` with ``weight_sync.adapter``) raises vLLM's ``max_lora_rank`` to its rank."""
    engine, lora = settings.vllm(), config.model.lora
    if engine is None or lora is None or not config.weight_sync.adapter or engine.max_lora_rank >= lora.rank:
        return settings
    return settings.model_copy(update={"engine": engine.model_copy(update={"max_lora_rank": lora.rank})})


def shared_environments(config: TrainerConfig) -> dict[str, str]:
    """Where a multi-turn run's rollout workers find its environment: a run that scores on a shared
    reward server (``reward.url``) and serves no environment itself plays that server's (its
    ``env_url`` and ``env_cluster``); else the fleet's own reward workers (no settings)."""
    env, reward = config.environment, config.reward
    if not env.enabled or env.serve or reward.url is None:
        return {}
    return {"env_url": reward.url, "env_cluster": reward.cluster or "default"}


def rollout_env(config: TrainerConfig) -> dict[str, str]:
    """The variables a multi-turn run's rollout workers get: the tenant token their environment
    requests carry (``reward.token``, else the controller's ``RLFLEET_REWARD_TOKEN``) and, for a
    shared server on another NATS, its login (``reward.nats_auth`` as ``RLFLEET_REWARD_NATS_*``).
    In the environment, never in the config file (``ps`` and the run folder do not show them)."""
    if not config.environment.enabled:
        return {}
    reward = config.reward
    out = reward.nats_auth.env(prefix=REWARD_NATS_ENV_PREFIX) if shared_environments(config) else {}
    token = reward.token.get_secret_value() or os.environ.get(TOKEN_ENV, "")
    return {**out, TOKEN_ENV: token} if token else out


def rollout_worker_configs(
    config: TrainerConfig, model_path: Path, cluster: str
) -> list[RolloutWorkerConfig]:
    """A rollout worker per slot of each pool, with that pool's engine settings: ``rollout-<i>``, or
    ``rollout-<pool>-<i>`` with named pools; each seeded apart (``seed + i``)."""
    workers: list[RolloutWorkerConfig] = []
    loading = ModelLoading(trust_remote_code=config.model.trust_remote_code)
    for pool, (size, settings) in config.pools().items():
        for i in range(size):
            name = f"rollout-{pool}-{i}" if config.rollout.pools else f"rollout-{i}"
            placement = config.placement.model_copy(update={"seed": config.placement.seed + len(workers)})
            worker = RolloutWorkerConfig(
                fleet=FleetAddress(cluster=cluster), placement=placement,
                tensor_plane=_copy(config.tensor_plane), worker_id=name, pool=pool,
                model_path=str(model_path), loading=loading.model_copy(),
                rollout=lora_ready(config, settings), **shared_environments(config),
            )  # fmt: skip
            workers.append(worker)
    return workers


def reward_worker_config(config: TrainerConfig, cluster: str, reward_spec: Spec) -> RewardWorkerConfig:
    """The run's own reward worker: one endpoint, ``reward.endpoint``, scoring with ``reward_spec``,
    and in a multi-turn run the environment ``environment.serve`` as ``environment.env``.

    Its ``state_dir`` (``fleet/reward-state/<launch>``, new for each launch of the fleet, so a run
    never picks up what an earlier run in the same ``output_dir`` swapped in; a resume gets the
    checkpoint's reward from the controller) keeps what the run changes at run time: a reward
    worker the launcher restarts serves the swapped reward model and its scaler's statistics."""
    launch = f"{REWARD_ID}-{uuid.uuid4().hex[:8]}"
    state = Path(config.output_dir).resolve() / "fleet" / "reward-state" / launch
    env = config.environment  # a multi-turn run: the environment its episodes play, served beside the reward
    environments = {env.env: env.serve} if env.enabled and env.serve else {}
    return RewardWorkerConfig(
        fleet=FleetAddress(cluster=cluster), tensor_plane=_copy(config.tensor_plane), worker_id=REWARD_ID,
        loading=ModelLoading(trust_remote_code=config.model.trust_remote_code),
        endpoints={config.reward.endpoint: reward_spec}, state_dir=str(state),
        **({"environments": environments} if environments else {}),
    )  # fmt: skip


def worker_specs(
    config: TrainerConfig, model_path: Path, cluster: str, *, online: bool, reward_spec: Spec | None = None,
    critic_path: Path | None = None,
) -> list[WorkerSpec]:  # fmt: skip
    """Every process an embedded run starts: the trainer ranks, then (online runs) the reward worker,
    unless scores go to a shared server (``reward.url``) or the controller scores them (no
    ``reward_spec``: a Python reward), and the rollout workers; a pipelined run on CPU gives them
    their own shares of the cores (cpu_shares.py)."""
    trainer = trainer_worker_config(config, model_path, cluster, critic_path)
    specs = trainer_rank_specs(trainer, config.num_train_workers, TRAINER_ID)
    if not online:
        return specs
    if not config.reward.url and reward_spec is not None:
        specs.append(WorkerSpec("reward", REWARD_ID, reward_worker_config(config, cluster, reward_spec)))
    specs += [
        WorkerSpec("rollout", w.worker_id, w, env=rollout_env(config))
        for w in rollout_worker_configs(config, model_path, cluster)
    ]
    shares = cpu_thread_env([s.tier for s in specs], device=config.placement.device,
                            max_staleness=config.max_staleness)  # fmt: skip
    for spec, env in zip(specs, shares, strict=True):  # a pipelined run on CPU: the tiers' own cores
        spec.env.update(env)
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
