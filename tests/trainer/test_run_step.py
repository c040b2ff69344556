"""One train step per algorithm, in process on a tiny Llama: dispatch, PPO with a critic, KL placement,
and the step's settings (learning rate, clip, micro-batch...) applied as given."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from batches import update  # this folder's helper module (conftest puts it on sys.path)
from pydantic import ValidationError

from rlfleet.common.errors import BatchContractError
from rlfleet.common.schema.trainer import AlgorithmSettings, BatchSettings, StepSettings, UpdateSettings
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms.grpo import PolicyObjective, grpo_advantages, prepare
from rlfleet.trainer.critic import Critic
from rlfleet.trainer.errors import SettingsConflict
from rlfleet.trainer.loop import batch_sizes
from rlfleet.trainer.policy import build_policy_inputs, compute_logprobs
from rlfleet.trainer.service import run_step

pytestmark = pytest.mark.timeout(180)

MakeBatch = Callable[..., dict[str, torch.Tensor]]
PROMPTS, RESPONSES = [3, 5, 2, 4], [4, 2, 6, 3]
SCORES = [1.0, 0.0, 0.2, 0.6]


ALGORITHM_KEYS = ("kl_mode", "kl_estimator", "critic_learning_rate")


def _settings(algorithm: str, num_updates: int = 1, **kwargs: Any) -> StepSettings:
    """A step's settings: ``algorithm`` with its ``ALGORITHM_KEYS`` among ``kwargs``, the others the
    ``update`` section's; ``num_updates`` optimizer steps per batch (``rollout / train_batch_size``)."""
    own = {key: kwargs.pop(key) for key in ALGORITHM_KEYS if key in kwargs}
    base: dict[str, Any] = {"learning_rate": 1e-2, "micro_batch_size": 2, "kl_coef": 0.0}
    return StepSettings(algorithm=AlgorithmSettings(name=algorithm, **own),
                        update=UpdateSettings(**{**base, **kwargs}),
                        batch=BatchSettings(rollout_batch_size=num_updates, train_batch_size=1))  # fmt: skip


def _actor(path: Path, **kwargs: Any) -> Actor:
    return Actor(path, seed=0, learning_rate=1e-2, **kwargs)


def _critic(path: Path) -> Critic:
    return Critic(path, seed=0, learning_rate=1e-2)


