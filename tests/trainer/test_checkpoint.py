"""Training checkpoints round-trip: model, optimizer, scheduler, RNG and critic come back exactly.

An actor (and a critic) trains a step, is saved, trains a second; a fresh pair loaded from the
save trains the same second step. Everything must match bit for bit on CPU.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from batches import update  # this folder's helper module (conftest puts it on sys.path)

from rlfleet.common.schema.trainer import StepSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.ppo import ValueObjective
from rlfleet.trainer.checkpoint import load_checkpoint, load_training_state, save_checkpoint
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.errors import CheckpointError
from rlfleet.trainer.loop import accumulate
from rlfleet.trainer.policy import build_policy_inputs

PROMPTS, RESPONSES = [3, 5, 2, 4], [4, 2, 5, 3]


def _pair(path: Path) -> tuple[Actor, Critic]:
    optim = {"learning_rate": 1e-2, "weight_decay": 0.01, "warmup_steps": 3}
    actor = Actor(path, seed=5, **optim)
    critic = Critic(path, seed=5, **optim)
    return actor, critic


def _train(actor: Actor, critic: Critic, batch: dict[str, torch.Tensor], step: int) -> dict[str, float]:
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5]) * (step + 1)
    metrics = update(actor, batch, adv, micro_batch_size=2, num_updates=2)
    inputs = build_policy_inputs(batch)
    old = critic.compute_values(inputs, micro_batch_size=4)
    returns = adv[:, None] * inputs.response_mask
    accumulate(ValueObjective(critic, inputs, old, returns, StepSettings()), torch.arange(4), 2)
    metrics.update(critic.optimizer_step(max_grad_norm=1.0))
    metrics["noise"] = float(torch.rand(()).item()) + random.random()  # the global RNGs come back too
    return metrics


def _assert_same_state(a: torch.nn.Module, b: torch.nn.Module) -> None:
    for (name, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items(), strict=True):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=name)


@pytest.mark.timeout(120)
def test_a_loaded_checkpoint_continues_like_the_saved_run(
    tiny_model_dir: Path, make_batch: Callable, tmp_path: Path
) -> None:
    batch = make_batch(PROMPTS, RESPONSES)
    actor, critic = _pair(tiny_model_dir)
    _train(actor, critic, batch, 0)
    save_checkpoint(tmp_path / "ckpt", actor, critic, mode="full")
    assert actor.steps == 2  # one update of 2 shuffled mini-batches
    assert (tmp_path / "ckpt" / "hf" / "config.json").is_file()
    expected = _train(actor, critic, batch, 1)

    torch.manual_seed(999)  # a fresh process would be anywhere else
    random.seed(999)
    other, other_critic = _pair(tiny_model_dir)
    assert load_checkpoint(tmp_path / "ckpt", other, other_critic) == 2
    assert other.scheduler.last_epoch == 2 and other_critic.steps == 1
    got = _train(other, other_critic, batch, 1)
    assert got == expected
    _assert_same_state(actor.model, other.model)
    _assert_same_state(critic.model, other_critic.model)
    for mine, theirs in ((actor, other), (critic, other_critic)):
        ours_state, their_state = mine.optimizer.state_dict(), theirs.optimizer.state_dict()
        assert ours_state["param_groups"] == their_state["param_groups"]
        for key, state in ours_state["state"].items():
            for name, value in state.items():
                torch.testing.assert_close(their_state["state"][key][name], value, rtol=0, atol=0)


def test_loading_needs_a_full_checkpoint(tiny_model_dir: Path, tmp_path: Path) -> None:
    actor, critic = _pair(tiny_model_dir)
    save_checkpoint(tmp_path / "hf-only", actor, None, mode="hf")
    with pytest.raises(CheckpointError, match="state.json"):
        load_checkpoint(tmp_path / "hf-only", actor, None)
    save_checkpoint(tmp_path / "full", actor, None, mode="full")
    with pytest.raises(CheckpointError, match="critic"):
        load_training_state(tmp_path / "full" / "trainer", actor, critic)
