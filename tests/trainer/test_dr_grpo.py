"""Dr. GRPO (``algorithm: dr_grpo`` with ``loss_agg: seq-mean-token-sum-norm``): its advantages, its loss
value and gradient by hand on a tiny fp32 batch, and a trainer step of it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from batches import update  # this folder's helper module (conftest puts it on sys.path)

from rlfleet.common.schema.trainer import StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms import TRAINER_ALGORITHMS
from rlfleet.trainer.algorithms.dr_grpo import dr_grpo_advantages
from rlfleet.trainer.algorithms.grpo import aggregate, broadcast_to_tokens, grpo_advantages, ppo_policy_loss
from rlfleet.trainer.service import run_step

pytestmark = pytest.mark.timeout(120)

MakeBatch = Callable[..., dict[str, torch.Tensor]]
NORM = "seq-mean-token-sum-norm"
# two prompts, two answers each: the first group 1 and 0, the second 2 and 2 (no signal)
SCORES, GROUPS = torch.tensor([1.0, 0.0, 2.0, 2.0]), torch.tensor([0, 0, 1, 1])
# responses of 2, 3, 1 and 3 tokens, width R = 3
MASK = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0], [1, 1, 1]])


def test_the_advantages_are_centred_in_the_group_without_the_std() -> None:
    torch.testing.assert_close(dr_grpo_advantages(SCORES, GROUPS), torch.tensor([0.5, -0.5, 0.0, 0.0]))
    half = 0.5 / (0.5**0.5 + 1e-6)  # GRPO divides by the group's std, sqrt(0.5)
    torch.testing.assert_close(grpo_advantages(SCORES, GROUPS), torch.tensor([half, -half, 0.0, 0.0]))
    algorithm = TRAINER_ALGORITHMS["dr_grpo"]
    torch.testing.assert_close(algorithm.advantages(SCORES, GROUPS), dr_grpo_advantages(SCORES, GROUPS))


def test_the_loss_and_its_gradient_by_hand() -> None:
    logp = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -1.5, -2.5], [-2.0, -1.0, -1.0], [-1.0, -1.0, -1.0]])
    logp.requires_grad_(True)
    adv = broadcast_to_tokens(dr_grpo_advantages(SCORES, GROUPS), MASK)
    # on-policy (ratio 1, nothing clipped): token loss -A_i; each sequence's sum over the width R = 3,
    # then the mean over N = 4: (-0.5 * 2 / 3 + 0.5 * 3 / 3 + 0 + 0) / 4 = 1 / 24
    loss, metrics = ppo_policy_loss(logp, logp.detach(), adv, MASK, loss_agg=NORM)
    assert loss.dtype == torch.float32 and loss.item() == pytest.approx(1 / 24, rel=1e-6)
    assert metrics["clip_frac"].item() == 0.0
    loss.backward()
    # d loss / d logp_it = -A_i * ratio / (N * R) on real tokens: -1/24 on answer 1, +1/24 on answer 2
    expected = torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.0]]) / 24
    torch.testing.assert_close(logp.grad, expected)
    # GRPO's own aggregation (each answer's token mean) weighs the two answers alike: their losses cancel
    per_token = -adv
    assert aggregate(per_token, MASK, "seq-mean-token-mean").item() == pytest.approx(0.0, abs=1e-7)
    assert aggregate(per_token, MASK, "token-mean").item() == pytest.approx(0.5 / 9, rel=1e-6)


def test_micro_batches_add_up_with_the_whole_batchs_divisors() -> None:
    per_token = -broadcast_to_tokens(dr_grpo_advantages(SCORES, GROUPS), MASK)
    parts = [
        aggregate(per_token[i : i + 2], MASK[i : i + 2], NORM, num_seqs=4.0, response_width=3.0)
        for i in (0, 2)
    ]
    assert sum(part.item() for part in parts) == pytest.approx(1 / 24, rel=1e-6)


def test_a_dr_grpo_step_is_the_policy_update_on_its_advantages(
    tiny_model_dir: Path, make_batch: MakeBatch
) -> None:
    prompts, responses = [3, 5, 2, 4], [4, 2, 6, 3]  # width R = 6
    scores = [1.0, 0.0, 0.2, 0.6]  # groups of two: A = [0.5, -0.5, -0.2, 0.2]
    batch = make_batch(prompts, responses)
    settings = StepSettings(
        algorithm="dr_grpo",
        update=UpdateSettings(loss_agg=NORM, learning_rate=1e-2, micro_batch_size=2, kl_coef=0.0),
    )
    ours, theirs = (
        Actor(tiny_model_dir, seed=0, learning_rate=1e-2),
        Actor(tiny_model_dir, seed=0, learning_rate=1e-2),
    )
    metrics = run_step(ours, None, batch, scores, settings)
    # the first, on-policy pass: -(0.5 * 4 - 0.5 * 2 - 0.2 * 6 + 0.2 * 3) / (4 * 6)
    assert metrics["loss"] == pytest.approx(-0.4 / 24, rel=1e-5) and metrics["pg_loss"] == metrics["loss"]
    adv = dr_grpo_advantages(torch.tensor(scores), batch["group_index"])
    expected = update(theirs, batch, adv, micro_batch_size=2, loss_agg=NORM)
    assert expected["loss"] == pytest.approx(metrics["loss"])
    for (name, p), q in zip(ours.model.named_parameters(), theirs.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
