"""The algorithm part of :class:`~rlfleet.controller.config.TrainerConfig`: which algorithm, the KL
controller, PPO's GAE and critic, DPO's loss.

:class:`AlgorithmFields` is a base of ``TrainerConfig``, so these are plain top-level fields of a
config (``TrainerConfig(beta=0.1)``, ``kl_ctrl=adaptive`` on the command line). The KL controller
runs on the controller (:mod:`rlfleet.common.kl_control`): every step it sends the trainer the
coefficient to use and, after the step, feeds it the KL the trainer measured.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import Field

from rlfleet.common.config import ConfigModel
from rlfleet.common.kl_control import AnyKLController, KLControlConfig

logger = logging.getLogger(__name__)

AlgorithmName = Literal["ppo", "grpo", "rloo", "reinforce_pp", "dpo"]
GROUP_ALGORITHMS: frozenset[str] = frozenset({"grpo", "rloo"})
"""Algorithms whose advantages compare the samples of one prompt (they need group_size >= 2)."""
OFFLINE_ALGORITHMS: frozenset[str] = frozenset({"dpo"})
"""Algorithms that train on a fixed dataset: no rollout, no reward tier."""
TRAINER_ALGO_KEYS: tuple[str, ...] = (
    "kl_mode", "kl_estimator", "gamma", "lam", "whiten_advantages", "value_clip", "critic_learning_rate",
    "beta", "dpo_loss", "label_smoothing",
)  # fmt: skip
"""The fields that travel to the trainer worker's ``algo`` section under the same names."""


class AlgorithmFields(ConfigModel):
    """Which algorithm runs, and its settings beyond the policy loss shared by all."""

    algorithm: AlgorithmName = Field(default="grpo", description="ppo | grpo | rloo | reinforce_pp | dpo")
    kl_ctrl: Literal["fixed", "adaptive", "scheduled"] = Field(
        default="fixed", description="KL coefficient controller; it starts at kl_coef"
    )
    kl_target: float | None = Field(default=None, gt=0.0, description="adaptive: the KL to steer towards")
    kl_horizon: int = Field(
        default=10000, ge=1, description="adaptive: how fast it reacts, in samples (Ziegler et al.)"
    )
    kl_end_coef: float = Field(default=0.0, ge=0.0, description="scheduled: the final coefficient")
    kl_total_steps: int | None = Field(
        default=None, ge=1, description="scheduled: samples over which kl_coef moves to kl_end_coef"
    )
    kl_schedule: Literal["linear", "cosine"] = Field(default="linear", description="scheduled: the curve")
    kl_mode: Literal["loss", "reward"] | None = Field(
        default=None, description="KL in the loss or in the reward; None: the algorithm's default "
        "(reward for ppo, rloo, reinforce_pp; loss for grpo)",
    )  # fmt: skip
    kl_estimator: Literal["k1", "k2", "k3"] | None = Field(
        default=None, description="per-token KL estimator; None: k1 in the reward, k3 in the loss"
    )
    gamma: float = Field(default=1.0, ge=0.0, le=1.0, description="discount (PPO GAE, REINFORCE++)")
    lam: float = Field(default=0.95, ge=0.0, le=1.0, description="PPO GAE lambda")
    whiten_advantages: bool = Field(default=True, description="PPO: whiten GAE advantages over the batch")
    value_clip: float | None = Field(default=0.2, gt=0.0, description="PPO critic value clip; None: off")
    critic_model_name: str | None = Field(
        default=None, description="PPO critic backbone (like model); None: initialised from the actor"
    )
    critic_learning_rate: float | None = Field(
        default=None, gt=0.0, description="critic AdamW learning rate; None: learning_rate"
    )
    beta: float = Field(default=0.1, gt=0.0, description="DPO: inverse temperature of the implicit reward")
    dpo_loss: Literal["sigmoid", "ipo"] = Field(default="sigmoid", description="DPO loss type")
    label_smoothing: float = Field(
        default=0.0, ge=0.0, lt=0.5, description="conservative DPO: probability a label is flipped"
    )

    def kl_control(self, coef: float) -> KLControlConfig:
        """The KL controller's config, starting at ``coef`` (the trainer config's ``kl_coef``)."""
        return KLControlConfig(
            kind=self.kl_ctrl, coef=coef, target=self.kl_target, horizon=self.kl_horizon,
            schedule=self.kl_schedule, end_coef=self.kl_end_coef, total_steps=self.kl_total_steps,
        )  # fmt: skip

    def trainer_algo_settings(self) -> dict[str, Any]:
        """The trainer worker's ``algo`` section (the caller adds ``critic_model_path``)."""
        return {key: getattr(self, key) for key in TRAINER_ALGO_KEYS}


def check_algorithm_fields(algorithm: str, group_size: int, kl_coef: float, fields: AlgorithmFields) -> None:
    """Raise ValueError, saying what to set, for settings the algorithm or KL controller cannot run with."""
    if algorithm in GROUP_ALGORITHMS and group_size < 2:
        raise ValueError(
            f"group_size must be greater than or equal to 2 for {algorithm} (its advantages compare the "
            f"samples of one prompt); got {group_size}"
        )
    if fields.kl_ctrl == "adaptive" and (fields.kl_target is None or kl_coef <= 0.0):
        raise ValueError(
            "kl_ctrl 'adaptive' needs kl_target > 0 and kl_coef > 0 (a multiplicative controller started "
            "at 0 stays at 0); set kl_target and kl_coef"
        )
    if fields.kl_ctrl == "scheduled" and fields.kl_total_steps is None:
        raise ValueError("kl_ctrl 'scheduled' needs kl_total_steps (in samples); set kl_total_steps")


def advance_kl_controller(controller: AnyKLController, metrics: dict[str, float], num_samples: int) -> None:
    """Feed a step's measured KL (``metrics["kl"]``) to the controller, counting ``num_samples``.

    A step that measured no KL (no reference model) leaves an adaptive controller where it is;
    a scheduled one advances all the same.
    """
    kl = metrics.get("kl")
    if kl is None and controller.kind == "adaptive":
        return
    controller.update(float(kl or 0.0), n_steps=num_samples)
