"""One train step per algorithm: the trainer worker's ``trainer.step`` hands its batch here.

``run_update`` dispatches on ``request.algorithm``::

    dpo                    ──> dpo_update (preference pairs, see dpo_update.py)
    grpo | rloo | reinforce_pp, KL in the loss (or none)
                           ──> outcome advantages ──> Actor.update          (one policy pass less)
    ppo, or a KL in the reward with kl_coef > 0
                           ──> old + ref logprobs, critic values (ppo) ──> token advantages
                               ──> for epoch, mini-batch: critic step (ppo), policy step

The per-request ``hyperparams`` override the worker's config for one step: ``kl_coef`` (the
controller's KL controller sets it every step), ``clip_eps``, ``entropy_coef`` and ``num_updates``
(optimizer steps per batch, from ``rollout_batch_size / train_batch_size``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from rlfleet.common.errors import ConfigError
from rlfleet.common.messages import TrainStepRequest
from rlfleet.trainer.actor import Actor, PreparedBatch, batch_metrics
from rlfleet.trainer.algo_config import AlgorithmSettings, KLMode
from rlfleet.trainer.algorithms import ALGORITHMS, KL_ESTIMATORS, explained_variance, masked_mean
from rlfleet.trainer.batching import merge_rollouts
from rlfleet.trainer.config import OptimizerConfig, PolicyLossConfig, UpdateConfig
from rlfleet.trainer.critic import Critic, CriticConfig
from rlfleet.trainer.distributed import DistContext
from rlfleet.trainer.dpo_update import DPOSettings, dpo_update, merge_preference_batches
from rlfleet.trainer.errors import InvalidBatch
from rlfleet.trainer.inputs import build_policy_inputs
from rlfleet.trainer.optim import mean_over_steps
from rlfleet.trainer.token_advantages import online_advantages

if TYPE_CHECKING:
    from rlfleet.trainer.service import TrainerServiceConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepSettings:
    """The settings of one step: the worker's config with the request's overrides applied."""

    algorithm: str
    kl_coef: float
    kl_mode: KLMode
    kl_estimator: str
    loss: PolicyLossConfig
    plan: UpdateConfig
    algo: AlgorithmSettings
    seed: int

    @classmethod
    def of(cls, cfg: TrainerServiceConfig, request: TrainStepRequest, num_rows: int) -> StepSettings:
        """Resolve the step's settings; ``num_rows`` is the batch's sample (or pair) count."""
        algorithm = request.algorithm
        hyper: dict[str, Any] = dict(request.hyperparams)
        kl_coef = float(hyper.get("kl_coef", cfg.kl_coef))
        kl_mode = cfg.algo.resolved_kl_mode(algorithm)
        estimator = cfg.algo.resolved_kl_estimator(algorithm)
        loss = PolicyLossConfig(
            clip_eps=float(hyper.get("clip_eps", cfg.clip_eps)),
            kl_coef=kl_coef if kl_mode == "loss" else 0.0,
            kl_estimator=estimator,
            entropy_coef=float(hyper.get("entropy_coef", cfg.entropy_coef)),
            loss_agg=cfg.loss_agg,
        )
        num_updates = max(1, int(hyper.get("num_updates", 1)))
        mini = None if num_updates == 1 else -(-num_rows // num_updates)
        plan = UpdateConfig(
            micro_batch_size=min(cfg.micro_batch_size, mini or cfg.micro_batch_size),
            mini_batch_size=mini,
            ppo_epochs=cfg.ppo_epochs,
            max_grad_norm=cfg.max_grad_norm,
        )
        return cls(algorithm, kl_coef, kl_mode, estimator, loss, plan, cfg.algo, cfg.seed)


def check_algorithm(algorithm: str, critic: Critic | None) -> None:
    """Raise ConfigError for an unknown algorithm, or for PPO on a worker started without a critic."""
    if algorithm not in ALGORITHMS:
        raise ConfigError("algorithm", algorithm, f"expected one of {', '.join(ALGORITHMS)}")
    if ALGORITHMS[algorithm].needs_critic and critic is None:
        raise ConfigError(
            "algorithm", algorithm, "this trainer worker was started without a critic; start it with "
            f"algorithm={algorithm} so that it loads one",
        )  # fmt: skip


def build_critic(cfg: TrainerServiceConfig, device: str, dist: DistContext | None = None) -> Critic | None:
    """The critic a worker of ``cfg.algorithm`` needs (PPO), on ``device`` (sharded over ``dist``'s
    ranks); None for the others."""
    if not ALGORITHMS[cfg.algorithm].needs_critic:
        return None
    mixed = cfg.mixed_precision if cfg.mixed_precision != "auto" else ("bf16" if device == "cuda" else "none")
    return Critic(
        CriticConfig(
            model_path=cfg.algo.critic_model_path or cfg.model_path,
            dtype=cfg.dtype,
            device=device,
            mixed_precision=mixed,
            seed=cfg.seed,
            value_clip=cfg.algo.value_clip,
            loss_agg=cfg.loss_agg,
            optim=OptimizerConfig(
                lr=cfg.algo.critic_learning_rate or cfg.learning_rate, weight_decay=cfg.weight_decay
            ),
        ),
        dist,
    )


def merge_batch(algorithm: str, chunks: Sequence[dict[str, Tensor]]) -> dict[str, Tensor]:
    """One training batch from the fetched chunks: preference pairs for DPO, rollouts otherwise."""
    if algorithm == "dpo":
        return merge_preference_batches(chunks)
    return merge_rollouts(chunks)


def run_update(
    actor: Actor,
    critic: Critic | None,
    cfg: TrainerServiceConfig,
    batch: Mapping[str, Tensor],
    request: TrainStepRequest,
) -> dict[str, float]:
    """One train step of ``request.algorithm`` on ``batch``; returns its metrics."""
    check_algorithm(request.algorithm, critic)
    t0 = time.perf_counter()
    if request.algorithm == "dpo":
        settings = StepSettings.of(cfg, request, int(batch["prompt_ids"].shape[0]))
        dpo = DPOSettings(
            beta=cfg.algo.beta, loss_type=cfg.algo.dpo_loss, label_smoothing=cfg.algo.label_smoothing
        )
        metrics = dpo_update(actor, batch, dpo, settings.plan)
        tokens = float(sum(batch[k].sum().item() for k in ("prompt_mask", "chosen_mask", "rejected_mask")))
    else:
        n = int(batch["response_ids"].shape[0])
        if len(request.scores) != n:
            raise InvalidBatch("scores", f"{len(request.scores)} scores for {n} samples")
        settings = StepSettings.of(cfg, request, n)
        metrics = online_update(actor, critic, batch, torch.tensor(request.scores, dtype=torch.float32),
                                settings, step=request.step)  # fmt: skip
        tokens = float((batch["prompt_mask"].sum() + batch["response_mask"].sum()).item())
    seconds = time.perf_counter() - t0
    metrics["time/update_s"] = seconds
    metrics["throughput/train_tok_s"] = tokens / max(seconds, 1e-9)
    return metrics


def online_update(
    actor: Actor,
    critic: Critic | None,
    batch: Mapping[str, Tensor],
    scores: Tensor,
    s: StepSettings,
    *,
    step: int = 0,
) -> dict[str, float]:
    """One update of ``ppo | grpo | rloo | reinforce_pp`` on a rollout batch and its scores (N,)."""
    kl_in_reward = s.kl_mode == "reward"
    if critic is None and not (kl_in_reward and s.kl_coef > 0):
        adv = online_advantages(s.algorithm, scores, batch["group_index"], batch["response_mask"],
                                kl_in_reward=kl_in_reward, gamma=s.algo.gamma)  # fmt: skip
        metrics = actor.update(
            batch, adv.advantages, micro_batch_size=s.plan.micro_batch_size, kl_coef=s.loss.kl_coef,
            clip_eps=s.loss.clip_eps, entropy_coef=s.loss.entropy_coef, kl_estimator=s.kl_estimator,
            loss_agg=s.loss.loss_agg, max_grad_norm=s.plan.max_grad_norm, ppo_epochs=s.plan.ppo_epochs,
            mini_batch_size=s.plan.mini_batch_size,
        )  # fmt: skip
        metrics.update(_advantage_metrics(adv.advantages, batch["response_mask"]))
        return metrics
    return _prepared_update(actor, critic, batch, scores, s, step=step)


def _prepared_update(
    actor: Actor,
    critic: Critic | None,
    batch: Mapping[str, Tensor],
    scores: Tensor,
    s: StepSettings,
    *,
    step: int,
) -> dict[str, float]:
    """Old and reference logprobs (and values) first, then token advantages, then the steps."""
    mbs = s.plan.micro_batch_size
    inputs = build_policy_inputs(batch).to(actor.device)
    mask = inputs.response_mask
    old = actor.compute_logprobs(inputs, micro_batch_size=mbs)
    ref = None
    if ALGORITHMS[s.algorithm].uses_reference(s.kl_coef) or actor.ref_model is not None:
        ref = actor.compute_logprobs(inputs, micro_batch_size=mbs, reference=True)
    kl = None if ref is None else KL_ESTIMATORS[s.kl_estimator](old, ref) * mask
    values = None if critic is None else critic.compute_values(inputs.to(critic.device), micro_batch_size=mbs)
    adv = online_advantages(
        s.algorithm, scores.to(mask.device), batch["group_index"].to(mask.device), mask, kl=kl,
        kl_coef=s.kl_coef, kl_in_reward=s.kl_mode == "reward",
        values=None if values is None else values.to(mask.device), gamma=s.algo.gamma, lam=s.algo.lam,
        whiten=s.algo.whiten_advantages,
    )  # fmt: skip
    rollout = batch.get("rollout_logprobs")
    prepared = PreparedBatch(
        inputs=inputs, old_logprobs=old, advantages=adv.advantages, ref_logprobs=ref,
        rollout_logprobs=None if rollout is None else rollout.to(actor.device).float(),
    )  # fmt: skip
    metrics = batch_metrics(prepared)
    metrics.update(_advantage_metrics(adv.advantages, mask))
    if kl is not None and s.kl_mode == "reward":
        metrics["kl_reward"] = float(masked_mean(kl, mask).item()) * s.kl_coef
    if critic is not None and values is not None and adv.returns is not None:
        metrics["critic/values_mean"] = float(masked_mean(values.to(mask.device), mask).item())
        metrics["critic/returns_mean"] = float(masked_mean(adv.returns, mask).item())
        metrics["critic/explained_variance"] = float(
            explained_variance(adv.returns, values.to(mask.device), mask)
        )
    generator = torch.Generator().manual_seed(s.seed * 1_000_003 + step)
    metrics.update(train_steps(actor, critic, prepared, values, adv.returns, s.loss, s.plan, generator))
    return metrics


def train_steps(
    actor: Actor,
    critic: Critic | None,
    prepared: PreparedBatch,
    old_values: Tensor | None,
    returns: Tensor | None,
    loss: PolicyLossConfig,
    plan: UpdateConfig,
    generator: torch.Generator,
) -> dict[str, float]:
    """``ppo_epochs`` passes over the batch in mini-batches; each is one critic step, then one policy step.

    Args:
        old_values, returns: (N, R) the critic's clip centre and targets (with a critic).

    Returns:
        the per-step metrics of the actor (and ``critic/*``) averaged over steps, and
        ``num_optimizer_steps``.
    """
    n = prepared.inputs.num_samples
    mini = plan.mini_batch_size or n
    mbs = plan.micro_batch_size
    per_step: list[dict[str, float]] = []
    for _ in range(plan.ppo_epochs):
        order = torch.randperm(n, generator=generator) if plan.shuffle and mini < n else torch.arange(n)
        for rows in order.split(mini):
            step: dict[str, float] = {}
            if critic is not None:
                assert old_values is not None and returns is not None
                step.update(_critic_step(critic, prepared, rows, old_values, returns, plan))
            rows = rows.to(actor.device)
            step.update(actor.forward_backward(prepared, rows, micro_batch_size=mbs, loss=loss))
            step.update(actor.optimizer_step(plan.max_grad_norm))
            per_step.append(step)
    return mean_over_steps(per_step)


def _critic_step(
    critic: Critic,
    prepared: PreparedBatch,
    rows: Tensor,
    old_values: Tensor,
    returns: Tensor,
    plan: UpdateConfig,
) -> dict[str, float]:
    """One critic optimizer step on the mini-batch ``rows``."""
    device = critic.device
    metrics = critic.forward_backward(
        prepared.inputs.to(device), rows.to(device), old_values.to(device), returns.to(device),
        micro_batch_size=plan.micro_batch_size,
    )  # fmt: skip
    metrics.update(critic.optimizer_step(plan.max_grad_norm))
    return metrics


def _advantage_metrics(advantages: Tensor, response_mask: Tensor) -> dict[str, float]:
    """Token mean and mean absolute value of the advantages."""
    mask = response_mask.to(advantages.device)
    return {
        "advantage/abs_mean": float(masked_mean(advantages.abs(), mask).item()),
        "advantage/mean": float(masked_mean(advantages, mask).item()),
    }
