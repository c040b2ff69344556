"""Token-level rewards, GAE, whitening and Monte-Carlo returns against hand-computed values."""

from __future__ import annotations

import pytest
import torch

from rlfleet.trainer.algorithms.grpo import (
    discounted_returns,
    last_token_index,
    masked_whiten,
    token_level_rewards,
)
from rlfleet.trainer.algorithms.ppo import gae_advantages


def test_last_token_index_handles_holes_and_empty_rows() -> None:
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 0, 1]])
    assert last_token_index(mask).tolist() == [1, -1, 2]


def test_score_goes_on_the_last_real_token_and_kl_on_every_real_token() -> None:
    scores = torch.tensor([1.0, 2.0, 5.0])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [0, 0, 0]])
    kl = torch.tensor([[0.1, 0.2, 9.0], [0.3, 0.0, 0.5], [1.0, 1.0, 1.0]])
    rewards = token_level_rewards(scores, mask, kl=kl, kl_coef=0.5)
    expected = torch.tensor(
        [
            [-0.05, -0.1 + 1.0, 0.0],  # -0.5*0.1, -0.5*0.2 + score 1; padding (kl 9) ignored
            [-0.15, 0.0, -0.25 + 2.0],  # -0.5*0.3, -0.5*0, -0.5*0.5 + score 2
            [0.0, 0.0, 0.0],  # all masked: no token for the score, no KL
        ]
    )
    torch.testing.assert_close(rewards, expected)
    torch.testing.assert_close(
        token_level_rewards(scores, mask), torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]])
    )


def test_token_level_rewards_refuses_a_coef_without_kl_and_bad_shapes() -> None:
    mask = torch.ones(2, 3)
    with pytest.raises(ValueError, match="kl="):
        token_level_rewards(torch.zeros(2), mask, kl_coef=0.1)
    with pytest.raises(ValueError, match=r"\(N,\)"):
        token_level_rewards(torch.zeros(3), mask)
    with pytest.raises(ValueError, match="does not match"):
        token_level_rewards(torch.zeros(2), mask, kl=torch.zeros(2, 4), kl_coef=0.1)


def test_gae_by_hand_with_right_padding() -> None:
    rewards = torch.tensor([[0.0, 0.0, 1.0, 7.0]])  # the 7 sits on padding and must be ignored
    values = torch.tensor([[0.5, 0.6, 0.7, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.8)
    # t=2: delta = 1 + 0.9*0 - 0.7 = 0.3                 A2 = 0.3
    # t=1: delta = 0 + 0.9*0.7 - 0.6 = 0.03              A1 = 0.03 + 0.72*0.3 = 0.246
    # t=0: delta = 0 + 0.9*0.6 - 0.5 = 0.04              A0 = 0.04 + 0.72*0.246 = 0.21712
    torch.testing.assert_close(adv, torch.tensor([[0.21712, 0.246, 0.3, 0.0]]))
    # R = A + V: 0.71712, 0.846, 1.0; 0 on padding
    torch.testing.assert_close(ret, torch.tensor([[0.71712, 0.846, 1.0, 0.0]]))


def test_gae_skips_holes_as_if_the_token_were_absent() -> None:
    holed_r = torch.tensor([[0.2, 5.0, 1.0]])
    holed_v = torch.tensor([[0.4, -3.0, 0.1]])
    adv_h, ret_h = gae_advantages(holed_r, holed_v, torch.tensor([[1, 0, 1]]), gamma=0.5, lam=0.5)
    adv, ret = gae_advantages(
        torch.tensor([[0.2, 1.0]]), torch.tensor([[0.4, 0.1]]), torch.ones(1, 2), gamma=0.5, lam=0.5
    )
    # t=1: delta = 1 - 0.1 = 0.9; t=0: delta = 0.2 + 0.5*0.1 - 0.4 = -0.15, A0 = -0.15 + 0.25*0.9 = 0.075
    torch.testing.assert_close(adv, torch.tensor([[0.075, 0.9]]))
    torch.testing.assert_close(adv_h, torch.tensor([[0.075, 0.0, 0.9]]))
    torch.testing.assert_close(ret_h, torch.tensor([[ret[0, 0].item(), 0.0, ret[0, 1].item()]]))


def test_gamma_one_lambda_one_is_monte_carlo_return_minus_value() -> None:
    gen = torch.Generator().manual_seed(0)
    rewards = torch.randn(4, 6, generator=gen)
    values = torch.randn(4, 6, generator=gen)
    mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2, [1] + [0] * 5, [0] * 6])
    adv, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=1.0)
    masked_r = rewards * mask
    mc_return = masked_r.flip(-1).cumsum(-1).flip(-1)  # G_t = sum_{k >= t} r_k over real tokens
    torch.testing.assert_close(adv, (mc_return - values) * mask)
    torch.testing.assert_close(ret, mc_return * mask)
    torch.testing.assert_close(discounted_returns(rewards, mask), mc_return * mask)


