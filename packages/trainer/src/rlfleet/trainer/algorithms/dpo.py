"""DPO: direct preference optimization on (chosen, rejected) pairs: its loss, and its step.

DPO (Rafailov et al., 2023) needs no reward model and no rollouts: from the sequence
log-probabilities of the chosen and rejected responses under the policy (pi) and the frozen
reference (ref), with ``h = (pi_c - ref_c) - (pi_r - ref_r)``:

- ``sigmoid`` (Rafailov et al., 2023): ``-logsigmoid(beta * h)``; with ``label_smoothing = s``
  (conservative DPO, labels flipped with probability s):
  ``-(1 - s) * logsigmoid(beta * h) - s * logsigmoid(-beta * h)``;
- ``ipo`` (Azar et al., 2023): ``(h - 1 / (2 * beta))^2``; the paper uses length-averaged log-probs
  (``sequence_logprobs(..., average=True)``).

The implicit rewards are ``beta * (pi - ref)`` of each response; the metrics are their batch means,
the accuracy (chosen reward strictly above the rejected one) and the margin (chosen - rejected).

One step on a preference batch (the contract of :mod:`rlfleet.common.schema.batch`): the N pairs
become 2N sequences ``prompt ++ response`` (rows 0..N-1 chosen, N..2N-1 rejected;
:func:`~rlfleet.common.schema.batch.pairs_as_rollouts`), so they go through the same inputs,
micro-batching and logprob code as rollouts (:mod:`rlfleet.trainer.policy`); the loop's items are
the pairs::

    batch ──pairs_as_rollouts──> (2N, P) / (2N, max(C, J)) ──build_policy_inputs──> inputs
      │ no grad: reference sequence logprobs (2N,), unless the batch brings them
      v
    train_loop: for mini-batch of pairs: for micro-batch of pairs (its 2k sequences):
        pi_c, pi_r = sequence_logprobs(policy)
        loss = dpo_loss(pi_c, pi_r, ref_c, ref_r, num_pairs=mini-batch size); backward

Under several ranks each mini-batch's pairs are split over the ranks by length (padding copies
weigh 0), as the loop does for every objective.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args

import torch
import torch.nn.functional as F
from torch import Tensor

from rlfleet.common.schema.batch import REF_FIELDS, check_pairs, pairs_as_rollouts
from rlfleet.common.schema.trainer import StepSettings
from rlfleet.trainer import policy
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.loop import Divisors, Plan, batch_sizes

logger = logging.getLogger(__name__)

DPOLossType = Literal["sigmoid", "ipo"]


def sequence_logprobs(token_logprobs: Tensor, mask: Tensor, *, average: bool = False) -> Tensor:
    """Sum (or mean) of token log-probs over the real tokens of each row.

    Args:
        token_logprobs: (N, R) log-probs of the response tokens.
        mask: (N, R) 1 for the response tokens that count (not the prompt, not padding).
        average: divide by the number of real tokens (IPO, SimPO-style length normalization).

    Returns:
        (N,); 0 for an all-masked row.
    """
    if token_logprobs.shape != mask.shape or token_logprobs.ndim != 2:
        raise ValueError(
            f"token_logprobs {tuple(token_logprobs.shape)} and mask {tuple(mask.shape)} must both be (N, R)"
        )
    weights = mask.to(token_logprobs.dtype)
    total = (token_logprobs * weights).sum(dim=-1)
    return total / weights.sum(dim=-1).clamp(min=1.0) if average else total


def dpo_sigmoid_losses(logits: Tensor, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """Per-pair (conservative) DPO loss from ``h = policy log-ratio - reference log-ratio``: (N,) -> (N,)."""
    if not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"label_smoothing must be in [0, 0.5); got {label_smoothing}")
    loss = -F.logsigmoid(beta * logits) * (1.0 - label_smoothing)
    if label_smoothing > 0.0:
        loss = loss - F.logsigmoid(-beta * logits) * label_smoothing
    return loss


def ipo_losses(logits: Tensor, *, beta: float, label_smoothing: float = 0.0) -> Tensor:
    """Per-pair IPO loss ``(h - 1/(2 beta))^2``: (N,) -> (N,); label smoothing does not apply."""
    if label_smoothing != 0.0:
        raise ValueError(f"label_smoothing applies to the sigmoid loss only; got {label_smoothing} with ipo")
    return (logits - 1.0 / (2.0 * beta)) ** 2


DPO_LOSSES: dict[str, Callable[..., Tensor]] = {"sigmoid": dpo_sigmoid_losses, "ipo": ipo_losses}
"""DPO loss type -> ``fn(logits (N,), *, beta, label_smoothing) -> (N,)``."""
DPO_LOSS_TYPES: tuple[str, ...] = get_args(DPOLossType)


def dpo_loss(
    policy_chosen: Tensor,
    policy_rejected: Tensor,
    ref_chosen: Tensor,
    ref_rejected: Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    num_pairs: float | None = None,
    weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """The DPO loss over a batch of preference pairs, and its metrics.

    Args:
        policy_chosen, policy_rejected: (N,) sequence log-probs under the policy (with grad).
        ref_chosen, ref_rejected: (N,) the same under the reference (no grad).
        beta: inverse temperature of the implicit reward (> 0).
        loss_type: ``sigmoid`` or ``ipo`` (see :data:`DPO_LOSSES`).
        label_smoothing: conservative-DPO flip probability in [0, 0.5) (sigmoid only).
        num_pairs: divisor of the summed per-pair losses; defaults to N. Pass the whole batch's
            count when these are one micro-batch of it, so micro-batch losses sum to the batch loss.
        weights: (N,) per-pair weights (1 counts, 0 ignores: a rank's padding copies); metrics are
            then weighted means. None: every pair counts.

    Returns:
        the scalar loss, and detached scalar metrics (means over these N pairs): ``chosen_reward``
        ``beta * (pi_c - ref_c)``, ``rejected_reward``, ``accuracy`` (chosen reward > rejected one)
        and ``margin`` (chosen reward - rejected reward).
    """
    n = policy_chosen.shape[0]
    others = {"policy_rejected": policy_rejected, "ref_chosen": ref_chosen, "ref_rejected": ref_rejected}
    for name, t in others.items():
        if policy_chosen.ndim != 1 or t.shape != policy_chosen.shape:
            raise ValueError(
                f"policy_chosen {tuple(policy_chosen.shape)} and {name} {tuple(t.shape)} must both be (N,)"
            )
    if beta <= 0.0:
        raise ValueError(f"beta must be > 0; got {beta}")
    if loss_type not in DPO_LOSSES:
        raise ValueError(f"loss_type must be one of {', '.join(DPO_LOSS_TYPES)}; got {loss_type!r}")
    chosen_logratio = policy_chosen - ref_chosen
    rejected_logratio = policy_rejected - ref_rejected
    logits = chosen_logratio - rejected_logratio
    losses = DPO_LOSSES[loss_type](logits, beta=beta, label_smoothing=label_smoothing)
    if weights is not None:
        losses = losses * weights
    counted = float(n) if weights is None else float(weights.sum().item())
    loss = losses.sum() / (max(counted, 1.0) if num_pairs is None else num_pairs)
    with torch.no_grad():
        chosen_reward = beta * chosen_logratio
        rejected_reward = beta * rejected_logratio
        per_pair = {
            "chosen_reward": chosen_reward,
            "rejected_reward": rejected_reward,
            "accuracy": (chosen_reward > rejected_reward).to(chosen_reward.dtype),
            "margin": chosen_reward - rejected_reward,
        }
        if weights is not None:
            per_pair = {k: v * weights for k, v in per_pair.items()}
        metrics = {k: v.sum() / max(counted, 1.0) for k, v in per_pair.items()}
    return loss, metrics


# --- the step on micro-batches of pairs -----------------------------------------------------------


def reference_logps(
    actor: Actor,
    batch: Mapping[str, Tensor],
    inputs: policy.PolicyInputs,
    micro_pairs: int,
    temperature: float = 1.0,
) -> Tensor:
    """(2N,) reference sequence log-probs: the batch's precomputed ones, else the frozen reference's."""
    if all(key in batch for key in REF_FIELDS):
        return torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]]).to(actor.device).float()
    token_ref = policy.compute_logprobs(
        actor, inputs, micro_batch_size=2 * micro_pairs, temperature=temperature, reference=True
    )
    return sequence_logprobs(token_ref, inputs.response_mask)


@dataclass
class DPOObjective:
    """The DPO loss (``settings.algorithm``'s ``beta``, ``dpo_loss``, ``label_smoothing``) on
    micro-batches of the N pairs of ``inputs`` (2N sequences), against the reference sequence
    log-probs ``ref`` (2N,)."""

    actor: Actor
    inputs: policy.PolicyInputs
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
        self.prompts: policy.PromptLayout | None = None

    @property
    def trainable(self) -> Actor:
        return self.actor

    def divisors(self, rows: Tensor) -> Divisors:
        return Divisors(num_tokens=1.0, num_seqs=float(len(rows)))  # the loss is a mean over pairs

    def micro_loss(self, chunk: Tensor, weights: Tensor, divisors: Divisors) -> tuple[Tensor, Tensor]:
        """Loss share of the pairs ``chunk`` (k,) and the shares of :attr:`keys` (see the loop)."""
        s, n, k = self.settings.algorithm, self.num_pairs, len(chunk)
        mb = self.inputs.select(torch.cat([chunk, chunk + n]))
        logp, _ = policy.logprobs(self.actor, mb, temperature=self.settings.update.temperature, entropy=False)
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


# --- the algorithm --------------------------------------------------------------------------------


class DPO:
    """DPO's step: the reference's sequence logprobs, then the DPO loss on micro-batches of pairs."""

    def plan(
        self, actor: Actor, critic: Critic | None, batch: Mapping[str, Tensor], scores: Tensor,
        settings: StepSettings,
    ) -> Plan:  # fmt: skip
        """DPO on N pairs: ``ppo_epochs`` passes in ``num_updates`` mini-batches of pairs, in order.

        ``micro_batch_size`` counts pairs (a pair is two sequences); ``critic`` and ``scores`` are not
        used. The metrics add ``response_length`` (mean tokens of the chosen and rejected responses).
        """
        n = check_pairs(batch)
        inputs = policy.build_policy_inputs(pairs_as_rollouts(batch)).to(actor.device)
        _, micro = batch_sizes(settings, n)
        ref = reference_logps(actor, batch, inputs, micro, settings.update.temperature)
        metrics = {"response_length": float(inputs.response_mask.sum(dim=-1).float().mean().item())}
        return Plan([DPOObjective(actor, inputs, ref, settings)], settings, n, metrics=metrics)
