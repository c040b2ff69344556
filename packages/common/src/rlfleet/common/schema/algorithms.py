"""The algorithm table: what each ``algorithm: ppo | grpo | dr_grpo | rloo | reinforce_pp | dpo`` needs.

The controller reads it to decide which tiers a run starts (rollout and reward for online
algorithms) and to check the config (groups need ``group_size >= 2``); the trainer reads it to
decide which models to load (critic, reference) and where the KL term goes by default. One table,
torch-free; each algorithm's code (its advantages and its loss) is one file of
``rlfleet.trainer.algorithms``, registered under the same key in its ``TRAINER_ALGORITHMS``, and a
trainer test checks that the code does what each row says.

``dr_grpo`` (Dr. GRPO, Liu et al., 2025) is a row of its own, not a GRPO setting: its advantages
differ (group-centred, no std), which is what an algorithm's file owns. Its other change, the
aggregation by a constant, is a ``loss_agg`` choice (``seq-mean-token-sum-norm``) open to every
policy-gradient algorithm; the paper's recipe sets both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

AlgorithmName = Literal["ppo", "grpo", "dr_grpo", "rloo", "reinforce_pp", "dpo"]
ALGORITHM_NAMES: tuple[str, ...] = get_args(AlgorithmName)
KLMode = Literal["loss", "reward"]


@dataclass(frozen=True)
class AlgorithmSpec:
    """The static facts of one algorithm."""

    name: str
    needs_critic: bool
    """A value model is trained beside the policy (PPO)."""
    needs_reference: bool
    """A frozen reference model is always needed (PPO, DPO); the others need one only when a KL
    coefficient is set (see :meth:`uses_reference`)."""
    uses_groups: bool
    """Advantages compare the samples of one prompt, so each prompt is sampled ``group_size`` times."""
    online: bool
    """Generates rollouts and scores them (rollout and reward tiers); False for DPO."""
    default_kl_mode: KLMode | None
    """Where the KL term goes unless configured (OpenRLHF/verl habits); None: no KL term (DPO)."""

    def uses_reference(self, kl_coef: float) -> bool:
        """Whether the run must load a reference model, given its (initial) KL coefficient."""
        return self.needs_reference or kl_coef > 0.0


def _online(name: str, *, critic: bool = False, groups: bool = False, kl: KLMode = "reward") -> AlgorithmSpec:
    return AlgorithmSpec(name=name, needs_critic=critic, needs_reference=critic, uses_groups=groups,
                         online=True, default_kl_mode=kl)  # fmt: skip


ALGORITHMS: dict[str, AlgorithmSpec] = {
    "ppo": _online("ppo", critic=True),
    "grpo": _online("grpo", groups=True, kl="loss"),
    "dr_grpo": _online("dr_grpo", groups=True, kl="loss"),
    "rloo": _online("rloo", groups=True),
    "reinforce_pp": _online("reinforce_pp"),
    "dpo": AlgorithmSpec(
        name="dpo",
        needs_critic=False,
        needs_reference=True,
        uses_groups=False,
        online=False,
        default_kl_mode=None,
    ),  # fmt: skip
}
"""Algorithm name (the config's ``algorithm``) -> its :class:`AlgorithmSpec`."""


PolicyLossName = Literal["ppo_clip", "gspo", "cispo"]
POLICY_LOSSES: dict[str, str] = {
    "ppo_clip": "PPO's clipped surrogate per token, ratio clipped to [1 - clip_eps, 1 + clip_eps_high] "
    "(DAPO's clip-higher: clip_eps_high > clip_eps)",
    "gspo": "GSPO: one importance ratio per sequence (the geometric mean of its tokens' ratios), clipped "
    "per sequence; the gradient reaches every token (GSPO-token)",
    "cispo": "CISPO: REINFORCE on every token, weighted by its importance ratio clipped to "
    "[1 - clip_eps, 1 + clip_eps_high] without gradient, so no token's gradient is dropped",
}
"""Policy loss (``update.policy_loss``) -> what it computes. Every policy-gradient algorithm takes
any of them; each is one file of ``rlfleet.trainer.algorithms.policy_losses`` registered under the
same key (``tests/trainer/test_policy_losses.py`` checks the two tables agree)."""
