"""One train step per algorithm, in process on a tiny Llama: dispatch, PPO with a critic, KL placement."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from rlfleet.common.errors import ConfigError
from rlfleet.common.messages import TrainStepRequest
from rlfleet.trainer.actor import Actor
from rlfleet.trainer.algorithms import grpo_advantages
from rlfleet.trainer.config import ActorConfig, OptimizerConfig
from rlfleet.trainer.errors import InvalidBatch
from rlfleet.trainer.inputs import build_policy_inputs
from rlfleet.trainer.service import TrainerServiceConfig
from rlfleet.trainer.updates import StepSettings, build_critic, check_algorithm, run_update

pytestmark = pytest.mark.timeout(180)

MakeBatch = Callable[..., dict[str, torch.Tensor]]
PROMPTS, RESPONSES = [3, 5, 2, 4], [4, 2, 6, 3]
SCORES = [1.0, 0.0, 0.2, 0.6]


def _service(path: Path, algorithm: str, **kwargs: Any) -> TrainerServiceConfig:
    base: dict[str, Any] = {"learning_rate": 1e-2, "micro_batch_size": 2, "kl_coef": 0.0, "device": "cpu"}
    return TrainerServiceConfig(model_path=str(path), algorithm=algorithm, **{**base, **kwargs})


def _actor(cfg: TrainerServiceConfig) -> Actor:
    optim = OptimizerConfig(lr=cfg.learning_rate, weight_decay=0.0)
    return Actor(ActorConfig(model_path=cfg.model_path, seed=cfg.seed, optim=optim))


def _request(algorithm: str, scores: list[float] = SCORES, step: int = 1, **hyper: Any) -> TrainStepRequest:
    return TrainStepRequest(step=step, rollouts=[], scores=scores, algorithm=algorithm, hyperparams=hyper)


def _seq_logprobs(actor: Actor, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = build_policy_inputs(batch)
    return actor.compute_logprobs(inputs, micro_batch_size=4).sum(dim=-1)


def test_grpo_with_the_kl_in_the_loss_is_the_actor_update_it_always_was(
    tiny_model_dir: Path, make_batch: MakeBatch
) -> None:
    cfg = _service(tiny_model_dir, "grpo", kl_coef=0.05)
    batch = make_batch(PROMPTS, RESPONSES)
    ours, theirs = _actor(cfg), _actor(cfg)
    metrics = run_update(ours, None, cfg, batch, _request("grpo", num_updates=2))
    adv = grpo_advantages(torch.tensor(SCORES), batch["group_index"])
    expected = theirs.update(batch, adv, micro_batch_size=2, kl_coef=0.05, mini_batch_size=2)
    for (name, p), q in zip(ours.model.named_parameters(), theirs.model.parameters(), strict=True):
        torch.testing.assert_close(p, q, msg=name)
    assert metrics["loss"] == pytest.approx(expected["loss"]) and metrics["kl_loss"] == expected["kl_loss"]
    assert metrics["num_optimizer_steps"] == 2 and "kl_reward" not in metrics


def test_ppo_trains_the_critic_and_the_policy_and_reports_their_health(
    tiny_model_dir: Path, make_batch: MakeBatch
) -> None:
    cfg = _service(tiny_model_dir, "ppo", kl_coef=0.1, ppo_epochs=2, entropy_coef=0.01)
    actor, critic = _actor(cfg), build_critic(cfg, "cpu")
    assert critic is not None and "value_head" not in {
        n.split(".")[0] for n, _ in actor.model.named_parameters()
    }
    batch = make_batch(PROMPTS, RESPONSES)
    head = critic.model.value_head.weight.detach().clone()
    metrics = run_update(actor, critic, cfg, batch, _request("ppo", num_updates=2))
    assert metrics["num_optimizer_steps"] == 4  # 2 epochs x 2 mini-batches
    wanted = ["clip_frac", "approx_kl", "entropy", "kl", "kl_reward", "advantage/abs_mean"]
    wanted += ["critic/vf_loss", "critic/vf_clip_frac", "critic/explained_variance", "critic/grad_norm"]
    assert [key for key in wanted if key not in metrics] == []
    assert "kl_loss" not in metrics  # ppo's KL goes into the reward
    assert metrics["clip_frac"] > 0 and metrics["approx_kl"] > 0  # later epochs move away from the old policy
    assert not torch.equal(critic.model.value_head.weight, head)


def test_ppo_makes_the_rewarded_response_more_likely(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    cfg = _service(tiny_model_dir, "ppo", learning_rate=3e-3, kl_coef=0.01)
    actor, critic = _actor(cfg), build_critic(cfg, "cpu")
    batch = make_batch(PROMPTS, RESPONSES)
    before = _seq_logprobs(actor, batch)
    for step in range(1, 4):
        run_update(actor, critic, cfg, batch, _request("ppo", scores=[1.0, -1.0, -1.0, -1.0], step=step))
    gained = _seq_logprobs(actor, batch) - before
    assert gained[0] > 0 and bool((gained[1:] < gained[0]).all()), gained


@pytest.mark.parametrize("algorithm", ["rloo", "reinforce_pp", "grpo"])
def test_a_kl_in_the_reward_penalises_tokens_and_adds_no_loss_term(
    tiny_model_dir: Path, make_batch: MakeBatch, algorithm: str
) -> None:
    cfg = _service(tiny_model_dir, algorithm, kl_coef=0.2, algo={"kl_mode": "reward", "kl_estimator": "k2"})
    actor = _actor(cfg)
    batch = make_batch(PROMPTS, RESPONSES)
    first = run_update(actor, None, cfg, batch, _request(algorithm))
    assert first["kl"] == pytest.approx(0.0, abs=1e-7)  # the policy is still the reference
    second = run_update(actor, None, cfg, batch, _request(algorithm, step=2))
    assert second["kl"] > 0 and second["kl_reward"] > 0
    assert "kl_loss" not in first and "kl_loss" not in second


def test_the_entropy_bonus_enters_the_loss(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    cfg = _service(tiny_model_dir, "reinforce_pp", entropy_coef=0.1, algo={"kl_mode": "loss"})
    metrics = run_update(_actor(cfg), None, cfg, make_batch(PROMPTS, RESPONSES), _request("reinforce_pp"))
    assert metrics["loss"] == pytest.approx(metrics["pg_loss"] - 0.1 * metrics["entropy"], rel=1e-5)


def test_step_settings_resolve_defaults_and_request_overrides(tiny_model_dir: Path) -> None:
    ppo = StepSettings.of(_service(tiny_model_dir, "ppo", micro_batch_size=8), _request("ppo", kl_coef=0.3,
                          clip_eps=0.1, num_updates=4), num_rows=12)  # fmt: skip
    assert (ppo.kl_mode, ppo.kl_estimator, ppo.kl_coef, ppo.loss.kl_coef) == ("reward", "k1", 0.3, 0.0)
    assert (ppo.loss.clip_eps, ppo.plan.mini_batch_size, ppo.plan.micro_batch_size) == (0.1, 3, 3)
    grpo = StepSettings.of(_service(tiny_model_dir, "grpo", kl_coef=0.05), _request("grpo"), num_rows=8)
    assert (grpo.kl_mode, grpo.kl_estimator, grpo.loss.kl_coef, grpo.plan.mini_batch_size) == (
        "loss",
        "k3",
        0.05,
        None,
    )


def test_the_algorithm_must_exist_and_ppo_needs_a_critic(tiny_model_dir: Path, make_batch: MakeBatch) -> None:
    with pytest.raises(ConfigError, match="expected one of"):
        check_algorithm("a2c", None)
    cfg = _service(tiny_model_dir, "grpo")
    assert build_critic(cfg, "cpu") is None
    with pytest.raises(ConfigError, match="without a critic"):
        run_update(_actor(cfg), None, cfg, make_batch(PROMPTS, RESPONSES), _request("ppo"))
    with pytest.raises(InvalidBatch, match="3 scores for 4 samples"):
        run_update(_actor(cfg), None, cfg, make_batch(PROMPTS, RESPONSES), _request("grpo", scores=[1.0] * 3))
