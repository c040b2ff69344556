"""The policy losses (issue 31, point 1): each one's value and gradient against numbers worked out by
hand on one small batch (fp32, CPU), and the two loss tables agree.

The batch: two sequences of three tokens, the second with one padding token; ratios
``rho = exp(logp - old)``; advantages +1 on the first sequence, -0.5 on the second; the clip range
[1 - 0.2, 1 + 0.28] (DAPO's clip-higher) unless a case says otherwise.
"""

from __future__ import annotations

import pytest
import torch

from rlfleet.common.schema.algorithms import POLICY_LOSSES, PolicyLossName
from rlfleet.common.schema.trainer import UpdateSettings
from rlfleet.trainer.algorithms.grpo import aggregate
from rlfleet.trainer.algorithms.policy_losses import TRAINER_POLICY_LOSSES

OLD = torch.tensor([[-1.1, -0.4, -2.5], [-0.3, -0.9, 0.0]])
LOGP = [[-1.0, -0.5, -2.0], [-0.3, -1.2, -9.0]]  # log-ratios 0.1, -0.1, 0.5 | 0.0, -0.3 (pad)
ADV = torch.tensor([[1.0, 1.0, 1.0], [-0.5, -0.5, -0.5]])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
DAPO = UpdateSettings(clip_eps=0.2, clip_eps_high=0.28)


def _run(
    name: str, update: UpdateSettings, agg: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    logp = torch.tensor(LOGP, requires_grad=True)
    per_token, clipped = TRAINER_POLICY_LOSSES[name](logp, OLD, ADV, MASK, update)
    loss = aggregate(per_token, MASK, agg)
    loss.backward()
    assert logp.grad is not None
    return per_token.detach(), clipped, loss.detach(), logp.grad


def _close(got: torch.Tensor, want: list, atol: float = 1e-5) -> None:
    torch.testing.assert_close(got, torch.tensor(want, dtype=got.dtype), atol=atol, rtol=0)


def test_ppo_clip_with_dapo_clip_higher() -> None:
    per_token, clipped, loss, grad = _run("ppo_clip", DAPO, "token-mean")
    # rho = 1.105171, 0.904837, 1.648721 (A=+1: clipped to 1.28) | 1.0, 0.740818 (A=-0.5: 0.8 chosen)
    _close(per_token[MASK.bool()], [-1.105171, -0.904837, -1.28, 0.5, 0.4])
    _close(clipped * MASK, [[0, 0, 1], [0, 1, 0]])  # (the padding token's, masked out, is clipped too)
    _close(loss, -0.4780016)  # (-1.105171 - 0.904837 - 1.28 + 0.5 + 0.4) / 5
    _close(grad, [[-1.105171 / 5, -0.904837 / 5, 0.0], [0.5 / 5, 0.0, 0.0]])  # -A * rho, 0 where clipped
    # a symmetric clip (plain PPO) clips rho = 1.648721 at 1.2 instead
    per_token, _, _, _ = _run("ppo_clip", UpdateSettings(clip_eps=0.2), "token-mean")
    _close(per_token[0, 2], -1.2)


def test_gspo_is_one_ratio_per_sequence() -> None:
    per_token, clipped, loss, grad = _run("gspo", DAPO, "seq-mean-token-mean")
    # s_0 = exp((0.1 - 0.1 + 0.5) / 3) = 1.181360, inside [0.8, 1.28]; s_1 = exp(-0.3 / 2) = 0.860708
    _close(per_token[MASK.bool()], [-1.181360] * 3 + [0.430354] * 2)  # -A * s on every token
    _close(clipped, [[0, 0, 0], [0, 0, 0]])
    _close(loss, -0.375503)  # (-1.181360 + 0.430354) / 2
    # each token: -A * s, over its sequence's length, over 2 sequences; the padding token gets none
    _close(grad, [[-1.181360 / 6] * 3, [0.430354 / 4, 0.430354 / 4, 0.0]])


def test_gspo_clips_whole_sequences() -> None:
    tight = UpdateSettings(clip_eps=3e-4, clip_eps_high=4e-4)  # the paper's ranges
    per_token, clipped, loss, grad = _run("gspo", tight, "seq-mean-token-mean")
    # s_0 = 1.181360 > 1.0004 with A > 0; s_1 = 0.860708 < 0.9997 with A < 0: both clipped, no gradient
    _close(per_token[MASK.bool()], [-1.0004] * 3 + [0.49985] * 2)
    _close(clipped[MASK.bool()], [1.0] * 5)
    _close(grad, [[0.0] * 3, [0.0] * 3])


def test_cispo_keeps_every_tokens_gradient() -> None:
    per_token, clipped, loss, grad = _run("cispo", DAPO, "token-mean")
    # w = clip(rho, 0.8, 1.28) without gradient: 1.105171, 0.904837, 1.28 | 1.0, 0.8; loss = -w * A * logp
    _close(per_token[MASK.bool()], [1.105171, 0.4524185, 2.56, -0.15, -0.48])
    _close(clipped, [[0, 0, 1], [0, 1, 1]])  # the padding token's ratio (e^-9) is clipped too, masked out
    _close(loss, 0.6975179)  # (1.105171 + 0.4524185 + 2.56 - 0.15 - 0.48) / 5
    _close(grad, [[-1.105171 / 5, -0.904837 / 5, -1.28 / 5], [0.5 / 5, 0.4 / 5, 0.0]])  # clipped tokens too


def test_at_equal_weights_every_loss_is_the_policy_gradient() -> None:
    """rho = 1 everywhere: each loss's gradient is -A on every token (token-mean), nothing clipped."""
    for name in TRAINER_POLICY_LOSSES:
        logp = torch.tensor(LOGP, requires_grad=True)
        per_token, clipped = TRAINER_POLICY_LOSSES[name](logp, logp.detach(), ADV, MASK, DAPO)
        aggregate(per_token, MASK, "token-mean").backward()
        assert logp.grad is not None
        _close(logp.grad, [[-0.2] * 3, [0.1, 0.1, 0.0]])
        assert float((clipped * MASK).sum()) == 0.0, name


def test_the_two_tables_agree() -> None:
    from typing import get_args

    assert set(TRAINER_POLICY_LOSSES) == set(POLICY_LOSSES) == set(get_args(PolicyLossName))
    assert UpdateSettings().policy_loss == "ppo_clip" and UpdateSettings().clip_eps_high is None
    with pytest.raises(ValueError, match="policy_loss"):
        UpdateSettings(policy_loss="grpo_magic")
    with pytest.raises(ValueError, match="clip_eps_high"):
        UpdateSettings(clip_eps_high=0.0)
