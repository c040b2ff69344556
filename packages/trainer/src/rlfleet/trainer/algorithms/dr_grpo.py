"""Dr. GRPO: GRPO without its two normalisations, on GRPO's clipped loss and step.

Dr. GRPO (Liu et al., 2025, "Understanding R1-Zero-Like Training: A Critical Perspective") finds
two biases in GRPO and removes both:

- the group's std in the advantage favours prompts whose answers all score alike (too easy or too
  hard); Dr. GRPO only centres::

      A_i = r_i - mean_g(r)                                 (a group of one: 0)

- GRPO's 1 / |o_i| (each sequence's token mean) makes a long wrong answer cost less per token than
  a short one; Dr. GRPO sums each sequence's token losses and divides by one constant instead::

      loss = 1/N * sum_i sum_t l_{i,t} / L                   L: the batch's response width R

The loss is GRPO's clipped surrogate (:mod:`rlfleet.trainer.algorithms.grpo`), aggregated as the
step's ``loss_agg`` says: the paper's aggregation is ``seq-mean-token-sum-norm`` (verl's name;
TRL's ``loss_type="dr_grpo"``, which divides by ``max_completion_length``), a choice every
policy-gradient algorithm has. As in verl (``norm_adv_by_std_in_grpo: false`` with
``loss_agg_mode: seq-mean-token-sum-norm``) and TRL (``scale_rewards`` off with
``loss_type="dr_grpo"``) the paper's recipe is the two settings together::

    algorithm: dr_grpo
    loss_agg: seq-mean-token-sum-norm

This file and its row in the two algorithm tables (:data:`rlfleet.trainer.algorithms.TRAINER_ALGORITHMS`
and :data:`rlfleet.common.schema.algorithms.ALGORITHMS`) are all that adding it took; the
aggregation is one more mode of ``loss_agg``.
"""

from __future__ import annotations

import logging

from torch import Tensor

from rlfleet.trainer.algorithms.grpo import GRPO, grpo_advantages

logger = logging.getLogger(__name__)


def dr_grpo_advantages(rewards: Tensor, group_index: Tensor) -> Tensor:
    """Dr. GRPO: ``r - mean_group``, no std normalization. (N,) x (N,) -> (N,)."""
    return grpo_advantages(rewards, group_index, norm_by_std=False)


class DrGRPO(GRPO):
    """Dr. GRPO's step: GRPO's with group-centred advantages (no std)."""

    def advantages(self, scores: Tensor, group_index: Tensor) -> Tensor:
        """Group-centred advantages: scores (N,), the prompt of each (N,) -> (N,)."""
        return dr_grpo_advantages(scores, group_index)
