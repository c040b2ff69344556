"""The policy losses, one file each, and the table that names them (``update.policy_loss``).

A policy loss turns a micro-batch's logprobs under the policy being updated (with gradient), those
of the policy that sampled (``old``, no gradient) and the advantages into a loss per token, which
the step then reweights (off-policy corrections), aggregates (``loss_agg``) and adds the entropy and
KL terms to (:class:`~rlfleet.trainer.algorithms.grpo.PolicyObjective`). Every policy-gradient
algorithm (ppo, grpo, dr_grpo, rloo, reinforce_pp) takes any of them:

- ``ppo_clip``: PPO's clipped surrogate, with DAPO's asymmetric clip (:mod:`.ppo_clip`);
- ``gspo``: a sequence-level ratio and clip (:mod:`.gspo`);
- ``cispo``: clipped importance weights on a REINFORCE loss (:mod:`.cispo`).

:data:`TRAINER_POLICY_LOSSES` is keyed like the torch-free table of what each computes
(:data:`rlfleet.common.schema.algorithms.POLICY_LOSSES`, whose literal is the setting's type);
``tests/trainer/test_policy_losses.py`` checks the two agree and each loss against hand-computed
values and gradients. Adding a loss is one file here and one row in each table.
"""

from __future__ import annotations

from typing import Protocol

from torch import Tensor

from rlfleet.common.schema.trainer import UpdateSettings
from rlfleet.trainer.algorithms.policy_losses.cispo import cispo_loss
from rlfleet.trainer.algorithms.policy_losses.gspo import gspo_loss
from rlfleet.trainer.algorithms.policy_losses.ppo_clip import ppo_clip_policy_loss


class PolicyLoss(Protocol):
    def __call__(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor, update: UpdateSettings
    ) -> tuple[Tensor, Tensor]:
        """Per-token loss (N, R) and where the clip acted (N, R, 1.0/0.0), from (N, R) logprobs with
        gradient, the sampling policy's, the advantages and the response mask."""
        ...


TRAINER_POLICY_LOSSES: dict[str, PolicyLoss] = {
    "ppo_clip": ppo_clip_policy_loss,
    "gspo": gspo_loss,
    "cispo": cispo_loss,
}
"""Policy loss name (``update.policy_loss``) -> its per-token loss."""
