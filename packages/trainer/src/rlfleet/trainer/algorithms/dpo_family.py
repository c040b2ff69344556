"""DPO on a preference batch (the contract of :mod:`rlfleet.common.schema.batch`): its loss on
micro-batches of pairs, and how one step becomes a :class:`~rlfleet.trainer.loop.Plan`.

The N pairs become 2N sequences ``prompt ++ response`` (rows 0..N-1 chosen, N..2N-1 rejected;
:func:`~rlfleet.common.schema.batch.pairs_as_rollouts`), so they go through the same inputs,
micro-batching and logprob code as rollouts; the loop's items are the pairs::

    batch ──pairs_as_rollouts──> (2N, P) / (2N, max(C, J)) ──build_policy_inputs──> inputs
      │ no grad: reference sequence logprobs (2N,), unless the batch brings them
      v
    train_loop: for mini-batch of pairs: for micro-batch of pairs (its 2k sequences):
        pi_c, pi_r = sequence_logprobs(policy)
        loss = dpo_loss(pi_c, pi_r, ref_c, ref_r, num_pairs=mini-batch size); backward

Under several ranks each mini-batch's pairs are split over the ranks by length (padding copies
weigh 0), as the loop does for every objective. The loss itself is
:func:`~rlfleet.trainer.algorithms.dpo.dpo_loss`.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from rlfleet.common.schema.batch import REF_FIELDS, check_pairs, pairs_as_rollouts
from rlfleet.common.schema.trainer import StepSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms import dpo_loss, sequence_logprobs
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.forward import PolicyInputs, build_policy_inputs
from rlfleet.trainer.loop import Divisors, Plan, batch_sizes
from rlfleet.trainer.shared_prompt import PromptLayout

logger = logging.getLogger(__name__)


def reference_logps(
    actor: Actor,
    batch: Mapping[str, Tensor],
    inputs: PolicyInputs,
    micro_pairs: int,
    temperature: float = 1.0,
) -> Tensor:
    """(2N,) reference sequence log-probs: the batch's precomputed ones, else the frozen reference's."""
    if all(key in batch for key in REF_FIELDS):
        return torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]]).to(actor.device).float()
    token_ref = actor.compute_logprobs(
        inputs, micro_batch_size=2 * micro_pairs, temperature=temperature, reference=True
    )
    return sequence_logprobs(token_ref, inputs.response_mask)


@dataclass
class DPOObjective:
    """The DPO loss (``settings.beta``, ``dpo_loss``, ``label_smoothing``) on micro-batches of the N
    pairs of ``inputs`` (2N sequences), against the reference sequence log-probs ``ref`` (2N,)."""

    actor: Actor
    inputs: PolicyInputs
    ref: Tensor
    settings: StepSettings
    keys: ClassVar[tuple[str, ...]] = (
        "loss", "dpo/chosen_reward", "dpo/rejected_reward", "dpo/accuracy", "dpo/margin",
    )  # fmt: skip

    def __post_init__(self) -> None:
        self.num_pairs = self.inputs.num_samples // 2
        lengths = self.inputs.attention_mask.sum(dim=-1)
        self.lengths = lengths[: self.num_pairs] + lengths[self.num_pairs :]
        # a pair's two rows share their prompt and always run in one forward: no reordering needed
        self.prompts: PromptLayout | None = None

    @property
    def trainable(self) -> Actor:
        return self.actor

    def divisors(self, rows: Tensor) -> Divisors:
        return Divisors(num_tokens=1.0, num_seqs=float(len(rows)))  # the loss is a mean over pairs

    def micro_loss(self, chunk: Tensor, weights: Tensor, divisors: Divisors) -> tuple[Tensor, Tensor]:
        """Loss share of the pairs ``chunk`` (k,) and the shares of :attr:`keys` (see the loop)."""
        s, n, k = self.settings, self.num_pairs, len(chunk)
        mb = self.inputs.select(torch.cat([chunk, chunk + n]))
        logp, _ = self.actor.logprobs(mb, temperature=s.temperature, entropy=False)
        logps = sequence_logprobs(logp, mb.response_mask)
        loss, metrics = dpo_loss(
            logps[:k], logps[k:], self.ref[chunk], self.ref[chunk + n], beta=s.beta, loss_type=s.dpo_loss,
            label_smoothing=s.label_smoothing, num_pairs=divisors.num_seqs, weights=weights,
        )  # fmt: skip
        share = float(weights.sum().item()) / divisors.num_seqs  # chunk means -> mini-batch shares
        values = [loss.detach(), *(metrics[name.split("/", 1)[1]] * share for name in self.keys[1:])]
        return loss, torch.stack([value.double() for value in values])

    def metrics(self, sums: list[float]) -> dict[str, float]:
        return dict(zip(self.keys, sums, strict=True))


def plan(
    actor: Actor, critic: Critic | None, batch: Mapping[str, Tensor], scores: Tensor, settings: StepSettings
) -> Plan:
    """DPO on N pairs: ``ppo_epochs`` passes in ``num_updates`` mini-batches of pairs, in order.

    ``micro_batch_size`` counts pairs (a pair is two sequences); ``critic`` and ``scores`` are not
    used. The metrics add ``response_length`` (mean tokens of the chosen and rejected responses).
    """
    n = check_pairs(batch)
    inputs = build_policy_inputs(pairs_as_rollouts(batch)).to(actor.device)
    _, micro = batch_sizes(settings, n)
    ref = reference_logps(actor, batch, inputs, micro, settings.temperature)
    metrics = {"response_length": float(inputs.response_mask.sum(dim=-1).float().mean().item())}
    return Plan([DPOObjective(actor, inputs, ref, settings)], settings, n, metrics=metrics)
