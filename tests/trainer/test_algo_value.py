"""Clipped value loss and explained variance against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from rlfleet.trainer.algorithms.ppo import clipped_value_loss, explained_variance, value_loss

# token 0: v moves 1.0 away from old 0.0 towards R 2.0; clipping holds it at 0.2 -> clipped branch
# token 1: v 2.0 below old 2.5, clipped up to 2.3, further from R 0.0 -> clipped branch
# token 2: v 0.5 from old 0.0, clipped to 0.2 which is closer to R 0.3 -> unclipped branch
# token 3: padding (huge loss that must not count)
V = torch.tensor([[1.0, 2.0, 0.5, 3.0]])
OLD = torch.tensor([[0.0, 2.5, 0.0, 0.0]])
RET = torch.tensor([[2.0, 0.0, 0.3, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0]])


def test_clipped_value_loss_per_token() -> None:
    loss, clipped = clipped_value_loss(V, OLD, RET, clip_eps=0.2)
    # 0.5*max((1-2)^2, (0.2-2)^2) = 0.5*3.24; 0.5*max(4, 2.3^2) = 0.5*5.29; 0.5*max(0.2^2, 0.1^2) = 0.5*0.04
    # padding: 0.5*max(36, (0.2-9)^2 = 77.44)
    torch.testing.assert_close(loss, torch.tensor([[1.62, 2.645, 0.02, 38.72]]))
    torch.testing.assert_close(clipped, torch.tensor([[1.0, 1.0, 0.0, 1.0]]))
    # inside the clip range both branches are equal: a tie is not counted as clipped
    _, tie = clipped_value_loss(OLD + 0.1, OLD, RET, clip_eps=0.2)
    torch.testing.assert_close(tie, torch.zeros(1, 4))


def test_value_loss_reduces_over_the_mask_and_clipped_tokens_give_no_gradient() -> None:
    values = V.clone().requires_grad_(True)
    loss, metrics = value_loss(values, OLD, RET, MASK, clip_eps=0.2)
    torch.testing.assert_close(loss, torch.tensor((1.62 + 2.645 + 0.02) / 3))
    torch.testing.assert_close(metrics["vf_clip_frac"], torch.tensor(2.0 / 3.0))
    torch.testing.assert_close(metrics["vpred_mean"], torch.tensor((1.0 + 2.0 + 0.5) / 3))
    assert not metrics["vf_clip_frac"].requires_grad
    loss.backward()
    # only token 2 is unclipped: d/dv 0.5*(v - R)^2 / 3 = (0.5 - 0.3) / 3
    torch.testing.assert_close(values.grad, torch.tensor([[0.0, 0.0, 0.2 / 3, 0.0]]))


def test_value_loss_aggregation_modes_and_no_clip() -> None:
    loss, _ = value_loss(V, OLD, RET, MASK, clip_eps=0.2, loss_agg="seq-mean-token-sum")
    torch.testing.assert_close(loss, torch.tensor(1.62 + 2.645 + 0.02))  # one sequence: the token sum
    plain, metrics = value_loss(V, OLD, RET, MASK, clip_eps=None)
    # 0.5*(1-2)^2 + 0.5*(2-0)^2 + 0.5*(0.5-0.3)^2 = 0.5 + 2 + 0.02, over 3 tokens
    torch.testing.assert_close(plain, torch.tensor(2.52 / 3))
    assert metrics["vf_clip_frac"].item() == 0.0


def test_value_loss_micro_batches_sum_to_the_batch() -> None:
    values = torch.tensor([[1.0, 2.0], [0.5, 0.0]])
    old = torch.zeros(2, 2)
    ret = torch.tensor([[0.0, 1.0], [1.0, 2.0]])
    mask = torch.tensor([[1, 1], [1, 0]])
    full, _ = value_loss(values, old, ret, mask, clip_eps=0.5)
    total = torch.zeros(())
    for i in range(2):
        rows = slice(i, i + 1)
        part, _ = value_loss(values[rows], old[rows], ret[rows], mask[rows], clip_eps=0.5, num_tokens=3)
        total = total + part
    torch.testing.assert_close(total, full)


def test_value_clip_must_be_positive() -> None:
    with pytest.raises(ValueError, match="clip_eps"):
        clipped_value_loss(V, OLD, RET, clip_eps=0.0)


def test_explained_variance_by_hand() -> None:
    returns = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    values = torch.tensor([[1.0, 2.0, 2.0, -50.0]])
    # residual 0, 0, 1: mean 1/3, var ((1/3)^2 * 2 + (2/3)^2) / 3 = 2/9; Var[R] = (1 + 0 + 1) / 3 = 2/3
    # 1 - (2/9) / (2/3) = 2/3
    torch.testing.assert_close(explained_variance(returns, values, MASK), torch.tensor(2.0 / 3.0))
    torch.testing.assert_close(explained_variance(returns, returns, MASK), torch.tensor(1.0))
    constant = torch.full_like(returns, 2.0)  # the mean of the real returns: no better than a constant
    torch.testing.assert_close(explained_variance(returns, constant, MASK), torch.tensor(0.0))


def test_explained_variance_is_zero_when_undefined() -> None:
    flat = torch.tensor([[1.0, 1.0, 1.0, 7.0]])
    assert explained_variance(flat, torch.zeros(1, 4), MASK).item() == 0.0  # constant returns
    assert explained_variance(V, RET, torch.zeros(1, 4)).item() == 0.0  # no real token
