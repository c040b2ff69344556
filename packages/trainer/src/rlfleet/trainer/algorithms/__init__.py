"""RL algorithm pieces as pure tensor functions, and the registries that name them.

Registries are plain dicts keyed by the config's discriminator: ``ADVANTAGES["grpo"]`` is
``grpo_advantages``. Every advantage function has the signature
``fn(rewards (N,), group_index (N,), **kwargs) -> (N,)``.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import Tensor

from rlfleet.trainer.algorithms.advantages import (
    broadcast_to_tokens,
    dr_grpo_advantages,
    group_stats,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
)
from rlfleet.trainer.algorithms.aggregation import (
    LOSS_AGG_MODES,
    LossAgg,
    aggregate,
    masked_mean,
    masked_sum,
)
from rlfleet.trainer.algorithms.kl import KL_ESTIMATORS, kl_k1, kl_k2, kl_k3
from rlfleet.trainer.algorithms.losses import (
    approx_kl,
    entropy_from_logits,
    masked_entropy,
    ppo_clip_loss,
    ppo_policy_loss,
)

ADVANTAGES: dict[str, Callable[..., Tensor]] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
    "reinforce_pp": reinforce_pp_advantages,
    "reinforce_pp_baseline": reinforce_pp_baseline_advantages,
}
"""Advantage estimator name -> ``fn(rewards (N,), group_index (N,), **kwargs) -> (N,)``."""

__all__ = [
    "ADVANTAGES",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LossAgg",
    "aggregate",
    "approx_kl",
    "broadcast_to_tokens",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "group_stats",
    "grpo_advantages",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "masked_entropy",
    "masked_mean",
    "masked_sum",
    "ppo_clip_loss",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
]
