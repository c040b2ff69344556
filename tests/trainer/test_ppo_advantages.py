"""Token advantages of ppo / grpo / rloo / reinforce_pp, with the KL in the reward or not, by hand."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

from rlfleet.common.schema.trainer import AlgorithmSettings, StepSettings, UpdateSettings
from rlfleet.trainer.algorithms import TRAINER_ALGORITHMS
from rlfleet.trainer.algorithms.grpo import grpo_advantages
from rlfleet.trainer.algorithms.reinforce_pp import reinforce_pp_advantages

FULL = torch.ones(1, 3, dtype=torch.int64)


def _settings(algorithm: str, kl_coef: float = 0.0, **kwargs: Any) -> StepSettings:
    """A step's settings: ``algorithm`` with its ``kwargs``, no KL term unless ``kl_coef`` is given."""
    return StepSettings(algorithm=AlgorithmSettings(name=algorithm, **kwargs),
                        update=UpdateSettings(kl_coef=kl_coef))  # fmt: skip


def test_ppo_puts_the_score_last_and_the_kl_on_every_token() -> None:
    # rewards = [-0.5*0.1, -0.5*0.2, -0.5*0.3 + 1] = [-0.05, -0.1, 0.85]; V = 0, gamma = lam = 1
    settings = _settings("ppo", kl_coef=0.5, kl_mode="reward", gamma=1.0, lam=1.0, whiten_advantages=False)
    out = TRAINER_ALGORITHMS["ppo"].token_advantages(
        torch.tensor([1.0]), torch.tensor([0]), FULL, settings, kl=torch.tensor([[0.1, 0.2, 0.3]]),
        values=torch.zeros(1, 3),
    )  # fmt: skip
    torch.testing.assert_close(out.token_rewards, torch.tensor([[-0.05, -0.1, 0.85]]))
    torch.testing.assert_close(out.advantages, torch.tensor([[0.7, 0.75, 0.85]]))
    torch.testing.assert_close(out.returns, torch.tensor([[0.7, 0.75, 0.85]]))


def test_ppo_with_lambda_zero_is_the_td_error() -> None:
    values = torch.tensor([[0.5, 0.2, -0.1]])
    settings = _settings("ppo", gamma=0.9, lam=0.0, whiten_advantages=False)
    out = TRAINER_ALGORITHMS["ppo"].token_advantages(torch.tensor([2.0]), torch.tensor([0]), FULL, settings,
                                                     values=values)  # fmt: skip
    # delta_t = r_t + 0.9 * V_{t+1} - V_t, V after the end = 0; r = [0, 0, 2]
    expected = torch.tensor([[0.9 * 0.2 - 0.5, 0.9 * -0.1 - 0.2, 2.0 + 0.1]])
    torch.testing.assert_close(out.advantages, expected)
    torch.testing.assert_close(out.returns, expected + values)


def test_ppo_whitens_over_real_tokens_and_zeroes_padding() -> None:
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    out = TRAINER_ALGORITHMS["ppo"].token_advantages(
        torch.tensor([1.0, -1.0]), torch.tensor([0, 1]), mask, _settings("ppo"), values=torch.zeros(2, 3)
    )
    real = out.advantages[mask.bool()]
    assert abs(real.mean().item()) < 1e-6 and real.std().item() == pytest.approx(1.0, abs=1e-3)
    assert out.advantages[0, 2] == 0


def test_rloo_adds_each_tokens_future_kl_penalty_to_the_leave_one_out_advantage() -> None:
    kl = torch.tensor([[0.2, 0.2], [0.1, 0.0]])
    settings = _settings("rloo", kl_coef=1.0, kl_mode="reward")
    out = TRAINER_ALGORITHMS["rloo"].token_advantages(torch.tensor([1.0, 0.0]), torch.tensor([0, 0]),
                                                      torch.ones(2, 2), settings, kl=kl)  # fmt: skip
    # rloo: [1 - 0, 0 - 1] = [1, -1]; future penalties: row 0 [-0.4, -0.2], row 1 [-0.1, 0]
    torch.testing.assert_close(out.advantages, torch.tensor([[0.6, 0.8], [-1.1, -1.0]]))


def test_grpo_without_a_reward_kl_is_its_outcome_advantage_on_every_token() -> None:
    scores, groups = torch.tensor([1.0, 0.0, 0.5, 0.5]), torch.tensor([0, 0, 1, 1])
    mask = torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]])
    settings = _settings("grpo", kl_coef=0.3, kl_mode="loss")
    out = TRAINER_ALGORITHMS["grpo"].token_advantages(scores, groups, mask, settings, kl=torch.ones(4, 2))
    expected = grpo_advantages(scores, groups)[:, None] * mask
    torch.testing.assert_close(out.advantages, expected)
    assert out.returns is None


def test_reinforce_pp_whitens_returns_over_tokens_with_the_kl_in_the_reward() -> None:
    mask = torch.tensor([[1, 1], [1, 0]])
    out = TRAINER_ALGORITHMS["reinforce_pp"].token_advantages(
        torch.tensor([1.0, 0.0]), torch.tensor([0, 1]), mask, _settings("reinforce_pp", kl_mode="reward")
    )
    # returns on real tokens [1, 1, 0]: mean 2/3, unbiased var 1/3
    s = math.sqrt(1 / 3)
    expected = torch.tensor([[(1 / 3) / s, (1 / 3) / s], [(-2 / 3) / s, 0.0]])
    torch.testing.assert_close(out.advantages, expected, atol=1e-4, rtol=1e-4)


def test_reinforce_pp_with_the_kl_in_the_loss_whitens_per_sample() -> None:
    scores = torch.tensor([1.0, 0.0, 3.0])
    out = TRAINER_ALGORITHMS["reinforce_pp"].token_advantages(
        scores, torch.tensor([0, 1, 2]), torch.ones(3, 4), _settings("reinforce_pp", kl_mode="loss")
    )
    per_sample = reinforce_pp_advantages(scores, torch.tensor([0, 1, 2]))
    torch.testing.assert_close(out.advantages, per_sample[:, None] * torch.ones(3, 4))


def test_missing_inputs_are_errors() -> None:
    with pytest.raises(ValueError, match="critic's values"):
        TRAINER_ALGORITHMS["ppo"].token_advantages(
            torch.tensor([1.0]), torch.tensor([0]), FULL, _settings("ppo")
        )
    with pytest.raises(ValueError, match="needs the per-token kl"):
        TRAINER_ALGORITHMS["rloo"].token_advantages(
            torch.tensor([1.0]), torch.tensor([0]), FULL, _settings("rloo", kl_coef=0.1, kl_mode="reward")
        )
    assert not hasattr(TRAINER_ALGORITHMS["dpo"], "token_advantages")  # no advantage estimator
