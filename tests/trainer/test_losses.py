"""PPO clipped loss, aggregation modes and entropy against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from rlfleet.common.errors import ConfigError
from rlfleet.trainer.algorithms.grpo import (
    LOSS_AGG_MODES,
    aggregate,
    approx_kl,
    masked_entropy,
    masked_mean,
    ppo_clip_loss,
    ppo_policy_loss,
)
from rlfleet.trainer.policy import entropy_from_logits

# ratios 1.5, 0.5, 1.5, 0.5, 1.1 with advantages +1, +1, -1, -1, +2
RATIOS = torch.tensor([[1.5, 0.5, 1.5, 0.5, 1.1]])
ADV = torch.tensor([[1.0, 1.0, -1.0, -1.0, 2.0]])
OLD = torch.zeros(1, 5)


def test_clipped_loss_per_token() -> None:
    loss, clipped = ppo_clip_loss(RATIOS.log(), OLD, ADV, clip_eps_low=0.2)
    # -min(r*A, clip(r, 0.8, 1.2)*A)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, -0.5, 1.5, 0.8, -2.2]]))
    torch.testing.assert_close(clipped, torch.tensor([[1.0, 0.0, 0.0, 1.0, 0.0]]))


def test_clipped_tokens_give_no_gradient() -> None:
    logp = RATIOS.log().requires_grad_(True)
    loss, _ = ppo_clip_loss(logp, OLD, ADV)
    loss.sum().backward()
    # d/dlogp of -A * r is -A * r where unclipped; 0 where clipped
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, -0.5, 1.5, 0.0, -2.2]]))


def test_clip_higher_and_dual_clip() -> None:
    loss, clipped = ppo_clip_loss(RATIOS.log(), OLD, ADV, clip_eps_low=0.2, clip_eps_high=0.6)
    assert loss[0, 0].item() == pytest.approx(-1.5)  # 1.5 is inside [0.8, 1.6]
    assert clipped[0, 0].item() == 0.0
    ratios = torch.tensor([[5.0, 5.0]])
    adv = torch.tensor([[-1.0, 1.0]])
    plain, _ = ppo_clip_loss(ratios.log(), torch.zeros(1, 2), adv)
    dual, _ = ppo_clip_loss(ratios.log(), torch.zeros(1, 2), adv, clip_ratio_c=3.0)
    torch.testing.assert_close(plain, torch.tensor([[5.0, -1.2]]))
    torch.testing.assert_close(dual, torch.tensor([[3.0, -1.2]]))  # capped at -A * c for A < 0
    with pytest.raises(ValueError, match="clip_ratio_c"):
        ppo_clip_loss(ratios.log(), torch.zeros(1, 2), adv, clip_ratio_c=0.5)


def test_approx_kl_is_k3_of_the_ratio() -> None:
    logp = torch.tensor([[math.log(2.0), 0.0]])
    torch.testing.assert_close(approx_kl(logp, torch.zeros(1, 2)), torch.tensor([[1.0 - math.log(2.0), 0.0]]))


VALUES = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
MASK = torch.tensor([[1, 1, 0], [1, 0, 0]])
EXPECTED = {
    "token-mean": 7.0 / 3.0,  # (1 + 2 + 4) / 3
    "seq-mean-token-sum": 3.5,  # ((1 + 2) + 4) / 2
    "seq-mean-token-mean": 2.75,  # (1.5 + 4) / 2
    "seq-mean-token-sum-norm": 7.0 / 6.0,  # ((1 + 2) / 3 + 4 / 3) / 2: every sequence over the width 3
}


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_aggregation_modes(mode: str) -> None:
    assert aggregate(VALUES, MASK, mode).item() == pytest.approx(EXPECTED[mode])


@pytest.mark.parametrize("mode", LOSS_AGG_MODES)
def test_micro_batch_parts_sum_to_the_whole_with_global_divisors(mode: str) -> None:
    parts = [
        aggregate(VALUES[i : i + 1], MASK[i : i + 1], mode, num_tokens=3.0, num_seqs=2.0) for i in range(2)
    ]
    assert sum(p.item() for p in parts) == pytest.approx(EXPECTED[mode])
    local = [aggregate(VALUES[i : i + 1], MASK[i : i + 1], mode).item() for i in range(2)]
    if mode == "token-mean":  # per-micro-batch divisors would weigh the rows differently
        assert sum(local) / 2 != pytest.approx(EXPECTED[mode])


def test_unknown_mode_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="loss_agg"):
        aggregate(VALUES, MASK, "sum-of-everything")


def test_empty_mask_gives_zero_not_nan() -> None:
    empty = torch.zeros_like(MASK)
    for mode in LOSS_AGG_MODES:
        assert aggregate(VALUES, empty, mode).item() == 0.0
    assert masked_mean(VALUES, empty).item() == 0.0


def test_entropy_from_logits() -> None:
    logits = torch.tensor([[0.0, 0.0], [0.0, math.log(3.0)], [100.0, 0.0]])
    expected = torch.tensor([math.log(2.0), -(0.25 * math.log(0.25) + 0.75 * math.log(0.75)), 0.0])
    torch.testing.assert_close(entropy_from_logits(logits), expected, atol=1e-6, rtol=1e-6)


def test_masked_entropy_ignores_padding() -> None:
    logits = torch.tensor([[[0.0, 0.0], [100.0, 0.0]], [[0.0, 0.0], [0.0, 0.0]]])
    mask = torch.tensor([[1, 1], [1, 0]])
    # tokens kept: ln2, 0, ln2 -> mean 2 ln2 / 3
    assert masked_entropy(logits, mask).item() == pytest.approx(2.0 * math.log(2.0) / 3.0, abs=1e-6)


def test_policy_loss_reduces_with_metrics() -> None:
    mask = torch.tensor([[1, 1, 1, 1, 0]])
    loss, metrics = ppo_policy_loss(RATIOS.log(), OLD, ADV, mask)
    assert loss.item() == pytest.approx((-1.2 - 0.5 + 1.5 + 0.8) / 4)
    assert metrics["clip_frac"].item() == pytest.approx(0.5)
    r = torch.tensor([1.5, 0.5, 1.5, 0.5])
    assert metrics["approx_kl"].item() == pytest.approx(((r - 1) - r.log()).mean().item())