def _seq_logprobs(actor: Actor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = build_policy_inputs(batch)
    return compute_logprobs(actor, inputs, micro_batch_size=4).sum(dim=-1)


def test_grpo_with_the_kl_in_the_loss_is_the_policy_update_on_its_advantages(
    tiny_model_dir: Path, make_batch: MakeBatch
) -> None:
    batch = make_batch(PROMPTS, RESPONSES)
    ours, theirs = _actor(tiny_model_dir), _actor(tiny_model_dir)
    metrics = run_step(ours, None, batch, SCORES, _settings("grpo", num_updates=2, kl_coef=0.05))
    adv = grpo_advantages(torch.tensor(SCORES), batch["group_index"])
    expected = update(theirs, batch, adv, micro_batch_size=2, kl_coef=0.05, num_updates=2)
    for (name, p), q in zip(ours.model.named_parameters(), theirs.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    assert metrics["loss"] == pytest.approx(expected["loss"]) and metrics["kl_loss"] == expected["kl_loss"]
    assert metrics["num_optimizer_steps"] == 2 and "kl_reward" not in metrics


def test_ppo_trains_the_critic_and_the_policy_and_reports_their_health(
    tiny_model_dir: Path, make_batch: MakeBatch
) -> None:
    actor, critic = _actor(tiny_model_dir), _critic(tiny_model_dir)
    assert "value_head" not in {n.split(".")[0] for n, _ in actor.model.named_parameters()}
    batch = make_batch(PROMPTS, RESPONSES)
    head = critic.model.value_head.weight.detach().clone()
    settings = _settings("ppo", num_updates=2, kl_coef=0.1, ppo_epochs=2, entropy_coef=0.01)
    metrics = run_step(actor, critic, batch, SCORES, settings)
    assert metrics["num_optimizer_steps"] == 4  # 2 epochs x 2 mini-batches
    wanted = ["clip_frac", "approx_kl", "entropy", "kl", "kl_reward", "advantage/abs_mean"]
    wanted += ["critic/vf_loss", "critic/vf_clip_frac", "critic/explained_variance", "critic/grad_norm"]
    assert [key for key in wanted if key not in metrics] == []
    assert "kl_loss" not in metrics  # ppo's KL goes into the reward
    assert metrics["clip_frac"] > 0 and metrics["approx_kl"] > 0  # later epochs move away from the old policy
    assert not torch.equal(critic.model.value_head.weight, head)


def test_ppo_makes_the_rewarded_response_more_likely(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    actor, critic = _actor(tiny_model_dir), _critic(tiny_model_dir)
    batch = make_batch(PROMPTS, RESPONSES)
    before = _seq_logprobs(actor, batch)
    settings = _settings("ppo", learning_rate=3e-3, kl_coef=0.01)
    for _ in range(3):
        run_step(actor, critic, batch, [1.0, -1.0, -1.0, -1.0], settings)
    gained = _seq_logprobs(actor, batch) - before
    assert gained[0] > 0 and bool((gained[1:] < gained[0]).all()), gained


@pytest.mark.parametrize("algorithm", ["rloo", "reinforce_pp", "grpo"])
def test_a_kl_in_the_reward_penalises_tokens_and_adds_no_loss_term(
    tiny_model_dir: Path, make_batch: MakeBatch, algorithm: str
) -> None:
    settings = _settings(algorithm, kl_coef=0.2, kl_mode="reward", kl_estimator="k2")
    actor = _actor(tiny_model_dir)
    batch = make_batch(PROMPTS, RESPONSES)
    first = run_step(actor, None, batch, SCORES, settings)
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy is still the reference
    second = run_step(actor, None, batch, SCORES, settings)
    assert second["kl"] > 0 and second["kl_reward"] > 0
    assert "kl_loss" not in first and "kl_loss" not in second


def test_the_entropy_bonus_enters_the_loss(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    settings = _settings("reinforce_pp", entropy_coef=0.1, kl_mode="loss")
    metrics = run_step(_actor(tiny_model_dir), None, make_batch(PROMPTS, RESPONSES), SCORES, settings)
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"] - 0.1 * metrics["entropy"], rel=1e-5)


def test_step_settings_resolve_defaults_and_batch_sizes(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    ppo = _settings("ppo", num_updates=4, micro_batch_size=8, kl_coef=0.3, clip_eps=0.1)
    assert (ppo.algorithm.resolved_kl_mode(), ppo.algorithm.resolved_kl_estimator()) == ("reward", "k1")
    assert batch_sizes(ppo, 12) == (3, 3)  # 4 mini-batches of 3; the micro-batch fits in one
    grpo = _settings("grpo", kl_coef=0.05)
    assert (grpo.algorithm.resolved_kl_mode(), grpo.algorithm.resolved_kl_estimator()) == ("loss", "k3")
    assert batch_sizes(grpo, 8) == (8, 2)
    actor = _actor(tiny_model_dir)
    prepared = prepare(actor, make_batch(PROMPTS, RESPONSES), torch.zeros(4), micro_batch_size=4,
                       with_reference=True)  # fmt: skip
    assert PolicyObjective(actor, prepared, ppo).kl_coef == 0.0  # in the reward, not in the loss
    assert PolicyObjective(actor, prepared, grpo).kl_coef == 0.05


def test_a_steps_settings_are_the_ones_used(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    """Learning rate, weight decay, clip range and micro-batch come with each step and are used as given."""
    actor, critic = _actor(tiny_model_dir, warmup_steps=2), _critic(tiny_model_dir)
    batch = make_batch(PROMPTS, RESPONSES)
    settings = _settings("ppo", learning_rate=4e-3, critic_learning_rate=1e-3)
    first = run_step(actor, critic, batch, SCORES, settings)
    assert first["lr"] == pytest.approx(4e-3 * 0.5)  # half-way through the actor's warm-up
    assert first["critic/lr"] == pytest.approx(1e-3)
    assert first["settings/clip_eps"] == 0.2 and first["settings/micro_batch_size"] == 2
    changed = _settings("ppo", learning_rate=2e-3, weight_decay=0.1, clip_eps=0.05, micro_batch_size=3)
    second = run_step(actor, critic, batch, SCORES, changed)
    assert second["lr"] == pytest.approx(2e-3) and second["critic/lr"] == pytest.approx(2e-3)  # warm-up done
    assert second["settings/clip_eps"] == 0.05 and second["settings/micro_batch_size"] == 3
    for model in (actor, critic):
        assert {g["weight_decay"] for g in model.optimizer.param_groups} == {0.1}
        assert model.scheduler.base_lrs == [2e-3]
    assert second["clip_frac"] == 0.0  # an on-policy step: nothing to clip; a tight clip range shows next
    tight = run_step(actor, critic, batch, SCORES, _settings("ppo", learning_rate=2e-3, ppo_epochs=2,
                                                            clip_eps=0.001))  # fmt: skip
    loose = run_step(actor, critic, batch, SCORES, _settings("ppo", learning_rate=2e-3, ppo_epochs=2,
                                                            clip_eps=10.0))  # fmt: skip
    assert tight["clip_frac"] > 0 and loose["clip_frac"] == 0.0
    capped = run_step(actor, critic, batch, SCORES, _settings("ppo", num_updates=2, micro_batch_size=8))
    assert capped["settings/micro_batch_size"] == 2  # a micro-batch is at most a mini-batch of 2 rows


def test_the_algorithm_must_exist_and_ppo_needs_a_critic(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    with pytest.raises(ValidationError, match="algorithm"):
        StepSettings(algorithm="a2c")
    batch = make_batch(PROMPTS, RESPONSES)
    with pytest.raises(SettingsConflict, match="critic: run ppo trains one, worker holds none") as refused:
        run_step(_actor(tiny_model_dir), None, batch, SCORES, _settings("ppo"))
    assert refused.value.code == "settings_conflict"
    with pytest.raises(BatchContractError, match="3 scores for 4 samples"):
        run_step(_actor(tiny_model_dir), None, batch, [1.0] * 3, _settings("grpo"))
