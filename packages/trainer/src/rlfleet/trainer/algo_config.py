"""The per-algorithm settings of a trainer worker beyond the shared policy-loss ones.

:class:`AlgorithmSettings` is the ``algo`` section of the trainer service config: where the KL
term goes and how it is estimated, PPO's GAE and critic, and DPO's loss. ``None`` means "the
algorithm's default" (see :data:`~rlfleet.trainer.algorithms.specs.ALGORITHMS`), resolved here so
every code path agrees.
"""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rlfleet.trainer.algorithms.specs import ALGORITHMS

logger = logging.getLogger(__name__)

KLMode = Literal["loss", "reward"]
KLEstimator = Literal["k1", "k2", "k3"]


class AlgorithmSettings(BaseModel):
    """KL placement, PPO (GAE, critic) and DPO settings of one run."""

    model_config = ConfigDict(extra="forbid")

    kl_mode: KLMode | None = Field(
        default=None,
        description="KL to the reference in the loss or in the reward; None: the algorithm's default "
        "(reward for ppo, rloo, reinforce_pp; loss for grpo)",
    )
    kl_estimator: KLEstimator | None = Field(
        default=None, description="per-token KL estimator; None: k1 in the reward, k3 in the loss"
    )
    gamma: float = Field(default=1.0, ge=0.0, le=1.0, description="discount (PPO GAE, REINFORCE++ returns)")
    lam: float = Field(default=0.95, ge=0.0, le=1.0, description="GAE lambda (PPO)")
    whiten_advantages: bool = Field(default=True, description="PPO: whiten GAE advantages over the batch")
    value_clip: float | None = Field(
        default=0.2, gt=0.0, description="PPO critic: clip range around the rollout-time values; None: off"
    )
    critic_model_path: str | None = Field(
        default=None, description="PPO critic backbone (local HF dir); None: the actor's checkpoint"
    )
    critic_learning_rate: float | None = Field(
        default=None, gt=0.0, description="critic AdamW learning rate; None: the actor's"
    )
    beta: float = Field(default=0.1, gt=0.0, description="DPO inverse temperature of the implicit reward")
    dpo_loss: Literal["sigmoid", "ipo"] = Field(default="sigmoid", description="DPO loss type")
    label_smoothing: float = Field(
        default=0.0, ge=0.0, lt=0.5, description="conservative DPO: probability that a label is flipped"
    )

    def resolved_kl_mode(self, algorithm: str) -> KLMode:
        """Where the KL term goes for ``algorithm``: the configured mode or the algorithm's default."""
        if self.kl_mode is not None:
            return self.kl_mode
        return ALGORITHMS[algorithm].default_kl_mode or "loss"

    def resolved_kl_estimator(self, algorithm: str) -> KLEstimator:
        """The configured estimator, else k1 for a KL in the reward and k3 for one in the loss."""
        if self.kl_estimator is not None:
            return self.kl_estimator
        return "k1" if self.resolved_kl_mode(algorithm) == "reward" else "k3"
