"""The PPO critic on a tiny Llama: value alignment, padding, micro-batching, and learning a fixed target."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rlfleet.common.schema.trainer import AlgorithmSettings, StepSettings, UpdateSettings
from rlfleet.trainer.algorithms.ppo import ValueObjective
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.errors import ModelLoadError
from rlfleet.trainer.loop import accumulate
from rlfleet.trainer.policy import build_policy_inputs

pytestmark = pytest.mark.timeout(120)

PROMPTS, RESPONSES = [3, 5, 2, 4], [4, 2, 6, 3]
MakeBatch = Callable[..., dict[str, torch.Tensor]]


def _critic(path: Path, lr: float = 1e-3) -> Critic:
    return Critic(path, learning_rate=lr, weight_decay=0.0)


def test_the_value_of_a_token_is_read_before_the_token(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    critic = _critic(tiny_model_dir)
    batch = make_batch([4], [5])
    before = critic.compute_values(build_policy_inputs(batch), micro_batch_size=4)
    batch["response_ids"][0, 2] = (batch["response_ids"][0, 2] + 1) % 60 + 3  # change response token 2
    after = critic.compute_values(build_policy_inputs(batch), micro_batch_size=4)
    torch.testing.assert_close(after[0, :3], before[0, :3])  # V_0..V_2 do not see token 2
    assert not torch.allclose(after[0, 3:], before[0, 3:])


def test_values_are_zero_at_padding_and_ignore_left_padding(
    tiny_model_dir: Path, make_batch: MakeBatch
) -> None:
    critic = _critic(tiny_model_dir)
    batch = make_batch(PROMPTS, RESPONSES)
    values = critic.compute_values(build_policy_inputs(batch), micro_batch_size=2)
    assert values.shape == batch["response_mask"].shape
    assert bool((values[batch["response_mask"] == 0] == 0).all())
    alone = {k: v[2:3] for k, v in batch.items()}
    alone["prompt_ids"], alone["prompt_mask"] = alone["prompt_ids"][:, -2:], alone["prompt_mask"][:, -2:]
    alone["response_ids"], alone["response_mask"] = (
        alone["response_ids"][:, :6],
        alone["response_mask"][:, :6],
    )
    single = critic.compute_values(build_policy_inputs(alone), micro_batch_size=1)
    torch.testing.assert_close(single[0], values[2, :6], atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("loss_agg", ["token-mean", "seq-mean-token-mean"])
def test_micro_batches_accumulate_the_mini_batch_gradient(
    tiny_model_dir: Path, make_batch: MakeBatch, loss_agg: str
) -> None:
    critic = _critic(tiny_model_dir)
    inputs = build_policy_inputs(make_batch(PROMPTS, RESPONSES))
    old = critic.compute_values(inputs, micro_batch_size=4) + 0.1
    returns = torch.randn(old.shape, generator=torch.Generator().manual_seed(0)) * inputs.response_mask
    rows = torch.arange(4)
    settings = StepSettings(
        algorithm=AlgorithmSettings(value_clip=0.05), update=UpdateSettings(loss_agg=loss_agg)
    )
    loss = ValueObjective(critic, inputs, old, returns, settings)
    grads, metrics = [], []
    for micro in (4, 1, 3):
        metrics.append(accumulate(loss, rows, micro))
        grads.append({n: p.grad.clone() for n, p in critic.model.named_parameters() if p.grad is not None})
        critic.optimizer.zero_grad(set_to_none=True)
    assert metrics[0]["critic/vf_clip_frac"] > 0
    for other, other_metrics in zip(grads[1:], metrics[1:], strict=True):
        for name, grad in other.items():
            torch.testing.assert_close(grad, grads[0][name], atol=1e-6, rtol=1e-4, msg=name)
        for key, value in metrics[0].items():
            assert other_metrics[key] == pytest.approx(value, rel=1e-4, abs=1e-7), key


def test_the_value_loss_decreases_on_a_fixed_batch(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    critic = _critic(tiny_model_dir, lr=1e-2)
    inputs = build_policy_inputs(make_batch(PROMPTS, RESPONSES))
    returns = torch.tensor([1.0, -1.0, 0.5, 2.0])[:, None] * inputs.response_mask
    unclipped = StepSettings(algorithm=AlgorithmSettings(value_clip=None))
    losses = []
    for _ in range(12):
        old = critic.compute_values(inputs, micro_batch_size=4)
        loss = ValueObjective(critic, inputs, old, returns, unclipped)
        losses.append(accumulate(loss, torch.arange(4), 2)["critic/vf_loss"])
        step = critic.optimizer_step(max_grad_norm=1.0)
    assert losses[-1] < 0.3 * losses[0], losses
    assert step["critic/lr"] == pytest.approx(1e-2) and critic.steps == 12


def test_a_missing_backbone_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no config.json"):
        _critic(tmp_path)
