"""The trainer's side of the algorithm table: the torch function behind each spec's ``policy_loss``.

What each ``algorithm: ppo | grpo | rloo | reinforce_pp | dpo`` needs (critic, reference, groups,
advantage estimator, loss, default KL placement) is the shared table
:data:`rlfleet.common.schema.algorithms.ALGORITHMS`, re-exported here; this module only adds the
loss functions it names.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from rlfleet.common.schema.algorithms import ALGORITHM_NAMES, ALGORITHMS, GAE, AlgorithmName, AlgorithmSpec
from rlfleet.trainer.algorithms.dpo import dpo_loss
from rlfleet.trainer.algorithms.losses import ppo_policy_loss

__all__ = ["ALGORITHMS", "ALGORITHM_NAMES", "GAE", "POLICY_LOSSES", "AlgorithmName", "AlgorithmSpec"]

POLICY_LOSSES: dict[str, Callable[..., Any]] = {
    "ppo_clip": ppo_policy_loss,
    "dpo": dpo_loss,
}
"""Policy loss name (an :class:`AlgorithmSpec`'s ``policy_loss``) -> function: ``ppo_clip`` is
``ppo_policy_loss(logp, old_logp, adv, mask, ...)``, ``dpo`` is
``dpo_loss(pi_c, pi_r, ref_c, ref_r, ...)``."""
