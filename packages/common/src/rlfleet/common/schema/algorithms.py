"""The algorithm table: what each ``algorithm: ppo | grpo | rloo | reinforce_pp | dpo`` needs.

The controller reads it to decide which tiers a run starts (rollout and reward for online
algorithms) and to check the config (groups need ``group_size >= 2``); the trainer reads it to
decide which models to load (critic, reference), which advantage estimator and loss to run and
where the KL term goes by default. One table, torch-free; the functions it names live in
``rlfleet.trainer.algorithms``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

AlgorithmName = Literal["ppo", "grpo", "rloo", "reinforce_pp", "dpo"]
ALGORITHM_NAMES: tuple[str, ...] = get_args(AlgorithmName)
KLMode = Literal["loss", "reward"]

GAE = "gae"
"""Advantage estimator of PPO: token-level GAE over a critic; the other names are keys of the
trainer's ``ADVANTAGES``."""


@dataclass(frozen=True)
class AlgorithmSpec:
    """The static facts of one algorithm."""

    name: str
    needs_critic: bool
    """A value model is trained beside the policy (PPO)."""
    needs_reference: bool
    """A frozen reference model is always needed (PPO, DPO); the others need one only when a KL
    coefficient is set (see :meth:`uses_reference`)."""
    advantage: str | None
    """Advantage estimator: ``gae`` or a key of the trainer's ``ADVANTAGES``; None for DPO."""
    uses_groups: bool
    """Advantages compare the samples of one prompt, so each prompt is sampled ``group_size`` times."""
    policy_loss: Literal["ppo_clip", "dpo"]
    """The trainer's loss family."""
    online: bool
    """Generates rollouts and scores them (rollout and reward tiers); False for DPO."""
    default_kl_mode: KLMode | None
    """Where the KL term goes unless configured (OpenRLHF/verl habits); None: no KL term (DPO)."""

    def uses_reference(self, kl_coef: float) -> bool:
        """Whether the run must load a reference model, given its (initial) KL coefficient."""
        return self.needs_reference or kl_coef > 0.0


def _online(name: str, *, critic: bool = False, groups: bool = False, kl: KLMode = "reward") -> AlgorithmSpec:
    advantage = GAE if critic else name
    return AlgorithmSpec(name=name, needs_critic=critic, needs_reference=critic, advantage=advantage,
                         uses_groups=groups, policy_loss="ppo_clip", online=True,
                         default_kl_mode=kl)  # fmt: skip


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "ppo": _online("ppo", critic=True),
    "grpo": _online("grpo", groups=True, kl="loss"),
    "rloo": _online("rloo", groups=True),
    "reinforce_pp": _online("reinforce_pp"),
    "dpo": AlgorithmSpec(
        name="dpo",
        needs_critic=False,
        needs_reference=True,
        advantage=None,
        uses_groups=False,
        policy_loss="dpo",
        online=False,
        default_kl_mode=None,
    ),  # fmt: skip
}
"""Algorithm name (the config's ``algorithm``) -> its :class:`AlgorithmSpec`."""