def test_lambda_zero_is_the_one_step_td_error() -> None:
    rewards = torch.tensor([[1.0, 2.0, 3.0]])
    values = torch.tensor([[0.5, 1.0, 2.0]])
    adv, _ = gae_advantages(rewards, values, torch.ones(1, 3), gamma=0.5, lam=0.0)
    # r_t + 0.5 * V_{t+1} - V_t: 1 + 0.5 - 0.5 = 1, 2 + 1 - 1 = 2, 3 + 0 - 2 = 1
    torch.testing.assert_close(adv, torch.tensor([[1.0, 2.0, 1.0]]))


def test_single_token_and_all_masked_rows() -> None:
    rewards = torch.tensor([[2.0, 0.0], [4.0, 4.0]])
    values = torch.tensor([[0.5, 1.0], [1.0, 1.0]])
    mask = torch.tensor([[1, 0], [0, 0]])
    adv, ret = gae_advantages(rewards, values, mask, gamma=0.9, lam=0.95)
    # single token: A = r - V = 1.5, R = r = 2; empty row: zeros
    torch.testing.assert_close(adv, torch.tensor([[1.5, 0.0], [0.0, 0.0]]))
    torch.testing.assert_close(ret, torch.tensor([[2.0, 0.0], [0.0, 0.0]]))


def test_discounted_returns_by_hand() -> None:
    # G2 = 3, G1 = 2 + 0.5*3 = 3.5, G0 = 1 + 0.5*3.5 = 2.75
    out = discounted_returns(torch.tensor([[1.0, 2.0, 3.0, 8.0]]), torch.tensor([[1, 1, 1, 0]]), gamma=0.5)
    torch.testing.assert_close(out, torch.tensor([[2.75, 3.5, 3.0, 0.0]]))


def test_masked_whiten_by_hand() -> None:
    values = torch.tensor([[1.0, 3.0, 100.0], [5.0, -7.0, 0.0]])
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    # real tokens 1, 3, 5: mean 3, deviations -2, 0, 2, unbiased var 8/2 = 4, std 2
    torch.testing.assert_close(
        masked_whiten(values, mask, eps=0.0), torch.tensor([[-1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])
    )
    torch.testing.assert_close(
        masked_whiten(values, mask, shift_mean=False, eps=0.0),
        torch.tensor([[2.0, 3.0, 0.0], [4.0, 0.0, 0.0]]),  # scaled by 1/2, mean 3 added back
    )
    one = torch.tensor([[1, 0, 0], [0, 0, 0]])
    torch.testing.assert_close(masked_whiten(values, one), torch.zeros(2, 3))  # one token: centered only


def test_whitened_gae_keeps_raw_returns() -> None:
    rewards = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, -1.0]])
    values = torch.tensor([[0.1, 0.2, 0.0], [0.3, 0.1, 0.2]])
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    raw, ret = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95)
    white, ret_w = gae_advantages(rewards, values, mask, gamma=1.0, lam=0.95, whiten=True)
    torch.testing.assert_close(ret_w, ret)
    torch.testing.assert_close(white, masked_whiten(raw, mask))
    real = white[mask.bool()]
    assert abs(real.mean().item()) < 1e-6
    assert abs(real.std().item() - 1.0) < 1e-4


def test_gae_promotes_bf16_and_carries_no_gradient() -> None:
    values = torch.tensor([[0.5, 0.25]], dtype=torch.bfloat16, requires_grad=True)
    adv, ret = gae_advantages(
        torch.tensor([[0.0, 1.0]], dtype=torch.bfloat16), values, torch.ones(1, 2), gamma=1.0, lam=1.0
    )
    assert adv.dtype == torch.float32 and ret.dtype == torch.float32
    assert not adv.requires_grad and not ret.requires_grad
    torch.testing.assert_close(adv, torch.tensor([[0.5, 0.75]]))  # 1 - 0.5, 1 - 0.25


def test_gae_refuses_mismatched_shapes() -> None:
    with pytest.raises(ValueError, match="values"):
        gae_advantages(torch.zeros(2, 3), torch.zeros(2, 4), torch.ones(2, 3), gamma=1.0, lam=1.0)
    with pytest.raises(ValueError, match=r"\(N, R\)"):
        gae_advantages(torch.zeros(3), torch.zeros(3), torch.ones(3), gamma=1.0, lam=1.0)
