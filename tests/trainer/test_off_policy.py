"""Off-policy corrections (issue 30, point 4): each correction's weights and metrics against
hand-computed numbers, and the policy loss and its gradient with them, fp32 on CPU."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from pydantic import ValidationError
from torch import Tensor

from rlfleet.common.schema.trainer import AlgorithmSettings, BatchSettings, StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.grpo import PolicyObjective, PreparedBatch, prepare, token_divisors
from rlfleet.trainer.algorithms.off_policy import correction_weights, off_policy_metrics
from rlfleet.trainer.policy import compute_logprobs

pytestmark = pytest.mark.timeout(120)

MakeBatch = Callable[..., dict[str, torch.Tensor]]
NAN = float("nan")


def _update(kind: str, **kwargs: float) -> UpdateSettings:
    return UpdateSettings(off_policy_correction=kind, **kwargs)  # type: ignore[arg-type]


def _pair(weights: list[list[float]]) -> tuple[torch.Tensor, torch.Tensor]:
    """old and engine logprobs whose ratio pi_old / mu is ``weights`` (NaN: no engine logprob)."""
    w = torch.tensor(weights, dtype=torch.float64)
    old = torch.full_like(w, -1.0)
    engine = torch.where(torch.isnan(w), w, old - w.log())
    return old, engine


MASK = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]], dtype=torch.float64)


def test_token_tis_truncates_each_weight_at_the_cap() -> None:
    old, engine = _pair([[0.5, 3.0, NAN], [1.25, 2.5, 9.0]])
    weights, corrected = correction_weights(old, engine, MASK, _update("token_tis", is_cap=2.0))
    # no engine logprob -> 1; padding (the last token of row 2) -> its log weight is 0, weight 1
    torch.testing.assert_close(
        weights, torch.tensor([[0.5, 2.0, 1.0], [1.25, 2.0, 1.0]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        corrected, torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    )


def test_decoupled_masks_the_tokens_over_the_cap() -> None:
    old, engine = _pair([[0.5, 3.0, NAN], [1.25, 2.5, 9.0]])
    weights, corrected = correction_weights(old, engine, MASK, _update("decoupled", is_cap=2.0))
    torch.testing.assert_close(
        weights, torch.tensor([[0.5, 0.0, 1.0], [1.25, 0.0, 1.0]], dtype=torch.float64)
    )
    torch.testing.assert_close(
        corrected, torch.tensor([[0.0, 1.0, 0.0], [0.0, 1.0, 0.0]], dtype=torch.float64)
    )


def test_seq_mis_drops_the_sequences_whose_ratio_leaves_the_band() -> None:
    # row 1: 1.2 * 0.9 * 1.5 = 1.62, inside [0.5, 2]; row 2: 2 * 1.5 = 3 (its padding not counted): out
    old, engine = _pair([[1.2, 0.9, 1.5], [2.0, 1.5, 100.0]])
    weights, corrected = correction_weights(
        old, engine, MASK, _update("seq_mis", is_band_low=0.5, is_band_high=2.0)
    )
    torch.testing.assert_close(weights, torch.tensor([[1.0, 1.0, 1.0], [0.0, 0.0, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(
        corrected, torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    )


def test_none_leaves_every_weight_at_one() -> None:
    old, engine = _pair([[0.5, 3.0, NAN], [1.25, 2.5, 9.0]])
    weights, corrected = correction_weights(old, engine, MASK, _update("none"))
    assert bool((weights == 1).all()) and bool((corrected == 0).all())


def test_the_metrics_are_the_mismatch_and_the_share_corrected() -> None:
    old, engine = _pair([[0.5, 3.0, NAN], [1.25, 2.5, 9.0]])
    metrics = off_policy_metrics(old, engine, MASK, _update("token_tis", is_cap=2.0))
    known = [0.5, 3.0, 1.25, 2.5]  # the real tokens an engine sampled
    k3 = [w - 1 - math.log(w) for w in known]
    assert metrics["off_policy/mismatch_kl"] == pytest.approx(sum(k3) / 4)
    assert metrics["off_policy/is_weight_mean"] == pytest.approx(sum(known) / 4)
    assert metrics["off_policy/is_weight_max"] == pytest.approx(3.0)
    assert metrics["off_policy/corrected_frac"] == pytest.approx(2 / 4)


def test_the_band_and_the_cap_are_checked() -> None:
    for bad in ({"is_cap": 1.0}, {"is_band_low": 1.0}, {"is_band_high": 0.9}, {"is_cap": float("inf")}):
        with pytest.raises(ValidationError):
            UpdateSettings(**bad)  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="off_policy_correction"):
        UpdateSettings(off_policy_correction="tis")  # type: ignore[arg-type]


def _loss_and_grads(
    actor: Actor, prepared: PreparedBatch, settings: StepSettings
) -> tuple[float, list[Tensor]]:
    actor.model.zero_grad(set_to_none=True)
    objective = PolicyObjective(actor, prepared, settings)
    rows = torch.arange(prepared.advantages.shape[0])
    total, _ = objective.micro_loss(
        rows, torch.ones(len(rows)), token_divisors(prepared.inputs.response_mask, rows)
    )
    total.backward()
    grads = [p.grad.detach().clone() for p in actor.model.parameters() if p.grad is not None]
    return float(total.item()), grads


@pytest.mark.parametrize("kind", ["token_tis", "decoupled"])
def test_the_policy_loss_and_its_gradient_carry_the_weights(
    tiny_model_dir: Path, make_batch: MakeBatch, kind: str
) -> None:
    """On-policy (the ratio is 1), the token-mean loss is ``-sum(A * w) / tokens``; with every weight
    w = 0.5 (under the cap) its gradient is half the uncorrected one; with every weight over the cap,
    token_tis truncates to the cap and decoupled drops every token (no loss, no gradient)."""
    actor = Actor(tiny_model_dir, seed=0, learning_rate=1e-2)
    batch = make_batch([3, 5, 2, 4], [4, 2, 6, 3])
    advantages = torch.tensor([1.0, -0.5, 0.25, 2.0])
    prepared = prepare(actor, batch, advantages, micro_batch_size=4)  # on-policy: no old logprobs kept
    mask = prepared.inputs.response_mask
    old = compute_logprobs(actor, prepared.inputs, micro_batch_size=4) * mask

    def step(update: UpdateSettings) -> StepSettings:
        return StepSettings(algorithm=AlgorithmSettings(name="grpo"), update=update,
                            batch=BatchSettings(rollout_batch_size=1, train_batch_size=1))  # fmt: skip

    base = dict(micro_batch_size=4, kl_coef=0.0)
    plain_loss, plain_grads = _loss_and_grads(actor, prepared, step(UpdateSettings(**base)))
    tokens = float(mask.sum())
    assert plain_loss == pytest.approx(-float((prepared.advantages * mask).sum()) / tokens, rel=1e-5)

    half = replace(prepared, rollout_logprobs=old - math.log(0.5))  # pi_old / mu = 0.5 everywhere
    loss, grads = _loss_and_grads(actor, half, step(UpdateSettings(**base, off_policy_correction=kind)))
    assert loss == pytest.approx(0.5 * plain_loss, rel=1e-5)
    for g, p in zip(grads, plain_grads, strict=True):
        torch.testing.assert_close(g, 0.5 * p, rtol=1e-4, atol=1e-7)

    over = replace(prepared, rollout_logprobs=old - math.log(4.0))  # 4 > is_cap 2
    loss, grads = _loss_and_grads(actor, over, step(UpdateSettings(**base, off_policy_correction=kind)))
    if kind == "token_tis":
        assert loss == pytest.approx(2.0 * plain_loss, rel=1e-5)
    else:
        assert loss == 0.0 and all(float(g.abs().max()) == 0.0 for g in grads)
