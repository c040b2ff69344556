"""RL algorithm pieces as pure tensor functions, the registries that name them, and the families.

The math is here and in the modules beside this one. What a step of each family does with it
(advantages, objectives for the update loop) is in ``ppo_family`` (ppo, grpo, rloo, reinforce_pp)
and ``dpo_family``; they are not imported here (they need the models).

Registries are plain dicts keyed by the config's discriminator: ``ADVANTAGES["grpo"]`` is
``grpo_advantages``. Every advantage function has the signature
``fn(rewards (N,), group_index (N,), **kwargs) -> (N,)``; PPO's token-level GAE
(``gae_advantages``) is named ``"gae"`` and lives apart because it needs a critic.

- ``ALGORITHMS``: algorithm name -> :class:`AlgorithmSpec` (critic? reference? groups? loss?), the
  shared table of :mod:`rlfleet.common.schema.algorithms`;
- ``POLICY_LOSSES``: loss name -> function (``ppo_clip``, ``dpo``);
- ``KL_ESTIMATORS``: ``k1 | k2 | k3`` (the KL controllers are the controller's, in
  ``rlfleet.controller.online``);
- ``DPO_LOSSES``: ``sigmoid | ipo``; ``LOSS_AGG_MODES``: the aggregation modes (all three and the
  loss terms are in ``losses``).
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
from rlfleet.trainer.algorithms.dpo import (
    DPO_LOSS_TYPES,
    DPO_LOSSES,
    DPOLossType,
    dpo_loss,
    dpo_sigmoid_losses,
    ipo_losses,
    sequence_logprobs,
)
from rlfleet.trainer.algorithms.gae import (
    discounted_returns,
    gae_advantages,
    last_token_index,
    masked_whiten,
    token_level_rewards,
)
from rlfleet.trainer.algorithms.losses import (
    KL_ESTIMATORS,
    LOSS_AGG_MODES,
    LossAgg,
    aggregate,
    approx_kl,
    entropy_from_logits,
    kl_k1,
    kl_k2,
    kl_k3,
    masked_entropy,
    masked_mean,
    masked_sum,
    ppo_clip_loss,
    ppo_policy_loss,
)
from rlfleet.trainer.algorithms.specs import (
    ALGORITHM_NAMES,
    ALGORITHMS,
    GAE,
    POLICY_LOSSES,
    AlgorithmName,
    AlgorithmSpec,
)
from rlfleet.trainer.algorithms.value import clipped_value_loss, explained_variance, value_loss

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
    "ALGORITHMS",
    "ALGORITHM_NAMES",
    "AlgorithmName",
    "AlgorithmSpec",
    "DPOLossType",
    "DPO_LOSSES",
    "DPO_LOSS_TYPES",
    "GAE",
    "KL_ESTIMATORS",
    "LOSS_AGG_MODES",
    "LossAgg",
    "POLICY_LOSSES",
    "aggregate",
    "approx_kl",
    "broadcast_to_tokens",
    "clipped_value_loss",
    "discounted_returns",
    "dpo_loss",
    "dpo_sigmoid_losses",
    "dr_grpo_advantages",
    "entropy_from_logits",
    "explained_variance",
    "gae_advantages",
    "group_stats",
    "grpo_advantages",
    "ipo_losses",
    "kl_k1",
    "kl_k2",
    "kl_k3",
    "last_token_index",
    "masked_entropy",
    "masked_mean",
    "masked_sum",
    "masked_whiten",
    "ppo_clip_loss",
    "ppo_policy_loss",
    "reinforce_pp_advantages",
    "reinforce_pp_baseline_advantages",
    "rloo_advantages",
    "sequence_logprobs",
    "token_level_rewards",
    "value_loss",
]
