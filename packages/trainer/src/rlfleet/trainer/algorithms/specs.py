"""What each algorithm of ``algorithm: ppo | grpo | rloo | reinforce_pp | dpo`` needs from the system.

An :class:`AlgorithmSpec` tells the controller and the trainer which models to load (critic,
reference), which services to start (rollout and reward for online algorithms; neither for DPO),
which advantage estimator and which loss to use, and where the KL term goes by default.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_args

from rlfleet.trainer.algorithms.dpo import dpo_loss
from rlfleet.trainer.algorithms.losses import ppo_policy_loss

logger = logging.getLogger(__name__)

AlgorithmName = Literal["ppo", "grpo", "rloo", "reinforce_pp", "dpo"]
ALGORITHM_NAMES: tuple[str, ...] = get_args(AlgorithmName)

GAE = "gae"
"""Advantage estimator name of PPO: token-level GAE over a critic (see ``gae.gae_advantages``);
the other names are keys of ``ADVANTAGES``."""

POLICY_LOSSES: dict[str, Callable[..., Any]] = {
    "ppo_clip": ppo_policy_loss,
    "dpo": dpo_loss,
}
"""Policy loss name -> function: ``ppo_clip`` is ``ppo_policy_loss(logp, old_logp, adv, mask, ...)``,
``dpo`` is ``dpo_loss(pi_c, pi_r, ref_c, ref_r, ...)``."""


@dataclass(frozen=True)
class AlgorithmSpec:
    """The static facts of one algorithm."""

    name: str
    needs_critic: bool
    """A value model is trained beside the policy (PPO)."""
    needs_reference: bool
    """A frozen reference model is always needed (PPO, DPO); the others need one only when a
    KL coefficient is set (see :meth:`uses_reference`)."""
    advantage: str | None
    """Advantage estimator: ``gae`` or a key of ``ADVANTAGES``; None for DPO."""
    uses_groups: bool
    """Advantages compare the samples of one prompt, so each prompt is sampled ``group_size`` times."""
    policy_loss: str
    """Key of :data:`POLICY_LOSSES`."""
    online: bool
    """Generates rollouts and scores them (rollout and reward services); False for DPO."""
    default_kl_mode: Literal["loss", "reward"] | None
    """Where the KL term goes unless configured (OpenRLHF/verl habits); None: no KL term (DPO)."""

    def uses_reference(self, kl_coef: float) -> bool:
        """Whether the run must load a reference model, given its (initial) KL coefficient."""
        return self.needs_reference or kl_coef > 0.0


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "ppo": AlgorithmSpec(
        name="ppo",
        needs_critic=True,
        needs_reference=True,
        advantage=GAE,
        uses_groups=False,
        policy_loss="ppo_clip",
        online=True,
        default_kl_mode="reward",
    ),
    "grpo": AlgorithmSpec(
        name="grpo",
        needs_critic=False,
        needs_reference=False,
        advantage="grpo",
        uses_groups=True,
        policy_loss="ppo_clip",
        online=True,
        default_kl_mode="loss",
    ),
    "rloo": AlgorithmSpec(
        name="rloo",
        needs_critic=False,
        needs_reference=False,
        advantage="rloo",
        uses_groups=True,
        policy_loss="ppo_clip",
        online=True,
        default_kl_mode="reward",
    ),
    "reinforce_pp": AlgorithmSpec(
        name="reinforce_pp",
        needs_critic=False,
        needs_reference=False,
        advantage="reinforce_pp",
        uses_groups=False,
        policy_loss="ppo_clip",
        online=True,
        default_kl_mode="reward",
    ),
    "dpo": AlgorithmSpec(
        name="dpo",
        needs_critic=False,
        needs_reference=True,
        advantage=None,
        uses_groups=False,
        policy_loss="dpo",
        online=False,
        default_kl_mode=None,
    ),
}
"""Algorithm name (the config's ``algorithm``) -> its :class:`AlgorithmSpec`."""
