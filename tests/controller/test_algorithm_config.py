"""The algorithm section of TrainerConfig/JobConfig (the schema's class, as it is), the controller-side
KL controller built from the ``kl`` section and ``update.kl_coef``, the PPO reward spec."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from rlfleet.common.errors import ConfigError
from rlfleet.common.schema.config import load_config
from rlfleet.common.schema.trainer import AlgorithmSettings, StepSettings
from rlfleet.controller.config import JobConfig, TrainerConfig
from rlfleet.controller.dpo import dpo_config
from rlfleet.controller.online import advance_kl_controller, build_kl_controller
from rlfleet.controller.ppo import ppo_config, reward_model_spec

REPO = Path(__file__).resolve().parents[2]


def test_the_seed_configs_build() -> None:
    ppo = TrainerConfig(rollout_batch_size=64, train_batch_size=32, rollout={"workers": 4}, kl_coef=0.1)
    assert ppo.algorithm.name == "grpo" and ppo.kl.type == "fixed" and ppo.algorithm.kl_mode is None
    assert (ppo.batch.rollout_batch_size, ppo.rollout.workers, ppo.update.kl_coef) == (64, 4, 0.1)
    assert TrainerConfig(algorithm={"beta": 0.1}).algorithm.beta == 0.1


@pytest.mark.parametrize(
    ("settings", "needle"),
    [
        ({"algorithm": "a2c"}, "'ppo', 'grpo', 'dr_grpo', 'rloo', 'reinforce_pp' or 'dpo'"),
        ({"algorithm": "rloo", "group_size": 1}, "group_size must be greater than or equal to 2 for rloo"),
        ({"kl": {"type": "adaptive"}, "kl_coef": 0.1}, r"kl\.adaptive\.target\n  Field required"),
        (
            {"kl": {"type": "adaptive", "target": 0.05}, "kl_coef": 0.0},
            "kl type 'adaptive' needs kl_coef > 0",
        ),
        ({"kl": {"type": "scheduled"}}, r"kl\.scheduled\.total_steps\n  Field required"),
        ({"kl": {"type": "pid"}}, "'fixed', 'adaptive', 'scheduled'"),
        ({"algorithm": {"kl_mode": "logits"}}, "'loss' or 'reward'"),
        ({"algorithm": {"kl_estimator": "k4"}}, "'k1', 'k2' or 'k3'"),
        ({"algorithm": {"lam": 1.5}}, "less than or equal to 1"),
        ({"algorithm": {"beta": 0.0}}, "greater than 0"),
        ({"algorithm": {"label_smoothing": 0.5}}, "less than 0.5"),
        ({"algorithm": {"value_clip": 0.0}}, "greater than 0"),
    ],
)
def test_bad_algorithm_settings_are_rejected(settings: dict[str, object], needle: str) -> None:
    with pytest.raises(ValidationError, match=needle):
        TrainerConfig(**settings)


def test_single_sample_groups_are_fine_where_nothing_compares_them() -> None:
    for algorithm in ("ppo", "reinforce_pp", "dpo"):
        assert TrainerConfig(algorithm=algorithm, group_size=1).batch.group_size == 1


def test_a_job_needs_a_reward_unless_it_is_dpo(tmp_path: Path) -> None:
    job = tmp_path / "job.yaml"
    job.write_text("model: tiny:x\ndata: {path: pairs.jsonl}\nalgorithm: dpo\n")
    assert load_config(JobConfig, job).reward.spec is None
    with pytest.raises(ConfigError, match="scores rollouts: set reward"):
        load_config(JobConfig, job, ["algorithm=ppo"])


def test_the_example_jobs_pick_their_algorithms() -> None:
    ppo = load_config(JobConfig, REPO / "examples" / "tiny_ppo.yaml")
    dpo = load_config(JobConfig, REPO / "examples" / "tiny_dpo.yaml")
    assert (ppo.algorithm.name, dpo.algorithm.name, dpo.algorithm.beta) == ("ppo", "dpo", 0.1)
    sent = StepSettings.of(ppo, kl_coef=0.5)  # what each step carries to the trainer
    assert sent.algorithm == ppo.algorithm and isinstance(sent.algorithm, AlgorithmSettings)
    algorithm = sent.algorithm
    assert (algorithm.name, algorithm.critic_learning_rate, algorithm.lam, sent.update.kl_coef) == (
        "ppo", 0.003, 0.95, 0.5,
    )  # fmt: skip
    assert sent.update.model_dump(exclude={"kl_coef"}) == ppo.update.model_dump(exclude={"kl_coef"})
    assert sent.batch == ppo.batch


def test_the_kl_controller_is_built_from_the_kl_section() -> None:
    cfg = TrainerConfig(
        kl={"type": "scheduled", "end_coef": 0.0, "total_steps": 100, "schedule": "cosine"}, kl_coef=0.2
    )
    control = build_kl_controller(cfg.kl, cfg.update.kl_coef).state_dict()
    keys = ("kind", "start", "end", "total_steps", "schedule")
    assert [control[key] for key in keys] == ["scheduled", 0.2, 0.0, 100, "cosine"]
    adaptive = TrainerConfig(kl={"type": "adaptive", "target": 0.5, "horizon": 1000}, kl_coef=0.1)
    ctl = build_kl_controller(adaptive.kl, adaptive.update.kl_coef)
    advance_kl_controller(ctl, {"kl": 1.0}, num_samples=100)  # err = clip(1/0.5 - 1) = 0.2
    assert ctl.value == pytest.approx(0.1 * (1 + 0.2 * 100 / 1000))
    advance_kl_controller(ctl, {}, num_samples=100)  # no KL measured: it stays
    assert ctl.value == pytest.approx(0.102)


def test_a_scheduled_controller_advances_even_without_a_measured_kl() -> None:
    cfg = TrainerConfig(kl={"type": "scheduled", "end_coef": 0.0, "total_steps": 10}, kl_coef=0.2)
    ctl = build_kl_controller(cfg.kl, cfg.update.kl_coef)
    advance_kl_controller(ctl, {}, num_samples=5)
    assert ctl.value == pytest.approx(0.1)


def test_the_trainers_set_their_algorithm_and_refuse_another() -> None:
    assert ppo_config(TrainerConfig(kl_coef=0.1)).algorithm.name == "ppo"
    dpo = dpo_config(TrainerConfig(algorithm={"beta": 0.3}, kl_coef=0.2))  # an algorithm setting is no name
    assert (dpo.algorithm.name, dpo.algorithm.beta, dpo.update.kl_coef) == ("dpo", 0.3, 0.2)
    pools = TrainerConfig(rollout={"pools": {"a": {"workers": 2}, "b": {"workers": 1}}})
    assert ppo_config(pools).pool_sizes() == {"a": 2, "b": 1}  # the rest of the config as it was
    with pytest.raises(ValueError, match="use GRPOTrainer for grpo"):
        ppo_config(TrainerConfig(algorithm="grpo"))
    with pytest.raises(ValueError, match="DPOTrainer trains dpo"):
        dpo_config(TrainerConfig(algorithm="rloo"))


def test_a_reward_model_path_becomes_an_rm_component(tmp_path: Path) -> None:
    spec = reward_model_spec(str(tmp_path), None)
    assert spec == {"components": [{"name": "rm", "args": {"path": str(tmp_path.resolve())}}]}
    assert reward_model_spec(None, "charset:allowed=0123456789") == "charset:allowed=0123456789"
    with pytest.raises(ValueError, match="exactly one of"):
        reward_model_spec(None, None)
    with pytest.raises(ValueError, match="exactly one of"):
        reward_model_spec(str(tmp_path), "concise")
