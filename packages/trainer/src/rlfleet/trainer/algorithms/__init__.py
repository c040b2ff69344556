"""The algorithms, one file each, and the table that names them.

Each file owns an algorithm's advantages and its loss, and turns a batch into a
:class:`~rlfleet.trainer.loop.Plan` (:meth:`Algorithm.plan`) whose objectives are the losses the
update loop (:mod:`rlfleet.trainer.loop`) runs; the loop names no algorithm:

- ``grpo``: group-normalised advantages and the clipped policy loss, with the pieces the others
  share (the clipped surrogate, the aggregation modes, the KL estimators, the old and reference
  logprobs of a step);
- ``dr_grpo``: GRPO's step with group-centred advantages (Dr. GRPO);
- ``rloo``: GRPO's step with leave-one-out advantages;
- ``reinforce_pp``: GRPO's step with batch-whitened (token) returns;
- ``ppo``: GAE over a critic, the critic's clipped value loss, GRPO's clipped policy loss;
- ``dpo``: the DPO loss on preference pairs.

:data:`TRAINER_ALGORITHMS` is keyed by the config's ``algorithm.name``, like the torch-free table of
what each algorithm needs (critic, reference, groups, online:
:data:`rlfleet.common.schema.algorithms.ALGORITHMS`); ``tests/trainer/test_algo_registry.py``
checks that the two have the same keys and that each algorithm's code does what its row says.
Adding an algorithm is one file here and one row in each table.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from torch import Tensor

from rlfleet.common.schema.trainer import StepSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.dpo import DPO
from rlfleet.trainer.algorithms.dr_grpo import DrGRPO
from rlfleet.trainer.algorithms.grpo import GRPO
from rlfleet.trainer.algorithms.ppo import PPO
from rlfleet.trainer.algorithms.reinforce_pp import ReinforcePP
from rlfleet.trainer.algorithms.rloo import RLOO
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.loop import Plan


class Algorithm(Protocol):
    """One algorithm's step: its advantages and its losses, as a plan for the update loop."""

    def plan(
        self, actor: Actor, critic: Critic | None, batch: Mapping[str, Tensor], scores: Tensor,
        settings: StepSettings,
    ) -> Plan:  # fmt: skip
        """The step on ``batch`` (a rollout batch and its scores (N,), or preference pairs) with
        ``settings``: the no-grad forwards and advantages done, the losses ready to run."""
        ...


TRAINER_ALGORITHMS: dict[str, Algorithm] = {
    "ppo": PPO(),
    "grpo": GRPO(),
    "dr_grpo": DrGRPO(),
    "rloo": RLOO(),
    "reinforce_pp": ReinforcePP(),
    "dpo": DPO(),
}
"""Algorithm name (the config's ``algorithm.name``) -> its step."""
