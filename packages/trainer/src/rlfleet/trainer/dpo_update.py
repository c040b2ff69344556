"""One DPO step on a batch of preference pairs, and the preference-batch tensor contract.

The preference-batch contract (what the controller stores in its TensorStore and the trainer
fetches; N pairs, one row per pair):

- ``prompt_ids``    (N, P) int64, LEFT-padded with the tokenizer's pad id
- ``prompt_mask``   (N, P) int64, 1 for real tokens
- ``chosen_ids``    (N, C) int64, RIGHT-padded: the preferred response (EOS included when it ends)
- ``chosen_mask``   (N, C) int64, 1 for real tokens (every row has at least one)
- ``rejected_ids``  (N, J) int64, RIGHT-padded: the dispreferred response
- ``rejected_mask`` (N, J) int64
- optional ``ref_chosen_logps`` / ``ref_rejected_logps`` (N,) float32: precomputed reference
  sequence log-probs; when absent the trainer computes them with its frozen reference.

The trainer stacks the pairs into 2N sequences ``prompt ++ response`` (rows 0..N-1 chosen,
N..2N-1 rejected; responses right-padded to ``max(C, J)``), so they go through the same inputs,
micro-batching and logprob code as rollouts::

    batch ──pair_batch──> rollout-shaped (2N, P) / (2N, max(C, J)) ──build_policy_inputs──> inputs
      │ no grad: reference sequence logprobs (N,) + (N,)
      v
    for mini-batch of pairs:                          ── one optimizer step each
      for micro-batch of pairs (its 2k sequences):    ── gradient accumulation
        pi_c, pi_r = sequence_logprobs(policy)
        loss = dpo_loss(pi_c, pi_r, ref_c, ref_r, num_pairs=mini-batch size); backward

Under several ranks each mini-batch's pairs are split over the ranks by length
(:func:`~rlfleet.trainer.fsdp.local_rows`; padding copies weigh 0), each rank backpropagates its
share times W (FSDP averages gradients), and the metric sums are added over ranks.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms import dpo_loss, sequence_logprobs
from rlfleet.trainer.config import UpdateConfig
from rlfleet.trainer.distributed import all_reduce_sum
from rlfleet.trainer.errors import InvalidBatch
from rlfleet.trainer.fsdp import local_rows
from rlfleet.trainer.inputs import PolicyInputs, build_policy_inputs
from rlfleet.trainer.logprobs import token_logprobs
from rlfleet.trainer.optim import mean_over_steps

logger = logging.getLogger(__name__)

PAIR_KEYS = ("prompt_ids", "prompt_mask", "chosen_ids", "chosen_mask", "rejected_ids", "rejected_mask")
"""Fields every preference batch has."""
REF_KEYS = ("ref_chosen_logps", "ref_rejected_logps")
"""Optional precomputed reference sequence log-probs."""
DPO_METRICS = ("loss", "dpo/chosen_reward", "dpo/rejected_reward", "dpo/accuracy", "dpo/margin")


@dataclass(frozen=True)
class DPOSettings:
    """The DPO loss: ``beta``, ``sigmoid | ipo`` and conservative-DPO label smoothing."""

    beta: float = 0.1
    loss_type: str = "sigmoid"
    label_smoothing: float = 0.0


def _pad_right(t: Tensor, width: int) -> Tensor:
    extra = width - t.shape[1]
    return t if extra == 0 else torch.cat([t, t.new_zeros((t.shape[0], extra))], dim=1)


def _pad_left(t: Tensor, width: int) -> Tensor:
    extra = width - t.shape[1]
    return t if extra == 0 else torch.cat([t.new_zeros((t.shape[0], extra)), t], dim=1)


def validate_pairs(batch: Mapping[str, Tensor]) -> int:
    """Raise :class:`InvalidBatch` unless ``batch`` follows the contract; returns N."""
    for key in PAIR_KEYS:
        if key not in batch:
            raise InvalidBatch(key, f"missing; a preference batch needs {', '.join(PAIR_KEYS)}")
        if batch[key].ndim != 2:
            raise InvalidBatch(key, f"expected (N, L), got shape {tuple(batch[key].shape)}")
    n = int(batch["prompt_ids"].shape[0])
    for ids, mask in (
        ("prompt_ids", "prompt_mask"),
        ("chosen_ids", "chosen_mask"),
        ("rejected_ids", "rejected_mask"),
    ):
        if batch[ids].shape != batch[mask].shape or batch[ids].shape[0] != n:
            raise InvalidBatch(
                mask, f"shape {tuple(batch[mask].shape)} vs {ids} {tuple(batch[ids].shape)}, N={n}"
            )
        if ids != "prompt_ids" and bool((batch[mask].sum(dim=-1) == 0).any()):
            raise InvalidBatch(mask, "a pair has an empty response")
    for key in REF_KEYS:
        if key in batch and tuple(batch[key].shape) != (n,):
            raise InvalidBatch(key, f"expected ({n},), got {tuple(batch[key].shape)}")
    return n


def merge_preference_batches(chunks: Sequence[Mapping[str, Tensor]]) -> dict[str, Tensor]:
    """Concatenate preference chunks (re-padding prompts left and responses right)."""
    if not chunks:
        raise InvalidBatch("rollouts", "a DPO step needs at least one preference batch")
    for chunk in chunks:
        validate_pairs(chunk)
    if len(chunks) == 1:
        return dict(chunks[0])
    merged: dict[str, Tensor] = {}
    for key in PAIR_KEYS:
        width = max(c[key].shape[1] for c in chunks)
        pad = _pad_left if key.startswith("prompt") else _pad_right
        merged[key] = torch.cat([pad(c[key], width) for c in chunks])
    for key in REF_KEYS:
        if all(key in c for c in chunks):
            merged[key] = torch.cat([c[key] for c in chunks])
    return merged


def pair_batch(batch: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """The 2N-row rollout-contract view of N pairs: chosen rows first, then rejected rows."""
    width = max(batch["chosen_ids"].shape[1], batch["rejected_ids"].shape[1])
    return {
        "prompt_ids": torch.cat([batch["prompt_ids"], batch["prompt_ids"]]),
        "prompt_mask": torch.cat([batch["prompt_mask"], batch["prompt_mask"]]),
        "response_ids": torch.cat(
            [_pad_right(batch["chosen_ids"], width), _pad_right(batch["rejected_ids"], width)]
        ),
        "response_mask": torch.cat(
            [_pad_right(batch["chosen_mask"], width), _pad_right(batch["rejected_mask"], width)]
        ),
    }


def _sequence_logps(actor: Actor, inputs: PolicyInputs, rows: Tensor) -> Tensor:
    """Policy sequence log-probs of ``rows`` (K,), with grad: (K,)."""
    mb = inputs.select(rows)
    with actor._autocast():
        logp, _ = token_logprobs(
            actor.model, mb.input_ids, mb.attention_mask, mb.response_len, position_ids=mb.position_ids,
            temperature=actor.config.temperature, compute_entropy=False,
            chunk_rows=actor.config.logprob_chunk_rows,
        )  # fmt: skip
    return sequence_logprobs(logp, mb.response_mask)


def reference_logps(
    actor: Actor, batch: Mapping[str, Tensor], inputs: PolicyInputs, micro_pairs: int
) -> Tensor:
    """(2N,) reference sequence log-probs: the batch's precomputed ones, else the frozen reference's."""
    if all(key in batch for key in REF_KEYS):
        return torch.cat([batch["ref_chosen_logps"], batch["ref_rejected_logps"]]).to(actor.device).float()
    token_ref = actor.compute_logprobs(inputs, micro_batch_size=2 * micro_pairs, reference=True)
    return sequence_logprobs(token_ref, inputs.response_mask)


def dpo_update(
    actor: Actor, batch: Mapping[str, Tensor], dpo: DPOSettings, plan: UpdateConfig
) -> dict[str, float]:
    """DPO on N pairs: ``ppo_epochs`` passes in mini-batches of pairs, one optimizer step each.

    ``plan.micro_batch_size`` and ``plan.mini_batch_size`` count pairs (a pair is two sequences).

    Returns:
        means over optimizer steps of ``loss``, ``dpo/chosen_reward``, ``dpo/rejected_reward``,
        ``dpo/accuracy`` and ``dpo/margin`` (each measured before its step's update), ``grad_norm``
        and ``lr``; ``response_length`` (mean tokens of the chosen and rejected responses) and
        ``num_optimizer_steps``.
    """
    n = validate_pairs(batch)
    inputs = build_policy_inputs(pair_batch(batch)).to(actor.device)
    ref = reference_logps(actor, batch, inputs, plan.micro_batch_size)
    mini = plan.mini_batch_size or n
    lengths = inputs.attention_mask.sum(dim=-1)
    pair_lengths = lengths[:n] + lengths[n:]
    ctx = actor.dist
    per_step: list[dict[str, float]] = []
    actor.model.train()
    for _ in range(plan.ppo_epochs):
        for pairs in torch.arange(n, device=actor.device).split(mini):
            share = local_rows(pairs, pair_lengths, ctx.rank, ctx.world_size)
            sums = torch.zeros(len(DPO_METRICS), dtype=torch.float64, device=actor.device)
            for chunk, weight in zip(share.rows.split(plan.micro_batch_size),
                                     share.weights.split(plan.micro_batch_size), strict=True):  # fmt: skip
                logps = _sequence_logps(actor, inputs, torch.cat([chunk, chunk + n]))
                k = len(chunk)
                loss, metrics = dpo_loss(
                    logps[:k], logps[k:], ref[chunk], ref[chunk + n], beta=dpo.beta, loss_type=dpo.loss_type,
                    label_smoothing=dpo.label_smoothing, num_pairs=float(len(pairs)), weights=weight,
                )  # fmt: skip
                (loss * ctx.world_size if ctx.world_size > 1 else loss).backward()
                share_of_mini = float(weight.sum().item()) / len(pairs)  # chunk means -> mini-batch shares
                values = [
                    loss.detach(),
                    *(metrics[name.split("/", 1)[1]] * share_of_mini for name in DPO_METRICS[1:]),
                ]
                sums += torch.stack([v.double() for v in values])
            step = dict(zip(DPO_METRICS, all_reduce_sum(sums, ctx).tolist(), strict=True))
            step.update(actor.optimizer_step(plan.max_grad_norm))
            per_step.append(step)
    averaged = mean_over_steps(per_step)
    averaged["response_length"] = float(inputs.response_mask.sum(dim=-1).float().mean().item())
    return averaged
