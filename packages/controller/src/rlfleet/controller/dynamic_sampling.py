"""Dynamic sampling (DAPO): a step trains on groups that carry a learning signal, sampling more
prompts to replace the groups that carry none.

A GRPO group whose rewards are all equal has a group-relative advantage of 0 for every sample: it
adds nothing to the policy gradient, only tokens to the batch. With ``dynamic_sampling.enabled``
a step looks at its scored groups, drops those whose rewards' population std is at or under
``min_std`` (0: drops only groups of equal rewards), and while it keeps fewer than the step's
``rollout_batch_size`` it generates the run's next batch too, up to ``max_batches`` batches in all
(the over-sampling budget). It then trains on the first ``rollout_batch_size`` groups kept, in
the order generated (more are dropped as surplus, as DAPO does); short of that when the budget is
spent, on those it kept; with none kept, on its own batch whole, as without dynamic sampling.

The extra batches are the run's next ones (:class:`~rlfleet.controller.rollout_ahead.BatchLookahead`
hands them out and a checkpoint saves the position after the last one used, so a resumed run
neither repeats nor skips a batch). With ``max_staleness: k`` they come from the stream: the next
batch in flight is taken, already generated or generating, and the pipeline begins another behind
it, so a replacement costs no second round trip. The spread is measured on the scores the reward
tier returned (DAPO filters on accuracy, before its overlong penalty; rlfleet's overlong shaping
happens in the trainer, after).

The step reports ``groups/generated``, ``groups/kept``, ``groups/dropped`` (of which
``groups/dropped_flat`` for no signal, the rest surplus), ``rollout/batches_generated`` and
``groups/wasted_token_frac``: the share of every token the step generated that was not in a trained
group with a signal. The trainer is sent, per chunk, the groups it trains on
(``TrainStepRequest.groups``) and only their scores.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from rlfleet.common.control.messages import GenerateResult, ScoreResult
from rlfleet.controller.lost_chunks import group_scores


@dataclass
class GroupChoice:
    """Which groups a step trains on, and the counts it reports."""

    groups: list[list[int]]
    """Per chunk (in the step's order), the groups (its prompts) trained; empty: none of its own."""
    generated: int
    kept: int
    flat: int
    """Groups dropped for no signal (spread at or under ``min_std``)."""

    def metrics(self, batches: int) -> dict[str, float]:
        return {
            "groups/generated": float(self.generated), "groups/kept": float(self.kept),
            "groups/dropped": float(self.generated - self.kept), "groups/dropped_flat": float(self.flat),
            "rollout/batches_generated": float(batches),
        }  # fmt: skip


def has_signal(rewards: Sequence[float], min_std: float) -> bool:
    """Whether a group's rewards spread over ``min_std`` (population std): its advantages are not all 0."""
    return len(rewards) > 1 and statistics.pstdev(rewards) > min_std


def count_signal(results: Sequence[GenerateResult], scored: Sequence[ScoreResult], min_std: float) -> int:
    """How many groups of the chunks ``results`` (scored as ``scored``) carry a signal."""
    pairs = zip(results, scored, strict=True)
    return sum(has_signal(group_scores(r, s, p), min_std) for r, s in pairs for p in range(r.num_prompts))


def choose_groups(
    results: Sequence[GenerateResult], scored: Sequence[ScoreResult], target: int, min_std: float,
    own_chunks: int,
) -> GroupChoice:  # fmt: skip
    """The groups to train on: the first ``target`` whose scores spread over ``min_std``, in chunk
    order; none such: every group of the step's own batch (its first ``own_chunks`` chunks)."""
    groups: list[list[int]] = [[] for _ in results]
    kept = flat = generated = 0
    for c, (result, score) in enumerate(zip(results, scored, strict=True)):
        for p in range(result.num_prompts):
            generated += 1
            if not has_signal(group_scores(result, score, p), min_std):
                flat += 1
            elif kept < target:
                groups[c].append(p)
                kept += 1
    if not kept:  # nothing to learn from anywhere: the step trains as it would without dynamic sampling
        groups = [list(range(r.num_prompts)) if c < own_chunks else [] for c, r in enumerate(results)]
        kept, flat = sum(len(g) for g in groups), flat - sum(len(g) for g in groups)
    return GroupChoice(groups, generated, kept, flat)


def wasted_token_frac(signal_tokens: float, results: Sequence[GenerateResult]) -> float:
    """The share of the tokens the step generated (``results``) not in a trained group with a signal
    (``signal_tokens``, as the trainer counted them)."""
    generated = sum(r.num_tokens for r in results)
    return max(0.0, 1.0 - signal_tokens / generated) if generated else 0.0
