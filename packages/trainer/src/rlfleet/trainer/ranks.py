"""Starting a trainer rank, the same on rank 0 and on the followers: its rank, its thread, its models.

Rank 0 (:class:`~rlfleet.trainer.service.TrainerWorker`) and ranks 1..W-1
(:class:`~rlfleet.trainer.follower.Follower`) start alike: :func:`use_rank_thread` puts the rank's
work on one thread bound to its device, then :func:`build_models` joins the trainer ranks (the
torchrun environment; one process without it) and builds the actor and, for algorithms that train
one, the critic, in the same order of collectives on every rank.
"""

from __future__ import annotations

import asyncio
import functools
import os
from concurrent.futures import ThreadPoolExecutor

import torch

from rlfleet.common.schema.algorithms import ALGORITHMS
from rlfleet.common.schema.trainer import TrainerWorkerConfig
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.distributed import DistContext, init_distributed, rank_cuda_index


def use_rank_thread(loop: asyncio.AbstractEventLoop, device: str) -> None:
    """Run this process's ``asyncio.to_thread`` work on one thread bound to the rank's CUDA device.

    The current CUDA device is per thread; a pool thread would start on device 0, so every rank
    but the first would put its work on the wrong GPU. One thread also keeps every collective of
    a rank in one order.
    """
    initializer = None
    if device != "cpu" and torch.cuda.is_available():
        index = rank_cuda_index(int(os.environ.get("LOCAL_RANK", "0")))
        initializer = functools.partial(torch.cuda.set_device, index)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trainer-rank", initializer=initializer)
    loop.set_default_executor(pool)


def rank_from_env() -> int:
    """This process's trainer rank (``RANK``; 0 when unset)."""
    return int(os.environ.get("RANK", "0"))


def build_models(cfg: TrainerWorkerConfig) -> tuple[DistContext, Actor, Critic | None]:
    """Join the trainer ranks (torchrun environment; one process without it), build actor and critic.

    Every rank calls it, in the same order of collectives. The worker's ``step.algorithm.name`` and
    ``step.update.kl_coef`` decide what is loaded up front: a critic for PPO, the reference when the
    algorithm uses one (it is loaded on first use otherwise).
    """
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    ctx = init_distributed(cfg.placement.device, cfg.model.sharding)
    seed, update, algorithm = cfg.placement.seed, cfg.step.update, cfg.step.algorithm
    spec = ALGORITHMS[algorithm.name]
    actor = Actor(cfg.model_path, cfg.model, ctx, seed=seed, learning_rate=update.learning_rate,
                  weight_decay=update.weight_decay)  # fmt: skip
    if spec.uses_reference(update.kl_coef):
        actor.reference()
    critic = None
    if spec.needs_critic:
        critic = Critic(cfg.critic_model_path or cfg.model_path, cfg.model, ctx, seed=seed,
                        learning_rate=algorithm.critic_learning_rate or update.learning_rate,
                        weight_decay=update.weight_decay)  # fmt: skip
    return ctx, actor, critic
